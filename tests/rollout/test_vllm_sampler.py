"""The rollout on sampler=vllm, against the stand-in tests/fake_vllm.py (vLLM's observable
behaviour, from its source) where no GPU is, or the real vLLM where one is: the engine starts for any
seed, every (prompt, sample) has its own seed, both samplers stop at the same token, each rank's
engine sits on its own GPU, the prompt limit follows vllm.max_model_len, settings vLLM refuses are
refused before a model loads, and the engine's GPU memory is back before the scoring models load."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from packaging.version import Version

from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.data import schema
from prmflow import tasks
from prmflow.errors import ConfigError
from prmflow.components.sampling import engines, vllm_engine
from prmflow.components.rollout import model_passes as passes, stage
from prmflow.components.sampling.engines import SamplingParams
from prmflow.components.sampling.vllm_engine import VLLMEngine, VLLMSettings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(),
                                reason="these tests read what the CPU stand-in (fake_vllm.py) recorded; tests/rollout/"
                                       "test_engines.py runs the real vLLM here")

SMALL = {"num_prompts": 4, "n_samples": 2, "sampling.max_new_tokens": 16, "tracking.enabled": False,
         "sampler": "vllm", "dtype": "float32", "vllm.gpu_memory_utilization": 0.4}


def make_cfg(policy, output, **over):
    return config.load(stage.Config, overrides={**SMALL, "policy": str(policy), "output": str(output), **over})


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """One process on a machine with 8 GPUs, whatever launched the tests (the stand-in reads the env)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRMFLOW_RANK_GPU", "VLLM_WORKER_MULTIPROC_METHOD",
                "TRITON_F32_DEFAULT", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "")  # recorded, so what the adapter sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")


def test_seed_42_builds_the_engine_and_vllm_gets_a_numpy_seed(vllm_module, tmp_path, sft_policy):
    """The seed mixed from (seed, iteration, shard) is ~4e10 for seed 42; numpy (vLLM seeds it) takes < 2^32."""
    assert passes.sampling_seed(make_cfg(sft_policy, tmp_path / "x", seed=42)) >= 2**32
    metrics = stage.run(make_cfg(sft_policy, tmp_path / "out", seed=42, iteration=3, shard=1, num_shards=2))
    llm = vllm_module.ENGINES[-1]
    assert 0 <= llm.seed < 2**32
    assert metrics["rollout/samples"] == 2 * 2
    # another (seed, iteration, shard) gives another engine seed, still in range
    stage.run(make_cfg(sft_policy, tmp_path / "out2", seed=43, iteration=3, shard=1, num_shards=2))
    assert vllm_module.ENGINES[-1].seed != llm.seed and 0 <= vllm_module.ENGINES[-1].seed < 2**32


def test_every_sample_of_every_shard_has_its_own_seed(vllm_module, tmp_path, sft_policy):
    """vLLM draws sample j of a request from seed + j: no two (prompt, sample) pairs may share a seed, within
    a shard or across shards and iterations (their noise would be the same), and every seed fits int64."""
    seeds = []
    for iteration in (0, 1):
        for shard in (0, 1):
            cfg = make_cfg(sft_policy, tmp_path / f"i{iteration}-s{shard}", num_prompts=8, n_samples=4,
                           **{"sampling.max_new_tokens": 2}, iteration=iteration, shard=shard, num_shards=2)
            stage.run(cfg)
            llm = vllm_module.ENGINES[-1]
            assert len(llm.sample_seeds) == 4 * 4  # 4 prompts in this shard, 4 samples each
            assert [p.seed + j for p in llm.params for j in range(p.n)] == llm.sample_seeds
            seeds += llm.sample_seeds
    assert len(set(seeds)) == len(seeds) == 4 * 16
    assert all(0 <= s < 2**63 for s in seeds)


