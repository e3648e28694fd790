"""A stand-in for the `vllm` package on machines without a GPU, injected as sys.modules["vllm"].

It copies what the rollout's adapter can observe of vLLM (read from vLLM's source, 0.10 ... 0.33)
and samples with the tiny HF model on CPU, so the rollout tests run over sampler=vllm in CI:

- `LLM(**kwargs)`: EngineArgs' keywords only (an unknown one is a TypeError); the worker seeds
  random, numpy and torch with `seed` (vllm/utils/torch_utils.py set_random_seed), so a seed
  outside numpy's [0, 2^32) raises numpy's ValueError; `max_model_len` above the model's window is
  refused; the engine's worker sits on cuda:0 of CUDA_VISIBLE_DEVICES (uniproc executor: device
  index 0 unless told), and a second engine on a GPU without the memory it asks for is refused
  (the worker's free-memory check), until the first one shuts down.
- `SamplingParams`: `__post_init__` and `_verify_args` / `_verify_greedy_sampling` as vLLM's
  (temperature in [0, 2], greedy below 1e-5 forces top-p/top-k off and refuses n > 1, ...);
  `update_from_generation_config` merges the generation config's eos ids into stop_token_ids.
- `generate`: a prompt as long as max_model_len or longer is refused; sample j of a request with seed s
  draws from seed s + j (v1/engine/parallel_sampling.py), seeds held as int64; a sample stops at the
  tokenizer's eos (unless ignore_eos), at `stop_token_ids`, at a stop string (detokenized text), or
  at max_tokens / max_model_len ("length"); the stop token is kept in `token_ids`; tokens are drawn
  as vLLM's sampler does (temperature, top-k, top-p, then probs / Exp(1) noise, argmax).
- `logprobs` is a list of {token: Logprob}: with logprobs_mode raw_logprobs (the default) of the raw
  distribution; with processed_logprobs, from 0.10.2, of the distribution sampled (logits / temperature,
  top-k, top-p: v0.10.2 vllm/v1/sample/sampler.py:168-184, ops/topk_topp_sampler.py forward_native;
  v0.33.0 sampler.py:340-358), a greedy request's of the raw logits (v0.33.0 sampler.py:326-335); in
  0.10.0 and 0.10.1 processed meant after the penalties, before the temperature (v0.10.0
  vllm/v1/sample/sampler.py:58-64; temperature at :127): the raw distribution here (no penalties).
- the version is `__version__` (a test sets it to play another release of the range 0.10 ... 0.33).
- float32 attention: vLLM's TRITON_ATTN kernel takes `tl.dot(Q, K)` and `tl.dot(P, V)` with no input
  precision (v0.24.0 vllm/v1/attention/ops/triton_unified_attention.py:520, 562), so on a GPU with tensor
  cores Triton rounds float32 operands to TF32 (10-bit mantissa) unless $TRITON_F32_DEFAULT=ieee when the
  engine starts; the torch matmuls stay float32 (vllm/v1/worker/gpu_worker.py:135-136, "highest" by
  default). A float32 engine started without `ieee` here attends with Q, K and V rounded to TF32 (P, which
  Triton rounds too, is left in float32: the stand-in under-states the error, it does not invent one).
- start: `compilation_config` keys and cudagraph modes as CompilationConfig parses them
  (vllm/config/compilation.py:428, 588, 629, 845-850); with $VLLM_USE_FLASHINFER_SAMPLER unset the
  sampler imports flashinfer (vllm/v1/sample/ops/topk_topp_sampler.py:38-44), absent here as in an image
  without it, so the start fails with ModuleNotFoundError.
- the engine core runs in a process of its own unless $VLLM_ENABLE_V1_MULTIPROCESSING is 0 when the engine is made,
  read through `vllm.envs` (envs.py; v1/engine/llm_engine.py from_engine_args): recorded as `core_in_process`.
  From 0.13 a core that starts in this process freezes `vllm.envs` for the process (v0.13.0
  vllm/v1/engine/core.py:216 `enable_envs_cache()`, envs.py:1591-1611; v0.33.0 core.py:248, envs.py:2310-2329)
  until `envs.disable_envs_cache()` (v0.13.0 envs.py:1613; absent before 0.13).
- `collective_rpc("reload_weights", kwargs={"weights_path": ...})` reads new weights into the running model
  (v0.33.0 v1/worker/gpu_worker.py:636-638 -> gpu_model_runner.py:5226-5231; from 0.16.0: v0.16.0
  gpu_worker.py:297-298, gpu_model_runner.py:4315-4320) and leaves the prefix cache as it was until
  `reset_prefix_cache()` (recorded as `prefix_cache_fresh`; the stand-in keeps no cache to go stale). Before
  0.16.0 the worker's `reload_weights(self)` takes no argument (v0.10.0 vllm/v1/worker/gpu_worker.py:206,
  v0.15.1 gpu_worker.py:280): a keyword is a TypeError.

Everything an engine was given is recorded on the instance (`kwargs`, `env`, `sample_seeds`, ...).
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from packaging.version import Version
from transformers import AttentionInterface

__version__ = "0.33.0"

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


def version() -> Version:
    return Version(__version__)


class _Envs:
    """`vllm.envs`: environment variables read when asked, or from the cache an engine core froze (module docstring)."""

    NAMES = ("VLLM_ENABLE_V1_MULTIPROCESSING",)

    def __init__(self):
        self.cache: dict | None = None

    @staticmethod
    def _read(name: str):
        return bool(int(os.getenv(name, "1") or "1"))  # envs.py: lambda: bool(int(os.getenv(..., "1")))

    def __getattr__(self, name: str):
        if name in self.NAMES:
            return self.cache[name] if self.cache is not None else self._read(name)
        if name in ("enable_envs_cache", "disable_envs_cache") and version() >= Version("0.13"):
            return getattr(self, "_" + name)
        raise AttributeError(f"module 'vllm.envs' has no attribute {name!r}")

    def _enable_envs_cache(self) -> None:
        if self.cache is None:
            self.cache = {n: self._read(n) for n in self.NAMES}

    def _disable_envs_cache(self) -> None:
        self.cache = None


envs = _Envs()

#: EngineArgs keywords the adapter may pass (a subset of vLLM's; anything else is a TypeError there too)
ENGINE_ARGS = {"model", "dtype", "seed", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager",
               "max_model_len", "logprobs_mode", "quantization", "trust_remote_code", "enable_prefix_caching",
               "max_num_seqs", "compilation_config", "load_format"}
#: CompilationConfig fields the adapter may set (vllm/config/compilation.py:428, 588, 629), and the cudagraph
#: modes vLLM parses from a string (compilation.py:845-850)
COMPILATION_KEYS = {"mode", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
CUDAGRAPH_MODES = {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}

def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32 (10 of its 23 mantissa bits, to nearest), as tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _tf32_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention on TF32-rounded Q, K, V: the float32 Triton attention without `ieee`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, tf32(query), tf32(key), tf32(value), attention_mask, **kwargs)


TF32_ATTENTION = "fake_vllm_triton_tf32"
AttentionInterface.register(TF32_ATTENTION, _tf32_attention)

#: physical GPU -> fraction of its memory held by live engines (the worker's free-memory check)
GPU_USE: dict[str, float] = {}
#: every engine built in this process, in order
ENGINES: list["LLM"] = []


class VLLMValidationError(ValueError):
    """vllm.exceptions.VLLMValidationError (a ValueError)."""


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _eos_token_id: int | None = None
    _all_stop_token_ids: set = field(default_factory=set)

    def __post_init__(self):
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = max(self.temperature, _MAX_TEMP)
        if self.seed == -1:
            self.seed = None
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:  # zero temperature means greedy sampling
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            self._verify_greedy_sampling()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature):
            raise VLLMValidationError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise VLLMValidationError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise VLLMValidationError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise VLLMValidationError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(not s for s in self.stop):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise VLLMValidationError("stop strings are only supported when detokenize is True. "
                                      "Set detokenize=True to use stop.")

    def _verify_greedy_sampling(self) -> None:
        if self.n > 1:
            raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def update_from_generation_config(self, generation_config: dict, eos_token_id: int | None = None) -> None:
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        if (eos_ids := generation_config.get("eos_token_id")) is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            if eos_token_id is not None:
                eos_ids.discard(eos_token_id)
            if eos_ids:
                self._all_stop_token_ids.update(eos_ids)
                if not self.ignore_eos:
                    eos_ids.update(self.stop_token_ids)
                    self.stop_token_ids = list(eos_ids)


def set_random_seed(seed: int | None) -> None:
    """vllm.utils.torch_utils.set_random_seed's checks (numpy's range), on throwaway generators."""
    if seed is not None:
        random.Random(seed)
        np.random.RandomState().seed(seed)  # ValueError: Seed must be between 0 and 2**32 - 1
        torch.Generator().manual_seed(seed)


class _EngineCore:
    def __init__(self, llm: "LLM"):
        self.llm = llm

    def shutdown(self) -> None:
        self.llm._release()


class _LLMEngine:
    def __init__(self, llm: "LLM"):
        self.engine_core = _EngineCore(llm)


class LLM:
    def __init__(self, model: str, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.kwargs = {"model": model, **kwargs}
        compilation = kwargs.get("compilation_config") or {}
        if set(compilation) - COMPILATION_KEYS or str(compilation.get("cudagraph_mode", "NONE")).upper() not in CUDAGRAPH_MODES:
            raise ValueError(f"invalid compilation_config {compilation}")  # pydantic's validation error there
        # the top-k/top-p sampler imports vLLM's FlashInfer backend unless VLLM_USE_FLASHINFER_SAMPLER=0
        # (vllm/v1/sample/ops/topk_topp_sampler.py:38-44); no flashinfer here, as in an image without it
        if os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "1") != "0" and importlib.util.find_spec("flashinfer") is None:
            raise ModuleNotFoundError("No module named 'flashinfer'")
        self.env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD",
                                                   "TRITON_F32_DEFAULT", "VLLM_USE_FLASHINFER_SAMPLER",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING")}
        # where the engine core runs: $VLLM_ENABLE_V1_MULTIPROCESSING read through vllm.envs as the engine is made
        # (default "1": a process of its own)
        self.core_in_process = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self.version = version()
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        self.seed = kwargs.get("seed", 0)
        set_random_seed(self.seed)
        hf_config = AutoConfig.from_pretrained(model)
        window = getattr(hf_config, "max_position_embeddings", None)
        self.max_model_len = kwargs.get("max_model_len") or window
        if window is not None and self.max_model_len > window:
            raise ValueError(f"User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={window} in model's config.json).")
        visible = [d for d in (self.env["CUDA_VISIBLE_DEVICES"] or "0,1,2,3,4,5,6,7").split(",") if d]
        tp = kwargs.get("tensor_parallel_size", 1)
        if tp > len(visible):
            raise ValueError(f"World size ({tp}) is larger than the number of available GPUs ({len(visible)}).")
        self.gpus = visible[:tp]  # worker r of the engine on cuda:r of what it sees
        self.device = self.gpus[0]
        want = kwargs.get("gpu_memory_utilization", 0.9)
        for gpu in self.gpus:
            if GPU_USE.get(gpu, 0.0) + want > 1.0:
                raise ValueError(f"Free memory on device cuda:{gpu} ({1 - GPU_USE.get(gpu, 0.0):.2f} of the GPU) is less "
                                 f"than desired GPU memory utilization ({want}). Decrease GPU memory utilization or "
                                 f"reduce GPU memory used by other processes.")
        for gpu in self.gpus:
            GPU_USE[gpu] = GPU_USE.get(gpu, 0.0) + want
        self._want, self.alive = want, True
        dtype = kwargs.get("dtype", "auto")
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype) if dtype != "auto" else "auto").eval()
        self.tf32_attention = self.model.dtype == torch.float32 and (self.env["TRITON_F32_DEFAULT"] or "tf32") != "ieee"
        if self.tf32_attention:  # Triton's default for float32 dots (module docstring)
            self.model.set_attn_implementation(TF32_ATTENTION)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        try:  # ModelConfig.try_get_generation_config
            generation = GenerationConfig.from_pretrained(model)
        except OSError:
            generation = GenerationConfig.from_model_config(hf_config)
        self.generation_config_fields = generation.to_diff_dict()
        self.llm_engine = _LLMEngine(self)
        self.requests: list[dict] = []
        self.params: list[SamplingParams] = []
        self.sample_seeds: list[int | None] = []
        self.reloads: list[str] = []
        self.prefix_cache_fresh = True  # false after a weight reload until reset_prefix_cache
        if self.core_in_process and self.version >= Version("0.13"):  # EngineCore.__init__ (module docstring)
            envs._enable_envs_cache()
        ENGINES.append(self)

    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        """Only the worker method the adapter calls, with the worker's signature of this version: reload_weights
        (weights_path=...) from 0.16.0, reload_weights() before (module docstring); the prefix cache is left as it was."""
        if method != "reload_weights":
            raise AttributeError(f"'Worker' object has no attribute {method!r}")
        kwargs = dict(kwargs or {})
        allowed = {"weights_iterator", "weights_path", "is_checkpoint_format"} if self.version >= Version("0.16") else set()
        if args or set(kwargs) - allowed:
            bad = sorted(set(kwargs) - allowed)
            raise TypeError(f"Worker.reload_weights() got an unexpected keyword argument {bad[0]!r}" if bad else
                            f"Worker.reload_weights() takes 1 positional argument but {1 + len(args)} were given")
        from transformers import AutoModelForCausalLM

        path = kwargs.get("weights_path") or self.kwargs["model"]
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        self.model.load_state_dict(fresh.state_dict())
        self.reloads.append(path)
        self.prefix_cache_fresh = False
        return [None]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_cache_fresh = True
        return True

    def _release(self) -> None:
        if self.alive:
            for gpu in self.gpus:
                GPU_USE[gpu] -= self._want
            self.alive = False

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        if not self.alive:
            raise RuntimeError("the engine core has shut down")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        # the processor validates every request before any runs
        for prompt in prompts:
            n_ids = len(prompt["prompt_token_ids"])
            if n_ids >= self.max_model_len:
                raise ValueError(f"The decoder prompt (length {n_ids}) is longer than the maximum model length of "
                                 f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
                                 f"text tokens.")
        out = []
        for k, (prompt, sp) in enumerate(zip(prompts, params)):
            sp = SamplingParams(**{f: getattr(sp, f) for f in ("n", "temperature", "top_p", "top_k", "seed", "stop",
                                                                "stop_token_ids", "ignore_eos", "max_tokens", "logprobs",
                                                                "detokenize", "include_stop_str_in_output")})
            sp.update_from_generation_config(self.generation_config_fields, self.tokenizer.eos_token_id)
            self.requests.append(prompt)
            self.params.append(sp)
            outputs = [self._sample(list(prompt["prompt_token_ids"]), sp, j) for j in range(sp.n)]
            out.append(RequestOutput(str(k), None, list(prompt["prompt_token_ids"]), outputs))
        return out

    @torch.no_grad()
    def _sample(self, prompt: list[int], sp: SamplingParams, index: int) -> CompletionOutput:
        seed = None if sp.seed is None else sp.seed + index
        self.sample_seeds.append(seed)
        generator = None
        if seed is not None:
            torch.tensor([seed], dtype=torch.int64)  # vLLM's seed tensors: RuntimeError beyond int64
            generator = torch.Generator().manual_seed(seed)
        ids, logprobs, finish, stop_reason = [], [], None, None
        while finish is None:
            logits = self.model(torch.tensor([prompt + ids])).logits[0, -1].float()  # (V,)
            raw = torch.log_softmax(logits, -1)  # logprobs_mode raw_logprobs
            if sp.temperature < _SAMPLING_EPS:
                tok = int(logits.argmax())
            else:
                x = logits / sp.temperature
                if sp.top_k > 0:
                    x = x.masked_fill(x < torch.topk(x, sp.top_k).values[-1], float("-inf"))
                if sp.top_p < 1.0:  # vLLM's apply_top_k_top_p: drop the low tail whose mass is <= 1 - p
                    sorted_x, order = x.sort(descending=False)
                    cum = sorted_x.softmax(-1).cumsum(-1)
                    drop = cum <= 1 - sp.top_p
                    drop[-1] = False
                    x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
                probs = x.softmax(-1)
                q = torch.empty_like(probs).exponential_(generator=generator)  # vLLM's random_sample
                tok = int((probs / q).argmax())
            given = raw  # what logprobs_mode returns (module docstring)
            if (self.logprobs_mode == "processed_logprobs" and self.version >= Version("0.10.2")
                    and sp.temperature >= _SAMPLING_EPS):
                given = torch.log_softmax(x, -1)
            ids.append(tok)
            rank = int((given > given[tok]).sum()) + 1
            logprobs.append({tok: Logprob(float(given[tok]), rank)})
            # the scheduler's check_stop, then the detokenizer's stop strings
            if tok == sp._eos_token_id:
                finish = "stop"
            elif tok in sp.stop_token_ids:
                finish, stop_reason = "stop", tok
            elif len(prompt) + len(ids) >= self.max_model_len or len(ids) >= sp.max_tokens:
                finish = "length"
            if sp.stop:
                text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
                hit = next((s for s in sp.stop if s in text), None)
                if hit is not None:
                    finish, stop_reason = "stop", hit
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens) if sp.detokenize else ""
        return CompletionOutput(index, text, ids, sum(lp[t].logprob for lp, t in zip(logprobs, ids)),
                                logprobs if sp.logprobs is not None else None, finish, stop_reason)
