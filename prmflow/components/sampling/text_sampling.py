"""Texts in, texts out, from a policy directory with either engine: what evaluate, best-of-N and prm-label
sample. Rollout needs more (token ids, log-probs, ranks) and drives the engines itself (rollout/model_passes.py).

    with TextSampler("outputs/ppo/policy", sampler="vllm") as s:   # or sampler="hf" (the default)
        texts = s.generate(prompts, max_new_tokens=64, do_sample=True, seed=0)
    # closed: the engine's GPU memory is back before a PRM loads

Both engines cut a response at the same end-of-sequence ids (the generation config's, the tokenizer's and
the chat template's end of turn) and decode it without special tokens. The samples are reproducible for a
seed, but the two engines draw from different random streams, so their samples differ.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Literal

from tqdm.auto import tqdm

from ...errors import ConfigError, DataError
from ..models import modeling
from .engines import SamplingParams
from .generation import generate_texts
from .vllm_engine import VLLMEngine, VLLMSettings, check_vllm_sampling, stop_ids

Sampler = Literal["hf", "vllm"]
log = logging.getLogger(__name__)
#: config.json keys that do not change what a running engine computes with another checkpoint's weights
WEIGHTS_ONLY_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"}


def check_sampling(sampler: Sampler, temperature: float, where: str) -> None:
    """Before any model loads: what vLLM would refuse mid-run (`check_vllm_sampling`, n = 1 per request)."""
    if sampler == "vllm":
        check_vllm_sampling(1, temperature, where)


class TextSampler:
    """One policy loaded once and sampled in several calls; `close()` (or leaving the `with`) frees it.

    sampler="hf": the model on `device` in `dtype` (`modeling.load_for_sampling`), `generate_texts` batches of
    `batch_size`. sampler="vllm": a `VLLMEngine` on this process's GPU with `vllm`'s settings; every prompt is its
    own request with its own seed (`vllm_engine.request_seeds`), and vLLM batches them itself."""

    def __init__(self, policy_path: str, sampler: Sampler = "hf", device: str = "", dtype: str = "auto",
                 vllm: VLLMSettings | None = None, seed: int = 0, batch_size: int = 256):
        if sampler not in ("hf", "vllm"):
            raise ConfigError(f"sampler is '{sampler}'; use hf or vllm.")
        self.sampler, self.batch_size = sampler, batch_size
        self.device, self.dtype, self.vllm, self.seed = device, dtype, vllm, seed
        self._open(policy_path)

    def _open(self, policy_path: str) -> None:
        """Load `policy_path` with this sampler's engine, device, dtype and seed."""
        self.path, self.model, self.engine = policy_path, None, None
        self.window: tuple[int | None, str] = (None, "")
        if self.sampler == "hf":
            self.model, self.tokenizer = modeling.load_for_sampling(policy_path, self.device, self.dtype)
        else:
            self.tokenizer = modeling.load_tokenizer(policy_path)
            self.window = modeling.context_window(policy_path, (self.vllm or VLLMSettings()).max_model_len)
            self.engine = VLLMEngine(policy_path, modeling.sampling_dtype(self.sampler, self.device, self.dtype),
                                     seed=self.seed, settings=self.vllm, stop_ids=stop_ids(policy_path, self.tokenizer))

    def generate(self, prompts: list[str], max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 add_special_tokens: bool = True, images: list[list[bytes]] | None = None,
                 progress: str = "") -> list[str]:
        """One response per prompt (repeat a prompt for several samples); greedy unless do_sample.
        The arguments mean what they mean for `generation.generate_texts`."""
        if self.engine is None:
            return generate_texts(self.model, self.tokenizer, prompts, max_new_tokens, batch_size=self.batch_size,
                                  do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                  add_special_tokens=add_special_tokens, images=images, progress=progress)
        if images and any(images):
            raise ConfigError("sampler=vllm samples text prompts here; these prompts have images. Set sampler=hf "
                              "for a vision-language policy (the rollout stage samples images with vLLM).")
        ids = self.tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]
        window, named = self.window
        too_long = [i for i, x in enumerate(ids) if window is not None and len(x) >= window]
        if too_long:  # vLLM refuses the whole generate call for one prompt that fills max_model_len
            i = too_long[0]
            raise DataError(f"{len(too_long)} prompt(s) do not fit {named} (the first, prompt {i}, has "
                            f"{len(ids[i])} tokens): vLLM refuses a prompt that fills it. Use shorter prompts, "
                            f"a larger vllm.max_model_len (up to the policy's window), or sampler=hf.")
        params = SamplingParams(n=1, temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
                                top_k=top_k if do_sample else 0, max_new_tokens=max_new_tokens, seed=seed)
        bar = tqdm(total=len(prompts), desc=progress, unit="seq", dynamic_ncols=True, disable=not progress,
                   mininterval=0.2 if sys.stderr.isatty() else 10.0)
        try:
            completions = self.engine.generate(ids, params, progress=bar.update)
        finally:
            bar.close()
        return self.tokenizer.batch_decode([c[0].token_ids for c in completions], skip_special_tokens=True)

    def switch(self, policy_path: str) -> bool:
        """Sample `policy_path` from now on (evaluate's baseline after its policy). A vLLM engine reads the new
        weights into the running engine when the two checkpoints differ only in their weights (`differs` is
        empty): no second engine start (20-50 s on a GPU; a second engine started in one evaluate process
        never came up on an H200, docs/testing.md). Otherwise, and with HF, the policy is closed and the new one
        loaded. Returns whether the running engine was kept."""
        if self.engine is not None:
            why = differs(self.path, policy_path)
            if not why:
                self.engine.load_weights(policy_path)
                self.path = policy_path
                return True
            log.info("a new vLLM engine for %s: %s", policy_path, why)
        self.close()
        self._open(policy_path)
        return False

    def close(self) -> None:
        """Free the policy: vLLM's engine is shut down and its GPU memory waited for; the HF model is dropped."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.model is not None:
            import torch

            self.model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> "TextSampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def differs(a: str, b: str) -> str:
    """Why a running engine on policy directory `a` cannot sample `b` by reading b's weights ("" when it can):
    another model config (but for WEIGHTS_ONLY_KEYS), vocabulary, chat template or stop ids."""
    def model_config(path: str) -> dict:
        cfg = json.loads((Path(path) / "config.json").read_text())
        return {k: v for k, v in cfg.items() if k not in WEIGHTS_ONLY_KEYS}

    try:
        ca, cb = model_config(a), model_config(b)
    except (OSError, ValueError) as e:  # a hub name, or no config.json: nothing to compare
        return f"no config.json to compare ({e})"
    if ca != cb:
        keys = sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
        return f"its model config differs in {keys}"
    ta, tb = modeling.load_tokenizer(a), modeling.load_tokenizer(b)
    if ta.get_vocab() != tb.get_vocab():
        return "its vocabulary differs"
    if getattr(ta, "chat_template", None) != getattr(tb, "chat_template", None):
        return "its chat template differs"
    if stop_ids(a, ta) != stop_ids(b, tb):
        return "its stop ids differ"
    return ""