def test_request_seeds_are_blocks_of_n_that_stay_in_int64():
    big = vllm_engine.request_seeds(2**63 - 1, 1000, 64)
    assert all(b - a == 64 for a, b in zip(big, big[1:])) and big[-1] + 63 < 2**63
    assert vllm_engine.request_seeds(5, 3, 4) == vllm_engine.request_seeds(5, 3, 4) != vllm_engine.request_seeds(6, 3, 4)


@pytest.fixture(scope="module")
def end_of_turn_policy(tmp_path_factory, sft_policy):
    """The SFT policy as a base model whose eos differs from its chat template's end of turn: the tokenizer's
    and the generation config's eos become <unk>, the template closes a turn with </s> (the token the
    policy learned to end its answers with), as a base Qwen2.5 (eos <|endoftext|>) under the chat template."""
    path = tmp_path_factory.mktemp("eot") / "policy"
    shutil.copytree(sft_policy, path)
    tok = modeling.load_tokenizer(str(path))
    end_of_turn = tok.eos_token
    tok.eos_token = tok.unk_token
    tok.add_special_tokens({"additional_special_tokens": [end_of_turn]})  # still special, as <|im_end|> is
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + end_of_turn +
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(path)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            cfg = json.loads((path / name).read_text())
            cfg["eos_token_id"] = tok.unk_token_id
            (path / name).write_text(json.dumps(cfg))
    return path, tok.convert_tokens_to_ids(end_of_turn)


def test_both_samplers_stop_at_the_chat_templates_end_of_turn(vllm_module, tmp_path, end_of_turn_policy):
    """Greedy responses from hf and vllm are the same tokens, ending at the template's end of turn (which is
    neither the tokenizer's nor the generation config's eos); without stop_token_ids vLLM runs on past it."""
    path, end_of_turn = end_of_turn_policy
    tok = modeling.load_tokenizer(str(path))
    assert tok.eos_token_id != end_of_turn
    over = dict(num_prompts=6, n_samples=1, chat_template=False, **{"sampling.temperature": 0, "sampling.max_new_tokens": 40})
    rows = {}
    for sampler in ("hf", "vllm"):
        stage.run(make_cfg(path, tmp_path / sampler, sampler=sampler, **over))
        rows[sampler] = {r["prompt_id"]: r for r in schema.read_dataset(tmp_path / sampler, "rollouts").to_pylist()}
    assert rows["hf"].keys() == rows["vllm"].keys()
    stopped = 0
    for pid, hf_row in rows["hf"].items():
        v_row = rows["vllm"][pid]
        assert v_row["response_ids"] == hf_row["response_ids"]
        assert v_row["finish_reason"] == hf_row["finish_reason"]
        if hf_row["finish_reason"] == "stop":
            assert hf_row["response_ids"][-1] == end_of_turn and end_of_turn not in hf_row["response_ids"][:-1]
            stopped += 1
    assert stopped >= 3  # the policy ends most answers with it
    assert end_of_turn in vllm_module.ENGINES[-1].params[0].stop_token_ids


def test_ignore_eos_sends_no_stop_ids(vllm_module, sft_policy):
    model, tok = modeling.load_causal_lm(str(sft_policy))
    engine = VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3),
                        stop_ids=engines.eos_token_ids(model, tok))
    out = engine.generate([tok("Compute 1+2")["input_ids"]], SamplingParams(n=2, max_new_tokens=5, ignore_eos=True, seed=1))
    assert [len(c.token_ids) for c in out[0]] == [5, 5]
    assert engine.llm.params[-1].stop_token_ids == [] and engine.llm.params[-1]._eos_token_id is None
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this process has initialised CUDA already, so "
                    "the pinned CUDA_VISIBLE_DEVICES=3 cannot take effect here (a torchrun rank starts fresh)")
