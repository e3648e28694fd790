"""The vLLM engine: a thin adapter over vllm.LLM with the same generate() contract as HFEngine
(engines.py), for the GPU node pools (the `gpu` extra).

    engine = VLLMEngine("outputs/sft", "bfloat16", seed=7, stop_ids=eos_token_ids(model, tokenizer), local_rank=3)
    out = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=1024))
    engine.close()   # shut down, wait for the GPU memory, then load the scoring models
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...errors import ConfigError
from ..models.vision import decode_image
from .engines import LENGTH, STOP, Completion, SamplingParams, eos_token_ids

# What the adapter must respect, read from vLLM's own source (0.10 ... 0.33):
# - the engine seed goes to `np.random.seed` (vllm/utils/torch_utils.py `set_random_seed`), which takes
#   only [0, 2^32): `engine_seed` maps any seed into that range;
# - sample j of a request with seed s draws from seed s + j (v1/engine/parallel_sampling.py), and
#   seeds are int64 on the sampler's side: `request_seeds` gives prompt i the block base + i*n, so every
#   (prompt, sample) has its own seed below 2^63;
# - vLLM stops at the tokenizer's eos and the generation config's eos ids, not at a chat template's
#   end of turn (Qwen's `<|im_end|>` under a base model): the HF engine's stop ids go in
#   `stop_token_ids`, unless ignore_eos;
# - temperature 0 with n > 1 and temperature > 2 are refused (SamplingParams._verify_greedy_sampling,
#   _verify_args): `check_vllm_sampling` says so before any model loads;
# - the uniproc executor puts its worker on cuda:<device index>, 0 unless told: under torchrun every
#   rank's engine would share GPU 0. `rank_gpus` gives local rank r the GPUs r*tp ... r*tp + tp - 1
#   through CUDA_VISIBLE_DEVICES, set before the engine starts;
# - a float32 engine is float32 in its torch matmuls (the worker sets torch's float32 matmul precision to
#   $VLLM_FLOAT32_MATMUL_PRECISION, "highest" by default: v0.24.0 vllm/v1/worker/gpu_worker.py:135-136,
#   vllm/envs.py:566), but its attention runs in Triton (FLASH_ATTN takes only fp16/bf16:
#   vllm/v1/attention/backends/flash_attn.py:69; TRITON_ATTN takes float32: triton_attn.py:249), whose
#   `tl.dot(Q, K)` and `tl.dot(P, V)` (vllm/v1/attention/ops/triton_unified_attention.py:520, 562) name no
#   input precision, so Triton's default for float32 operands on a GPU with tensor cores applies: TF32
#   (10-bit mantissa), unless $TRITON_F32_DEFAULT says `ieee`. A logit error of that size moves the
#   log-prob of a likely token by (1 - p) x the error (nothing) but of an unlikely sampled token by the
#   whole error, so a few positions of float32 behavior_logprobs miss a float32 forward by far more than
#   the rest. A float32 engine therefore starts with TRITON_F32_DEFAULT=ieee;
# - with $VLLM_USE_FLASHINFER_SAMPLER unset, the GPU model runner's top-k/top-p sampler imports vLLM's FlashInfer
#   backend while the engine starts (vllm/v1/sample/ops/topk_topp_sampler.py:38-44, envs.py:796-800), so an
#   image without flashinfer cannot start an engine: the adapter sets it to 0 there (the PyTorch-native sampler,
#   which per-request seeds need anyway);
# - top_k 0 is "off" (vllm/sampling_params.py:243, 542-545; -1 is still let through, quietly);
# - a running engine takes new weights of the same architecture from a directory with
#   `collective_rpc("reload_weights", kwargs={"weights_path": ...})` (v1/worker/gpu_worker.py:396-397 ->
#   v1/worker/gpu_model_runner.py:5388); the prefix cache still holds KV computed with the old weights until
#   `reset_prefix_cache()` (entrypoints/llm.py:800);
# - `vllm.LLM` runs its engine core in a process of its own unless $VLLM_ENABLE_V1_MULTIPROCESSING is 0 (vllm/envs.py,
#   default "1"; v1/engine/llm_engine.py `from_engine_args` -> EngineCoreClient.make_client: SyncMPClient, or the
#   in-process InprocClient); it is read when the engine is made. The spawned core imports torch and vLLM again
#   before anything else: 21 s of a 40 s start on an H200 (docs/testing.md). From 0.13 an engine core freezes vLLM's
#   environment reads in its process once it has started (v0.13.0 vllm/v1/engine/core.py:216 `enable_envs_cache()`,
#   envs.py:1591-1611; v0.33.0 core.py:248, envs.py:2310-2329), so an in-process core would pin the variable for every
#   later engine of this process: `close` puts the variable back and drops that cache (`disable_envs_cache`,
#   v0.13.0 envs.py:1613, v0.33.0 envs.py:2331);
# - the log-probs returned are, with logprobs_mode="processed_logprobs", of the distribution sampled: the logits
#   divided by the temperature, then top-k / top-p, log_softmax (v0.10.2 vllm/v1/sample/sampler.py:168-184 and
#   ops/topk_topp_sampler.py forward_native; v0.33.0 sampler.py:326-358); a greedy request's are the raw logits'
#   (sampler.py:326-335 in 0.33.0). In 0.10.0 and 0.10.1 "processed" meant after the penalties, before the
#   temperature (v0.10.0 vllm/v1/sample/sampler.py:58-64, temperature at :127): `check_logprobs_mode` refuses a
#   rollout at a temperature other than 1 there;
# - `reload_weights` takes `weights_path` from 0.16.0 (v0.16.0 vllm/v1/worker/gpu_worker.py:297-298 ->
#   gpu_model_runner.py:4315-4320); before, it takes no argument and re-reads the directory the engine started from
#   (v0.10.0 gpu_worker.py:206-208, gpu_model_runner.py:1910-1915; v0.15.1 gpu_worker.py:280-281): `load_weights`
#   starts a new engine on the new directory there.

NUMPY_SEED_LIMIT = 2**32  # np.random.seed accepts [0, 2^32)
#: the first vLLM whose processed_logprobs include the temperature and top-k/top-p, and whose reload_weights takes a path
TEMPERED_LOGPROBS, RELOAD_WEIGHTS_PATH = "0.10.2", "0.16.0"


def vllm_version():
    """The vLLM's version (packaging.version.Version): `vllm.__version__` once it is imported, else the installed
    distribution's metadata, read without importing vLLM (whose import must not come before `pin_rank_gpus`)."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    module = sys.modules.get("vllm")
    try:
        return Version(module.__version__ if module is not None else version("vllm"))
    except PackageNotFoundError:
        raise ConfigError("sampler=vllm, but vLLM is not installed: pip install 'prmflow[gpu]' (a GPU machine), "
                          "or use sampler=hf.") from None


