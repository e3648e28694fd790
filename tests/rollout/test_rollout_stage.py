"""The rollout stage end to end on the tiny SFT policy, checked against independent references:
a fresh forward pass, the task's verifier, the PRM read on its own tokenization, the separators."""

from __future__ import annotations

import json
import random

import pytest
import torch

from prmflow import cli
from prmflow.components import config
from prmflow.components.data import io, schema, steps
from prmflow.components.models import modeling
from prmflow import tasks
from prmflow.errors import ConfigError, DataError, ModelLoadError, OutputExistsError
from prmflow.tasks import arithmetic
from prmflow.components.rollout import prompts, stage
from prmflow.components.rollout.outcome_rewards import RewardError

SMALL = {"num_prompts": 8, "n_samples": 2, "sampling.max_new_tokens": 48, "tracking.enabled": False}
LOGPROB_ATOL = 1e-5  # float32: the same tokens scored in a padded batch vs alone


def make_cfg(policy, output, **over):
    return config.load(stage.Config, overrides={**SMALL, "policy": str(policy), "output": str(output), **over})


@pytest.fixture(scope="module", params=["hf", "vllm"])
def scored_run(request, tmp_path_factory, sft_policy, shuffled_prm, random_critic):
    """One rollout with every scorer on: PRM (other tokenizer), ref (the policy itself), critic; sampled by
    the HF engine and by vLLM (on CPU its stand-in, tests/fake_vllm.py)."""
    sampler = {"dtype": "float32"}  # checked against float32 references (auto is bf16 on a GPU)
    if request.param == "vllm":
        request.getfixturevalue("vllm_module")
        sampler.update({"sampler": "vllm", "vllm.gpu_memory_utilization": 0.4})
    out = tmp_path_factory.mktemp("rollout") / "iter0"
    cfg = make_cfg(sft_policy, out, prm=str(shuffled_prm), ref=str(sft_policy), critic=str(random_critic), **sampler)
    metrics = stage.run(cfg)
    return cfg, metrics, schema.read_dataset(out, "rollouts").to_pylist()


def test_writes_a_valid_rollouts_directory(scored_run, sft_policy):
    cfg, metrics, rows = scored_run
    _, tok = modeling.load_causal_lm(sft_policy)
    assert json.loads((stage.output_dir(cfg) / io.MANIFEST).read_text())["kind"] == "rollouts"
    assert len(rows) == cfg.num_prompts * cfg.n_samples == metrics["rollout/samples"]
    keys = [(r["prompt_id"], r["sample_idx"]) for r in rows]
    assert len(set(keys)) == len(keys)
    assert sorted({r["sample_idx"] for r in rows}) == [0, 1]
    for r in rows:
        assert r["iteration"] == 0 and r["images"] is None
        assert r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True)
        assert r["prompt_ids"] == tok(r["prompt"])["input_ids"]
        if r["finish_reason"] == "stop":
            assert r["response_ids"][-1] == tok.eos_token_id
        else:
            assert r["finish_reason"] == "length" and len(r["response_ids"]) == cfg.sampling.max_new_tokens
        for col in ("behavior_logprobs", "old_logprobs", "ref_logprobs", "values"):
            assert len(r[col]) == len(r["response_ids"])
    assert metrics["rollout/response_length"] == pytest.approx(sum(len(r["response_ids"]) for r in rows) / len(rows))


def test_old_logprobs_equal_a_fresh_forward_pass(scored_run, sft_policy):
    """old_logprobs = the policy's log p of each response token, recomputed here one row at a time."""
    _, _, rows = scored_run
    model, _ = modeling.load_causal_lm(sft_policy)
    model.eval()
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        p = len(r["prompt_ids"])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0].float(), -1)[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0]
        assert torch.allclose(torch.tensor(r["old_logprobs"]), ref, atol=LOGPROB_ATOL)
        # the sampler's own numbers agree (KV cache vs full pass), and the ref here is the policy itself
        assert torch.allclose(torch.tensor(r["behavior_logprobs"]), ref, atol=1e-4)
        assert torch.allclose(torch.tensor(r["ref_logprobs"]), ref, atol=LOGPROB_ATOL)


def fresh_logprobs(model, r, temperature: float = 1.0) -> torch.Tensor:
    """log p of each response token under softmax(logits / temperature) of `model`, the row alone in one full forward."""
    ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
    p = len(r["prompt_ids"])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
        return torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0]