def test_local_rank_3_puts_the_engine_on_gpu_3(vllm_module, tmp_path, sft_policy, monkeypatch):
    """Under torchrun (LOCAL_RANK=3 of 4) the engine starts with CUDA_VISIBLE_DEVICES=3 and spawned workers;
    with tensor parallel 2, local rank 1 takes GPUs 2 and 3."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    stage.run(make_cfg(sft_policy, tmp_path / "out", num_prompts=8))
    llm = vllm_module.ENGINES[-1]
    assert {k: llm.env[k] for k in ("CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD")} == {
        "CUDA_VISIBLE_DEVICES": "3", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert llm.device == "3"
    assert [r["prompt_token_ids"] for r in llm.requests] and len(llm.requests) == 2  # prompts 3 and 7 of 8
    assert vllm_engine.rank_gpu_index() == 0  # this process now sees its one GPU as cuda:0 (for the scoring models)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a pod given 4 of the node's GPUs
    assert vllm_engine.rank_gpus(1, 2, "4,5,6,7", 0) == "6,7"
    with pytest.raises(ConfigError, match=r"local rank 2 with vllm.tensor_parallel_size=2 needs GPUs 4..5"):
        vllm_engine.rank_gpus(2, 2, "4,5,6,7", 0)


def test_two_engines_on_one_gpu_do_not_fit(vllm_module, sft_policy):
    """What LOCAL_RANK pinning prevents: a second engine on the GPU of a live one fails vLLM's memory check;
    after close() (an explicit shutdown, not garbage collection) the GPU is free again."""
    settings = VLLMSettings(gpu_memory_utilization=0.6)
    first = VLLMEngine(str(sft_policy), "float32", settings=settings)
    with pytest.raises(ValueError, match="Free memory on device cuda:0"):
        VLLMEngine(str(sft_policy), "float32", settings=settings)
    first.close()
    VLLMEngine(str(sft_policy), "float32", settings=settings).close()


def test_a_small_max_model_len_cuts_prompts_to_fit(vllm_module, tmp_path, sft_policy):
    """Prompts (29-31 tokens) are cut to vllm.max_model_len - max_new_tokens = 20, as configured, and counted;
    uncut, vLLM refuses the whole generate call."""
    cfg = make_cfg(sft_policy, tmp_path / "out", **{"vllm.max_model_len": 28, "sampling.max_new_tokens": 8})
    metrics = stage.run(cfg)
    tok = modeling.load_tokenizer(str(sft_policy))
    rows = schema.read_dataset(cfg.output, "rollouts").to_pylist()
    assert metrics["rollout/truncated_prompts"] == 4
    for r in rows:
        assert len(r["prompt_ids"]) == 20 and len(r["prompt_ids"]) + len(r["response_ids"]) <= 28
    assert all(len(p["prompt_token_ids"]) == 20 for p in vllm_module.ENGINES[-1].requests)
    full = {r.prompt_id: tok(r.prompt)["input_ids"] for r in tasks.load("arithmetic", "train", 4, seed=0)}
    assert all(r["prompt_ids"] == full[r["prompt_id"]][-20:] for r in rows)  # the end of each prompt is kept
    with pytest.raises(ConfigError, match=r"exceeds vllm.max_model_len=28"):
        stage.run(make_cfg(sft_policy, tmp_path / "big", max_prompt_len=24, **{"vllm.max_model_len": 28,
                                                                                "sampling.max_new_tokens": 8}))
    with pytest.raises(ConfigError, match=r"leaves no room for a prompt in vllm.max_model_len=8"):
        stage.run(make_cfg(sft_policy, tmp_path / "none", **{"vllm.max_model_len": 8, "sampling.max_new_tokens": 8}))


@pytest.mark.parametrize("over,match", [({"sampling.temperature": 0, "n_samples": 4}, r"greedy\) with n_samples=4"),
                                        ({"sampling.temperature": 2.5}, r"vLLM accepts temperatures in \[0, 2\]")])
def test_settings_vllm_refuses_are_refused_at_config_time(over, match, tmp_path, sft_policy):
    with pytest.raises(ConfigError, match=match):
        make_cfg(sft_policy, tmp_path / "out", **over)
    make_cfg(sft_policy, tmp_path / "out", **over, sampler="hf")  # the HF engine takes them


def test_a_sample_whose_logprobs_do_not_match_its_tokens_is_an_error(vllm_module, sft_policy, monkeypatch):
    engine = VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3))
    real = engine.llm.generate

    def one_logprob_short(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0].outputs[0].logprobs.pop()
        return out

    monkeypatch.setattr(engine.llm, "generate", one_logprob_short)
    with pytest.raises(RuntimeError, match=r"vLLM returned 4 logprobs for the 5 tokens of prompt 0, sample 0"):
        engine.generate([[5, 6, 7]], SamplingParams(n=1, max_new_tokens=5, ignore_eos=True, seed=0))
    engine.close()


def test_auto_dtype_is_bfloat16_for_vllm_and_float32_on_cpu(vllm_module, tmp_path, sft_policy):
    vllm_cfg = make_cfg(sft_policy, tmp_path / "v", dtype="auto")
    assert passes.model_dtype(vllm_cfg) == "bfloat16"
    assert passes.model_dtype(make_cfg(sft_policy, tmp_path / "h", dtype="auto", sampler="hf", device="cpu")) == "float32"
    stage.run(make_cfg(sft_policy, tmp_path / "v", dtype="auto", num_prompts=2, **{"sampling.max_new_tokens": 4}))
    assert vllm_module.ENGINES[-1].kwargs["dtype"] == "bfloat16"


def test_close_waits_for_the_engines_memory():
    """After shutdown the driver takes the engine's memory back a little later: close() waits for it, and
    says what holds the GPU when it does not come back."""
    free = iter([10, 40, 95])
    now = [0.0]
    got = vllm_engine.wait_for_free_memory(0, 90, timeout_s=60, mem_get_info=lambda d: (next(free), 100),
                                       clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == 95 and now[0] == 1.0
    with pytest.raises(RuntimeError, match=r"GPU 2 has 0.0 GiB free .* 60 s after the vLLM engine shut down.*"
                                           r"Another process holds the GPU"):
        vllm_engine.wait_for_free_memory(2, 90, timeout_s=60, mem_get_info=lambda d: (10, 100),
                                     clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    # an engine core that ran in this process: vLLM keeps part of its memory (vllm-project/vllm#21073)
    with pytest.raises(RuntimeError, match=r"ran in this process .* Set rollout.vllm.in_process: false"):
        vllm_engine.wait_for_free_memory(2, 90, timeout_s=60, mem_get_info=lambda d: (10, 100), in_process=True,
                                     clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_starts_uncompiled_with_decode_graphs_and_without_flashinfer(vllm_module, sft_policy, dtype):
    """prmflow's start options reach vLLM as vLLM spells them (no torch.compile, full CUDA graphs for decode
    batches of 1, 2, 4 ... 512); an image without flashinfer still starts (the adapter turns vLLM's FlashInfer
    sampler off); only a float32 engine asks Triton for IEEE float32 attention dots; top_k 0 means off."""
    _, tok = modeling.load_causal_lm(sft_policy)
    eng = VLLMEngine(str(sft_policy), dtype, settings=VLLMSettings(gpu_memory_utilization=0.3))
    llm = eng.llm
    assert llm.kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}
    assert llm.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert llm.env["TRITON_F32_DEFAULT"] == ("ieee" if dtype == "float32" else None) and not llm.tf32_attention
    eng.generate([tok("1+2=")["input_ids"]], SamplingParams(n=1, temperature=1.0, top_k=0, max_new_tokens=2, seed=0))
    assert llm.params[-1].top_k == 0
    eng.close()


def test_in_process_runs_the_engine_core_in_the_stages_process_and_only_when_asked(vllm_module, sft_policy):
    """`vllm.in_process: true` makes the engine core run in the stage's process (no second import of torch
    and vLLM); by default vLLM keeps its own choice (a process of its own), and the two sample alike."""
    _, tok = modeling.load_causal_lm(sft_policy)
    prompt = [tok("1+2=")["input_ids"]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    out = {}
    for in_process in (False, True):
        eng = VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3, in_process=in_process))
        assert eng.llm.core_in_process is in_process
        out[in_process] = [c.token_ids for c in eng.generate(prompt, params)[0]]
        eng.close()
    assert out[True] == out[False]


def test_in_process_is_refused_where_the_rank_gpu_is_not_this_process_cuda_0(vllm_module, sft_policy, monkeypatch):
    """vLLM's in-process core runs on this process's cuda:0 (uniproc_executor.py `_distributed_args`). Local rank 1
    is cuda:0 here only when its CUDA_VISIBLE_DEVICES was pinned before CUDA started; after, the engine would land on
    rank 0's GPU: refused with the key to change, before any engine starts. A fresh rank and the spawned core are fine."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    # the 8 GPUs are the stand-in's: the engine's free-memory probe must not ask this machine's real GPU 1, which
    # a one-GPU machine has not (an H200, 2026-11-27: "invalid device ordinal")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    made = len(vllm_module.ENGINES)
    with pytest.raises(ConfigError, match=r"rollout.vllm.in_process=true: this rank's GPU is cuda:1 .*vllm.in_process=false"):
        VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(in_process=True), local_rank=1)
    assert len(vllm_module.ENGINES) == made
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # each call below is a fresh rank of 8
    VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(in_process=False), local_rank=1).close()
    assert vllm_module.ENGINES[-1].device == "1" and not vllm_module.ENGINES[-1].core_in_process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a torchrun rank that starts CUDA after the pin
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(in_process=True), local_rank=1).close()
    assert vllm_module.ENGINES[-1].core_in_process and vllm_engine.rank_gpu_index() == 0