def check_logprobs_mode(temperature: float, where: str = "sampling") -> None:
    """Refuse a temperature other than 0 or 1 where this vLLM's log-probs would not be of the tempered distribution
    (before 0.10.2, see the rules above): the PPO ratio would compare two different distributions."""
    from packaging.version import Version

    if temperature not in (0, 1) and vllm_version() < Version(TEMPERED_LOGPROBS):
        raise ConfigError(f"{where}.temperature={temperature} with sampler=vllm: vLLM {vllm_version()} returns the "
                          f"log-probs of the untempered distribution (its processed_logprobs come before the "
                          f"temperature before {TEMPERED_LOGPROBS}), so behavior_logprobs would not be of what was "
                          f"sampled. Install vllm>={TEMPERED_LOGPROBS}, set {where}.temperature=1, or use sampler=hf.")

INT64_LIMIT = 2**63  # vLLM keeps request seeds as int64


def _mix(*parts) -> int:
    """64 well-mixed bits of `parts` (blake2b): nearby inputs (shard 3 and shard 4) give unrelated outputs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def engine_seed(seed: int) -> int:
    """The seed handed to `vllm.LLM(seed=...)`: in [0, 2^32), fixed by `seed`.

    vLLM's worker passes it to random.seed, np.random.seed and torch.manual_seed; numpy refuses
    values of 2^32 and more, so a seed mixed from (seed, iteration, shard) cannot go there as it is.
    With a seed on every request (request_seeds) it fixes no sample; it must only be valid."""
    return _mix("vllm-engine", int(seed)) % NUMPY_SEED_LIMIT


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """The vLLM request seed of each prompt (index in the whole list), n samples per prompt.

    vLLM draws sample j of a request from seed `request_seed + j`, so prompt i gets base + i*n and its
    samples base + i*n ... base + i*n + n - 1: one seed per (prompt, sample), none shared. base is a
    62-bit hash of `seed`, so seeds of different shards or iterations (seed, seed + 1, ...) start far
    apart, and base + num_prompts*n stays below 2^63 (int64)."""
    half = INT64_LIMIT // 2  # base < 2^62 and num_prompts*n <= 2^62 keep base + i*n + j below 2^63
    if num_prompts * n > half:
        raise ValueError(f"{num_prompts} prompts x {n} samples need more than 2^62 seeds")
    base = _mix("vllm-requests", int(seed)) % half
    return [base + i * n for i in range(num_prompts)]


def check_vllm_sampling(n: int, temperature: float, where: str = "sampling") -> None:
    """Refuse what vLLM's SamplingParams refuses, naming our keys (vLLM would fail mid-run)."""
    if temperature > 2.0:
        raise ConfigError(f"{where}.temperature={temperature}: vLLM accepts temperatures in [0, 2]; lower it, "
                          f"or use sampler=hf.")
    if 0 < temperature < 1e-2:  # the samples and their log-probs would be of 0.01, the rows would say `temperature`
        raise ConfigError(f"{where}.temperature={temperature}: vLLM raises a temperature in (0, 0.01) to 0.01 "
                          f"(vllm/sampling_params.py, v0.10.0:321-326, v0.33.0:560-568); use 0 (greedy) or 0.01 and more.")
    if temperature < 1e-5 and n > 1:  # vLLM treats temperatures below 1e-5 as greedy
        raise ConfigError(f"{where}.temperature={temperature} (greedy) with n_samples={n}: vLLM refuses greedy "
                          f"decoding with n > 1, and n copies of one response are not a group to compare; set "
                          f"n_samples=1 or a temperature > 0.")