@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_every_logprob_column_is_of_the_distribution_sampled(sampler, request, tmp_path, sft_policy):
    """At sampling.temperature 0.7 the tokens are drawn from softmax(logits / 0.7): behavior_logprobs (the
    sampler's), old_logprobs (a scoring forward) and ref_logprobs (the ref, here the policy itself, at the
    same temperature as veRL and TRL take it) are that distribution's, checked against a plain forward divided by
    0.7, and the rows say so (logprob_temperature), for the ppo stage to divide its logits alike. Before: all three
    were of logits / 1, off by 1e-1 and more."""
    over = {"dtype": "float32", "sampling.temperature": 0.7, "num_prompts": 4, "old_logprobs": "forward",
            "ref": str(sft_policy)}
    if sampler == "vllm":
        request.getfixturevalue("vllm_module")
        over.update({"sampler": "vllm", "vllm.gpu_memory_utilization": 0.4})
    stage.run(make_cfg(sft_policy, tmp_path / "out", **over))
    rows = schema.read_dataset(tmp_path / "out", "rollouts").to_pylist()
    model, _ = modeling.load_causal_lm(sft_policy)
    model.eval()
    moved = 0.0
    for r in rows:
        assert r["logprob_temperature"] == pytest.approx(0.7)
        ref = fresh_logprobs(model, r, 0.7)
        assert torch.allclose(torch.tensor(r["behavior_logprobs"]), ref, atol=1e-4)
        assert torch.allclose(torch.tensor(r["old_logprobs"]), ref, atol=LOGPROB_ATOL)
        assert torch.allclose(torch.tensor(r["ref_logprobs"]), ref, atol=LOGPROB_ATOL)
        moved = max(moved, float((fresh_logprobs(model, r) - ref).abs().max()))
    assert moved > 1e-2  # the temperature moves these log-probs: the check above can tell the two apart