@pytest.mark.parametrize("version", ["0.10.0", "0.15.1", "0.16.0", "0.33.0"])
def test_load_weights_samples_the_new_policy_as_a_fresh_engine_would(vllm_module, sft_policy, tmp_path, monkeypatch,
                                                                      version):
    """On every vLLM of the range, a running engine given the next policy's directory samples (tokens and logprobs)
    exactly as an engine started on it: from 0.16 by reload_weights(weights_path=...) with its prefix cache (KV of the
    old weights) dropped; before, whose reload_weights takes no path (the stand-in's TypeError, as the worker's
    signature there), by a new engine on the directory."""
    monkeypatch.setattr(vllm_module, "__version__", version)
    model, tok = modeling.load_causal_lm(sft_policy)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    other = tmp_path / "other"
    modeling.save_pretrained(model, tok, other)
    prompts = [tok(r.prompt)["input_ids"] for r in tasks.load("arithmetic", "eval", 3, seed=1)]
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    settings = VLLMSettings(gpu_memory_utilization=0.3)
    eng = VLLMEngine(str(sft_policy), "float32", settings=settings, stop_ids=[tok.eos_token_id])
    before = eng.generate(prompts, greedy)
    first = eng.llm
    eng.load_weights(str(other))
    after = eng.generate(prompts, greedy)
    if Version(version) >= Version("0.16"):
        assert eng.llm is first and eng.llm.reloads == [str(other)] and eng.llm.prefix_cache_fresh
    else:
        assert not first.alive and eng.llm.kwargs["model"] == str(other) and eng.llm.reloads == []
    eng.close()
    fresh = VLLMEngine(str(other), "float32", settings=settings, stop_ids=[tok.eos_token_id])
    ref = fresh.generate(prompts, greedy)
    fresh.close()
    ids = lambda out: [c.token_ids for (c,) in out]  # noqa: E731
    assert ids(after) == ids(ref) != ids(before)
    assert [c.logprobs for (c,) in after] == [c.logprobs for (c,) in ref]