def stop_ids(path: str, tokenizer) -> list[int]:
    """The ids the HF engine stops at for the model at `path` (generation config, eos, the chat
    template's end of turn), read without loading its weights: what vLLM is told to stop at."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from the model config
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    return eos_token_ids(SimpleNamespace(generation_config=generation), tokenizer)


def rank_gpus(local_rank: int, tensor_parallel_size: int, visible: str | None, count: int) -> str:
    """The CUDA_VISIBLE_DEVICES of local rank `local_rank`, whose engine takes `tensor_parallel_size`
    GPUs: entries r*tp ... r*tp + tp - 1 of the GPUs this process sees (`visible`, else 0..count-1)."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(count)]
    lo, hi = local_rank * tensor_parallel_size, (local_rank + 1) * tensor_parallel_size
    if hi > len(ids):
        raise ConfigError(f"local rank {local_rank} with vllm.tensor_parallel_size={tensor_parallel_size} needs GPUs "
                          f"{lo}..{hi - 1}, but this process sees {len(ids)} ({visible or 'all'}); start at most "
                          f"{len(ids) // tensor_parallel_size} processes per node (torchrun --nproc-per-node) or lower "
                          f"vllm.tensor_parallel_size.")
    return ",".join(ids[lo:hi])


def pin_rank_gpus(local_rank: int, tensor_parallel_size: int) -> str:
    """Point CUDA_VISIBLE_DEVICES at this rank's GPUs before its engine starts; returns the value.

    vLLM's engine process (spawned) and its workers read it when they start, so each rank's engine
    lands on its own GPUs. This process sees the same GPUs from then on, unless CUDA was already
    initialized in it (it then keeps seeing all of them): $PRMFLOW_RANK_GPU records which index is
    the rank's first GPU here, for the scoring models (`rank_gpu_index`)."""
    initialized = torch.cuda.is_initialized()
    mine = rank_gpus(local_rank, tensor_parallel_size, os.environ.get("CUDA_VISIBLE_DEVICES"),
                     torch.cuda.device_count())  # before CUDA starts, the count comes from NVML
    os.environ["CUDA_VISIBLE_DEVICES"] = mine
    os.environ["PRMFLOW_RANK_GPU"] = str(local_rank * tensor_parallel_size if initialized else 0)
    return mine


def rank_gpu_index() -> int:
    """Index (as this process sees the GPUs) of this rank's GPU: $PRMFLOW_RANK_GPU after
    `pin_rank_gpus`, else $LOCAL_RANK (torchrun), else 0."""
    return int(os.environ.get("PRMFLOW_RANK_GPU") or os.environ.get("LOCAL_RANK") or 0)