def test_old_logprobs_from_the_hf_sampler_are_the_policys_own(tmp_path, sft_policy):
    """With the HF sampler in float32 (auto), old_logprobs are the sampler's own numbers and no scoring pass
    runs; they are the log-probs of the temperature-0.7 distribution it sampled from, and they agree with
    what a scoring forward (old_logprobs=forward) writes for the same samples. 1e-4: the KV cache only reorders
    float32 sums (~2e-5 here), while another temperature or a shifted position is off by 1e-1 or more."""
    over = {"dtype": "float32", "sampling.temperature": 0.7, "num_prompts": 4}
    auto = stage.run(make_cfg(sft_policy, tmp_path / "auto", **over))
    forward = stage.run(make_cfg(sft_policy, tmp_path / "forward", old_logprobs="forward", **over))
    assert auto["rollout/logprob_gap"] == 0.0 < forward["rollout/logprob_gap"]  # the second pass ran only there
    a, f = (schema.read_dataset(tmp_path / d, "rollouts").to_pylist() for d in ("auto", "forward"))
    assert [r["response_ids"] for r in a] == [r["response_ids"] for r in f]  # the same samples
    model, _ = modeling.load_causal_lm(sft_policy)
    model.eval()
    for ra, rf in zip(a, f):
        assert ra["old_logprobs"] == ra["behavior_logprobs"]
        ref = fresh_logprobs(model, ra, 0.7)
        assert torch.allclose(torch.tensor(ra["old_logprobs"]), ref, atol=1e-4)
        assert torch.allclose(torch.tensor(rf["old_logprobs"]), ref, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("key,value", [("top_p", 0.9), ("top_k", 20)])
def test_a_truncated_sampling_distribution_is_refused_naming_the_key(key, value, tmp_path, sft_policy):
    """The trainer cannot take its log-probs under the sampler's top-p / top-k truncation: refused at config time,
    naming the key, before anything loads (evaluate keeps them)."""
    with pytest.raises(ConfigError, match=rf"sampling\.{key}={value}: .*Set sampling\.{key}="):
        make_cfg(sft_policy, tmp_path / "out", **{f"sampling.{key}": value})


def test_values_are_the_critic_at_the_position_before_each_token(scored_run, random_critic):
    _, _, rows = scored_run
    critic, _ = modeling.load_scalar_model(random_critic)
    critic.eval()
    for r in rows[:6]:
        p = len(r["prompt_ids"])
        with torch.no_grad():
            v = critic(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0, :, 0]
        assert torch.allclose(torch.tensor(r["values"]), v[p - 1:p - 1 + len(r["response_ids"])], atol=1e-5)


def test_step_ends_land_on_the_separators(scored_run, sft_policy):
    _, _, rows = scored_run
    _, tok = modeling.load_causal_lm(sft_policy)
    for r in rows:
        ids, ends = r["response_ids"], r["step_ends"]
        assert len(ends) == len(steps.steps(r["response"])) == len(r["step_rewards"])
        for k, e in enumerate(ends):
            after = ids[e + 1] if e + 1 < len(ids) else None
            assert after is None or after == tok.eos_token_id or tok.decode([after]) == "\n"
            start = ends[k - 1] + 1 if k else 0
            assert tok.decode(ids[start:e + 1], skip_special_tokens=True).strip("\n") == steps.steps(r["response"])[k]


def test_step_rewards_come_from_the_prms_own_tokens(scored_run, shuffled_prm, sft_policy):
    """Recompute every step score with the PRM on its own character ids (a different numbering than
    the policy's), read at the last character of each step."""
    _, _, rows = scored_run
    prm, prm_tok = modeling.load_scalar_model(shuffled_prm)
    _, policy_tok = modeling.load_causal_lm(sft_policy)
    prm.eval()
    assert prm_tok.get_vocab() != policy_tok.get_vocab()
    questions = {r.prompt_id: r.prompt for r in tasks.load("arithmetic", "train", 8, seed=0)}
    fed_policy_ids_differs = False
    for r in rows:
        text = questions[r["prompt_id"]] + r["response"]
        vocab = prm_tok.get_vocab()
        ids = torch.tensor([[vocab[c] for c in text]])
        with torch.no_grad():
            z = prm(ids).logits[0, :, 0]
        at = [len(questions[r["prompt_id"]]) + end - 1 for _, end in steps.step_spans(r["response"])]
        want = torch.sigmoid(z[at])
        assert torch.allclose(torch.tensor(r["step_rewards"]), want, atol=1e-5)
        with torch.no_grad():  # what feeding the policy's ids would have given
            wrong = torch.sigmoid(prm(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0, :, 0])
        fed_policy_ids_differs |= not torch.allclose(wrong[[len(r["prompt_ids"]) + e for e in r["step_ends"]]], want, atol=1e-3)
    assert fed_policy_ids_differs


def test_outcome_rewards_agree_with_the_verifier(scored_run):
    _, metrics, rows = scored_run
    correct = [arithmetic.verify(r["response"], r["answer"]) for r in rows]
    assert [r["outcome_reward"] for r in rows] == correct
    assert [dict(r["reward_components"]) for r in rows] == [{"arithmetic": c} for c in correct]
    assert metrics["rollout/accuracy"] == pytest.approx(sum(correct) / len(correct))
    assert metrics["rollout/reward/arithmetic"] == pytest.approx(sum(correct) / len(correct))
    assert 0 < sum(correct) < len(correct)  # the SFT policy is right sometimes, wrong sometimes


def test_shards_read_back_as_one_dataset(tmp_path, sft_policy):
    """Two pods each write their shard's directory; the parent reads as one dataset."""
    out = tmp_path / "iter0"
    over = {"num_prompts": 5, "n_samples": 2, "sampling.max_new_tokens": 40, "num_shards": 2}
    for shard in (0, 1):
        stage.run(make_cfg(sft_policy, out / f"shard-{shard}", shard=shard, **over))
    rows = schema.read_dataset(out, "rollouts").to_pylist()
    keys = [(r["prompt_id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)) == 10
    expected = [r.prompt_id for r in prompts.select_prompts(make_cfg(sft_policy, out, **over))]
    assert {r["prompt_id"] for r in rows} == set(expected)
    shard1 = schema.read_dataset(out / "shard-1", "rollouts").to_pylist()
    assert {r["prompt_id"] for r in shard1} == set(expected[1::2])
    # two shards cannot share one directory
    with pytest.raises(OutputExistsError, match="own output directory"):
        stage.run(make_cfg(sft_policy, out / "shard-1", shard=0, **over))


def test_iterations_draw_fresh_prompts_from_a_dataset(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Compute left to right: {i}+1\n", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))
    pick = lambda k: [r.prompt_id for r in prompts.select_prompts(  # noqa: E731
        config.load(stage.Config, overrides={"task": str(data), "num_prompts": 3, "iteration": k}))]
    first, second, third = pick(0), pick(1), pick(2)
    assert sorted(first + second[:2]) == [f"q{i}" for i in range(5)]  # one pass over the data...
    assert second[2:] + third == first + second[:1]  # ...then the same shuffled order again
    assert first != ["q0", "q1", "q2"] or second[:2] != ["q3", "q4"]  # shuffled by the seed


def test_mixed_sources_pick_their_recipe(tmp_path, sft_policy, monkeypatch):
    (tmp_path / "style_reward.py").write_text("def short(response):\n    return 1.0 / (1 + len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = tasks.load("arithmetic", "eval", 4, seed=5)
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({"id": p.prompt_id, "prompt": p.prompt, "answer": p.answer,
                                        "source": "arithmetic" if k % 2 else "word"}) + "\n" for k, p in enumerate(problems)))
    table = [{"source": "arithmetic", "component": "arithmetic"},
             {"source": "word", "component": "math", "weight": 0.5},
             {"source": "word", "component": "function", "function": "style_reward:short", "name": "short", "weight": 2.0}]
    cfg = make_cfg(sft_policy, tmp_path / "out", task=str(data), num_prompts=0, n_samples=1,
                   **{"sampling.max_new_tokens": 40}, rewards=table)
    metrics = stage.run(cfg)
    rows = schema.read_dataset(cfg.output, "rollouts").to_pylist()
    by_id = {p.prompt_id: k for k, p in enumerate(problems)}
    for r in rows:
        comps = dict(r["reward_components"])
        if by_id[r["prompt_id"]] % 2:
            assert comps == {"arithmetic": arithmetic.verify(r["response"], r["answer"])}
        else:
            assert set(comps) == {"math", "short"}
            assert comps["short"] == pytest.approx(1 / (1 + len(r["response"])))
            assert r["outcome_reward"] == pytest.approx(0.5 * comps["math"] + 2.0 * comps["short"])
    assert {"rollout/reward/arithmetic", "rollout/reward/math", "rollout/reward/short"} <= set(metrics)


# --- bad input: a clear error, nothing written --------------------------------------------------

def test_empty_prompt_set_fails(tmp_path, sft_policy):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        stage.run(make_cfg(sft_policy, tmp_path / "out", task=str(tmp_path / "empty.jsonl"), num_prompts=0))
    with pytest.raises(DataError, match="No prompts to sample for shard 3 of 4"):
        stage.run(make_cfg(sft_policy, tmp_path / "out", num_prompts=2, num_shards=4, shard=3))
    assert not (tmp_path / "out").exists()


def test_long_prompts_fail_or_are_truncated_with_a_count(tmp_path, sft_policy):
    with pytest.raises(DataError, match=r"prompt_id='arith-[0-9a-f]+' is \d+ tokens, longer than 12"):
        stage.run(make_cfg(sft_policy, tmp_path / "fail", num_prompts=2, max_prompt_len=12, on_long_prompt="fail"))
    assert not (tmp_path / "fail").exists()
    cfg = make_cfg(sft_policy, tmp_path / "cut", num_prompts=2, n_samples=1, **{"sampling.max_new_tokens": 8}, max_prompt_len=12)
    metrics = stage.run(cfg)
    rows = schema.read_dataset(cfg.output, "rollouts").to_pylist()
    full = {r.prompt_id: r.prompt for r in tasks.load("arithmetic", "train", 2, seed=0)}
    _, tok = modeling.load_causal_lm(sft_policy)
    for r in rows:
        assert r["prompt_ids"] == tok(full[r["prompt_id"]])["input_ids"][-12:]  # the end of the prompt is kept
    assert metrics["rollout/truncated_prompts"] == 2
    with pytest.raises(ConfigError, match="window"):  # the tiny model sees 256 positions
        stage.run(make_cfg(sft_policy, tmp_path / "big", max_prompt_len=250))


def test_a_raising_reward_names_the_row_and_writes_nothing(tmp_path, sft_policy, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(
        "def f(prompt_id, response):\n"
        "    if 'answer' in response:\n"
        "        raise RuntimeError('cannot parse ' + prompt_id)\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(sft_policy, tmp_path / "out", num_prompts=2, n_samples=1,
                   rewards=[{"source": "arithmetic", "component": "function", "function": "flaky_reward:f"}])
    with pytest.raises(RewardError, match=r"raised RuntimeError: cannot parse arith-.* prompt_id='arith-"):
        stage.run(cfg)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_ref_with_another_tokenizer_is_refused_before_sampling(tmp_path, sft_policy):
    alphabet = list(modeling.ALPHABET)
    random.Random(3).shuffle(alphabet)
    model, _ = modeling.build_tiny_model("tiny-llama")
    modeling.save_pretrained(model, modeling.build_tokenizer(alphabet), tmp_path / "ref")
    with pytest.raises(ConfigError, match="different tokenizer"):
        stage.run(make_cfg(sft_policy, tmp_path / "out", ref=str(tmp_path / "ref")))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("over,match", [({"shard": 2, "num_shards": 2}, "shard"), ({"sampling.top_p": 0}, "top_p"),
                                        ({"n_samples": 0}, "n_samples"), ({"rewards": "[{component: nope}]"}, "nope"),
                                        ({"num_prompts": 0}, "dataset file")])
def test_bad_config_is_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        config.load(stage.Config, overrides=over)


# --- command line and tracking ---------------------------------------------------------------------

def test_cli_run_logs_metrics_and_a_sample_table(tmp_path, sft_policy, sqlite_store):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    rc = cli.main(["rollout", "--policy", str(sft_policy), "--output", str(out), "--num_prompts", "3", "--n_samples", "2",
                   "--sampling.max_new_tokens", "40", "--tracking.uri", sqlite_store, "--iteration", "2",
                   "--rewards", "[{source: arithmetic, component: arithmetic, weight: 2.0}]"])
    assert rc == 0
    rows = schema.read_dataset(out, "rollouts").to_pylist()
    assert all(r["iteration"] == 2 and r["outcome_reward"] == 2.0 * arithmetic.verify(r["response"], r["answer"]) for r in rows)
    client = MlflowClient(sqlite_store)
    (run,) = client.search_runs([client.get_experiment_by_name("prmflow").experiment_id])
    assert run.data.tags["prmflow.stage"] == "rollout" and run.data.tags["prmflow.iteration"] == "2"
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length", "rollout/accuracy",
                "rollout/reward/arithmetic", "perf/tokens_per_s"):
        assert key in run.data.metrics
    assert run.data.metrics["rollout/reward_mean"] == pytest.approx(sum(r["outcome_reward"] for r in rows) / len(rows), abs=1e-6)
    (artifact,) = [a.path for a in client.list_artifacts(run.info.run_id) if a.path.startswith("rollout_samples")]
    table = json.loads(open(client.download_artifacts(run.info.run_id, artifact, str(tmp_path))).read())
    assert "steps_with_prm_scores" in table["columns"] and len(table["data"]) == len(rows)
    assert cli.main(["rollout", "--policy", str(sft_policy), "--output", str(out), "--num_shards", "0"]) == 2


def test_recipe_table_and_stop_strings_from_a_yaml_config(tmp_path):
    (tmp_path / "cfg.yaml").write_text(
        "rollout:\n"
        "  stop: [\"\\n\\n\", \"###\"]\n"
        "  rewards:\n"
        "    - {source: arithmetic, component: arithmetic, weight: 0.5}\n"
        "    - {source: gsm8k, component: http, url: 'http://127.0.0.1:9/score', timeout_s: 2}\n")
    cfg = config.load(stage.Config, tmp_path / "cfg.yaml", {"num_prompts": 4}, section="rollout")
    assert cfg.stop == ["\n\n", "###"] and cfg.num_prompts == 4
    assert cfg.rewards[1] == {"source": "gsm8k", "component": "http", "url": "http://127.0.0.1:9/score", "timeout_s": 2}


@pytest.mark.parametrize("key", ["prm", "ref", "critic"])
def test_a_model_path_that_is_not_there_is_named_by_its_key_before_any_sampling(tmp_path, monkeypatch, key):
    """A typo in --prm (or --ref, --critic) failed as "model '...' does not exist" after every response had been
    sampled: minutes on a CPU, an hour of GPU time for a real recipe."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the model paths were checked")

    for name in ("load_causal_lm", "load_tokenizer"):
        monkeypatch.setattr(modeling, name, refuse)
    cfg = make_cfg("tiny-llama", tmp_path / "rollouts", **{key: str(tmp_path / "outputs" / "pmr")})
    with pytest.raises(ModelLoadError, match=rf"^{key} '.*pmr' does not exist. Point {key} at"):
        stage.run(cfg)
    assert list(tmp_path.iterdir()) == []