@pytest.mark.parametrize("settings,sizes", [
    (VLLMSettings(), [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
    (VLLMSettings(max_num_seqs=48), [1, 2, 4, 8, 16, 32, 64]),       # a batch of 33-48 runs padded to 64
    (VLLMSettings(max_num_seqs=8, cudagraph_capture_sizes=[8, 1, 8, 300]), [1, 8]),  # sorted, once each
    (VLLMSettings(max_num_seqs=1024), [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
])
def test_cuda_graphs_are_captured_only_for_decode_batches_that_can_occur(settings, sizes):
    """vLLM decodes at most max_num_seqs sequences at once, so a graph for a larger batch is start time spent
    for nothing; the first size that holds max_num_seqs stays, so the largest batch still replays a graph."""
    assert settings.engine_kwargs()["compilation_config"]["cudagraph_capture_sizes"] == sizes
    assert "compilation_config" not in VLLMSettings(enforce_eager=True, max_num_seqs=48).engine_kwargs()


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
def test_an_in_process_engine_leaves_later_engines_their_own_process(vllm_module, sft_policy, monkeypatch, version):
    """`in_process` sets $VLLM_ENABLE_V1_MULTIPROCESSING=0 for its engine only: after close the variable is as it was,
    and vLLM's environment cache, which an in-process core freezes from 0.13 on, is dropped, so a later engine of the
    process (in_process off) starts its core in its own process again. Before, the variable stayed 0 for good."""
    monkeypatch.setattr(vllm_module, "__version__", version)
    eng = VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3, in_process=True))
    assert eng.llm.core_in_process
    eng.close()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    later = VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3))
    assert not later.llm.core_in_process
    later.close()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a value the pod set is put back, not removed
    VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(gpu_memory_utilization=0.3, in_process=True)).close()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize("version,temperature,refused", [("0.10.1", 0.7, True), ("0.10.1", 1.0, False),
                                                         ("0.10.2", 0.7, False)])