#: what holds the memory when an in-process engine's does not come back (`wait_for_free_memory`'s `in_process`)
IN_PROCESS_LEAK = ("The engine core ran in this process (vllm.in_process: true), and vLLM does not free all of an "
                   "in-process engine's memory when it shuts down (vllm-project/vllm#21073; seen on an H200 with the "
                   "memory agent's rollout, docs/testing.md). Set rollout.vllm.in_process: false.")


def wait_for_free_memory(device: int, want_bytes: int, timeout_s: float = 120.0, poll_s: float = 0.5,
                         mem_get_info: Callable[[int], tuple[int, int]] | None = None,
                         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                         in_process: bool = False) -> int:
    """Wait until GPU `device` has `want_bytes` free (the engine's processes are gone and the driver
    has taken their memory back); returns the free bytes. Raises after timeout_s with what is left and, for an
    engine that ran in this process (`in_process`), why."""
    mem_get_info = mem_get_info or torch.cuda.mem_get_info
    deadline = clock() + timeout_s
    while True:
        free, total = mem_get_info(device)
        if free >= want_bytes:
            return free
        if clock() >= deadline:
            raise RuntimeError(f"GPU {device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB {timeout_s:.0f} s "
                               f"after the vLLM engine shut down; the scoring models need the {want_bytes / 2**30:.1f} "
                               f"GiB that were free before it started. "
                               + (IN_PROCESS_LEAK if in_process else "Another process holds the GPU (nvidia-smi)."))
        sleep(poll_s)