def test_a_tempered_rollout_needs_a_vllm_whose_processed_logprobs_include_the_temperature(
        vllm_module, tmp_path, sft_policy, monkeypatch, version, temperature, refused):
    """vLLM 0.10.0/0.10.1 take processed_logprobs before the temperature: a rollout at 0.7 would record the
    untempered distribution's log-probs, so it is refused before the engine starts, naming the key and the version
    to install; at temperature 1 (raw = processed) and from 0.10.2 the engine runs in processed_logprobs mode."""
    monkeypatch.setattr(vllm_module, "__version__", version)
    cfg = make_cfg(sft_policy, tmp_path / "out", **{"sampling.temperature": temperature, "num_prompts": 2})
    made = len(vllm_module.ENGINES)
    if refused:
        with pytest.raises(ConfigError, match=r"sampling.temperature=0.7 with sampler=vllm: vLLM 0.10.1 .*vllm>=0.10.2"):
            stage.run(cfg)
        assert len(vllm_module.ENGINES) == made
        return
    stage.run(cfg)
    assert vllm_module.ENGINES[-1].kwargs["logprobs_mode"] == "processed_logprobs"


def test_the_engine_keeps_processed_logprobs_and_a_temperature_vllm_would_change_is_refused(vllm_module, sft_policy):
    """behavior_logprobs must be of the distribution sampled: `vllm.extra` cannot switch the log-prob mode, and a
    temperature in (0, 0.01), which vLLM raises to 0.01 (so the rows would name another temperature), is refused."""
    with pytest.raises(ConfigError, match=r"vllm.extra.logprobs_mode='raw_logprobs'"):
        VLLMEngine(str(sft_policy), "float32", settings=VLLMSettings(extra={"logprobs_mode": "raw_logprobs"}))
    with pytest.raises(ConfigError, match=r"sampling.temperature=0.005: vLLM raises"):
        vllm_engine.check_vllm_sampling(1, 0.005)