#: CUDA graph batch sizes prmflow captures by default: powers of two up to vLLM's own cap of 512
#: (vLLM's default is 51 sizes: [1, 2, 4] + 8..248 by 8 + 256..512 by 16, v0.24.0 vllm/config/compilation.py:673-685)
CUDAGRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@dataclass
class VLLMSettings:
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take for weights and KV cache."""
    tensor_parallel_size: int = 1
    """GPUs one model is split across."""
    max_model_len: int = 0
    """Context window vLLM reserves cache for; 0 = the model's own. rollout cuts (or refuses, on_long_prompt) its
    prompts to fit it with sampling.max_new_tokens; evaluate and prm-label refuse a prompt that fills it."""
    enforce_eager: bool = False
    """No torch.compile and no CUDA graphs (vLLM then sets both off): the quickest start and the slowest decoding; for
    debugging and tiny runs."""
    compile: bool = False
    """torch.compile the model (vLLM's compilation mode 3) with piecewise CUDA graphs for prefill. Off: no compile at
    start, decoding still replays full CUDA graphs. Off by default as a rollout pod pays a cold compile every iteration
    (docs/testing.md#on-a-gpu)."""
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: list(CUDAGRAPH_SIZES))
    """Decode batch sizes vLLM captures a CUDA graph for (a batch between two sizes runs padded to the next one); each
    size costs capture time at start. Default: powers of two to 512 (10 graphs, against vLLM's 51), captured in 1-2 s on
    an H200; [] = vLLM's own list."""
    max_num_seqs: int = 0
    """Sequences vLLM decodes at once; 0 = vLLM's (1024 on an H100/H200 for offline use, 256 on smaller GPUs). It also
    sizes the start's memory-profiling batch, and CUDA graphs are captured only up to the first size that holds it."""
    in_process: bool = False
    """Run vLLM's engine core in the stage's process ($VLLM_ENABLE_V1_MULTIPROCESSING=0), not a spawned one that imports
    torch and vLLM again: a faster start. Its memory must then come back at close, which vLLM does not always do
    (docs/real-models.md); a rank whose GPU is not cuda:0 is refused."""
    shutdown_timeout_s: float = 120.0
    """Seconds to wait, after the engine shuts down, for its GPU memory to come back before the scoring models load."""
    extra: dict = field(default_factory=dict)
    """Further keyword arguments for vllm.LLM (e.g. {quantization: fp8, load_format: safetensors})."""

    def engine_kwargs(self) -> dict:
        """The start options for vllm.LLM that these settings choose (besides model, dtype and seed)."""
        kwargs = dict(gpu_memory_utilization=self.gpu_memory_utilization, tensor_parallel_size=self.tensor_parallel_size,
                      enforce_eager=self.enforce_eager)
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        if self.max_num_seqs:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if not self.enforce_eager:
            # mode 0 turns vLLM's default FULL_AND_PIECEWISE graphs off altogether (piecewise graphs need the compile:
            # vllm/config/vllm.py:1172-1183), so without the compile ask for full decode graphs only
            compilation = {"mode": 3} if self.compile else {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
            sizes = sorted(set(self.cudagraph_capture_sizes))
            if sizes and self.max_num_seqs:  # no decode batch is larger: keep the sizes up to the first that holds it
                sizes = [s for s in sizes if s < self.max_num_seqs] + [s for s in sizes if s >= self.max_num_seqs][:1]
            if sizes:
                compilation["cudagraph_capture_sizes"] = sizes
            kwargs["compilation_config"] = compilation
        return {**kwargs, **self.extra}


class VLLMEngine:
    """A thin adapter over vllm.LLM: the same generate() contract as HFEngine.

    Needs the `gpu` extra (pip install 'prmflow[gpu]') and a CUDA GPU. Stop strings are kept in
    the output (include_stop_str_in_output) so the text is exactly the decoded token ids; logprobs
    of the sampled tokens only (logprobs=0), in vLLM's processed_logprobs mode: of the distribution each
    token was drawn from, as the HF engine records them (rules above). `stop_ids`: the ids the HF
    engine stops at (`eos_token_ids`), chat template's end of turn included. `local_rank`: under
    torchrun, this rank's index on its node; its engine then takes its own GPUs (`pin_rank_gpus`).
    vLLM's worker processes are spawned, not forked (a fork would copy MLflow's threads and any
    CUDA state of this process).
    """

    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, settings: VLLMSettings | None = None,
                 stop_ids: Sequence[int] = (), local_rank: int | None = None):
        s = settings or VLLMSettings()
        self.settings = s
        self.stop_ids = [int(i) for i in stop_ids]
        if local_rank is not None:
            pin_rank_gpus(local_rank, s.tensor_parallel_size)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.gpu = rank_gpu_index()
        if s.in_process and self.gpu != 0:
            # an in-process core is a single-process executor on this process's cuda:0 (vllm-project/vllm,
            # commit 01e4fce, vllm/v1/executor/uniproc_executor.py `UniProcExecutor._distributed_args`: local
            # rank = the device's index, else 0), which is this rank's GPU only if CUDA_VISIBLE_DEVICES was
            # pinned before CUDA started here
            raise ConfigError(f"rollout.vllm.in_process=true: this rank's GPU is cuda:{self.gpu} in this "
                              f"process (CUDA started here before the rank's GPU was chosen), and vLLM's in-process "
                              f"engine runs on cuda:0, rank 0's GPU. Set rollout.vllm.in_process=false (the engine "
                              f"core then starts in its own process on this rank's GPU).")
        if dtype == "float32":  # exact float32 attention dots, not TF32 (the rules above); read when the engine spawns
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        if importlib.util.find_spec("flashinfer") is None:  # else vLLM's sampler imports it and the start fails
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        self.free_before = torch.cuda.mem_get_info(self.gpu)[0] if torch.cuda.is_available() else None
        from packaging.version import Version

        if vllm_version() < Version("0.10"):
            raise ConfigError(f"vLLM {vllm_version()} is installed; prmflow's adapter was read against vllm>=0.10,<0.34 "
                              f"(the gpu extra): install a release in that range.")
        self.kwargs = {"dtype": dtype, "seed": engine_seed(seed), "logprobs_mode": "processed_logprobs", **s.engine_kwargs()}
        if self.kwargs["logprobs_mode"] != "processed_logprobs":
            raise ConfigError(f"vllm.extra.logprobs_mode={self.kwargs['logprobs_mode']!r}: behavior_logprobs must be of "
                              f"the distribution sampled (processed_logprobs); drop the key from vllm.extra.")
        self.llm = self._start(model_path)

    def _start(self, model_path: str):
        """A vllm.LLM on `model_path` with this engine's options; with in_process, $VLLM_ENABLE_V1_MULTIPROCESSING
        is 0 from here until `close` (or a failed start) puts back what it was."""
        from vllm import LLM  # the gpu extra

        self._env_before = None
        if self.settings.in_process:  # else vLLM's default (its own process) or whatever the pod's environment says
            self._env_before = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            return LLM(model=str(model_path), **self.kwargs)
        except BaseException:
            self._restore_env()
            raise

    def _restore_env(self) -> None:
        """Put $VLLM_ENABLE_V1_MULTIPROCESSING back as it was before an in-process engine, and drop the cache in which
        vLLM's engine core froze it (rules above), so a later engine of this process reads it afresh."""
        if self._env_before is None:
            return
        (before,), self._env_before = self._env_before, None
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
        try:
            from vllm import envs
        except ImportError:
            return
        if hasattr(envs, "disable_envs_cache"):  # 0.13 and later
            envs.disable_envs_cache()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None, rank: int = 0, world: int = 1) -> list[list[Completion]]:
        """Completions per prompt; rank `rank` of `world` samples the prompts with index % world ==
        rank (seeded by the prompt's index in the whole list) and leaves the others empty."""
        from vllm import SamplingParams as VSamplingParams

        check_vllm_sampling(params.n, params.temperature)
        seeds = request_seeds(params.seed, len(prompts), params.n)
        mine = [i for i in range(len(prompts)) if i % world == rank]
        requests = [{"prompt_token_ids": list(map(int, prompts[i]))} for i in mine]
        for i, req in zip(mine, requests):  # placeholders already expanded in the ids; vLLM matches them
            if images is not None and images[i]:
                req["multi_modal_data"] = {"image": [decode_image(b, f"prompt {i}") for b in images[i]]}
        sampling = [VSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None, include_stop_str_in_output=True,
            stop_token_ids=[] if params.ignore_eos else list(self.stop_ids),
            ignore_eos=params.ignore_eos, logprobs=0, seed=seeds[i], detokenize=bool(params.stop),
        ) for i in mine]
        results = self.llm.generate(requests, sampling, use_tqdm=False)
        if len(results) != len(requests):
            raise RuntimeError(f"vLLM returned {len(results)} results for {len(requests)} requests")
        out: list[list[Completion]] = [[] for _ in prompts]
        for i, res in zip(mine, results):
            if len(res.outputs) != params.n:
                raise RuntimeError(f"vLLM returned {len(res.outputs)} samples for prompt {i}; asked for {params.n}")
            samples = []
            for c in sorted(res.outputs, key=lambda c: c.index):
                if c.finish_reason not in (STOP, LENGTH):
                    raise RuntimeError(f"vLLM finished a sample with reason {c.finish_reason!r}")
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(c.logprobs or [])} logprobs for the {len(ids)} tokens of "
                                       f"prompt {i}, sample {c.index}")
                lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)]
                samples.append(Completion(ids, lps, c.finish_reason))
            out[i] = samples
        if progress is not None:
            progress(len(prompts))
        return out

    def load_weights(self, model_path: str) -> None:
        """Read the weights of `model_path` (the same architecture, e.g. the next iteration's policy) into the
        running engine instead of starting a new one, then drop the prefix cache, whose KV the old weights made.
        A vLLM before 0.16, whose reload_weights takes no path (rules above), gets a new engine on `model_path`.
        For a process that samples several policies in turn; a rollout pod samples one (docs/real-models.md)."""
        from packaging.version import Version

        if vllm_version() >= Version(RELOAD_WEIGHTS_PATH):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
            self.llm.reset_prefix_cache()
            return
        self.close()
        self.llm = self._start(model_path)

    def close(self) -> None:
        """Shut the engine down and wait until its GPU memory is free again (the scoring models need it next).

        The engine core runs in its own process: it is stopped explicitly (garbage collection may
        keep it alive), then the free memory of the rank's first GPU is polled until it is back to
        what it was before the engine started."""
        import gc

        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if hasattr(self.llm, "shutdown"):
            self.llm.shutdown()
        elif core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm
        gc.collect()
        if self.settings.in_process:  # the core lived here: its process group and memory go with this process's
            try:                      # objects (what vLLM's own tests call between two in-process engines)
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            except ImportError:  # an older vLLM, or the CPU stand-in
                pass
            else:
                cleanup_dist_env_and_memory()
        self._restore_env()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            if self.free_before is not None:
                wait_for_free_memory(self.gpu, int(self.free_before * 0.95), self.settings.shutdown_timeout_s,
                                     in_process=self.settings.in_process)
