"""Generation engines behind one interface: Hugging Face (CPU or GPU) and vLLM (GPU node pools).

    engine = HFEngine(model, tokenizer, batch_size=64)          # or vllm_engine.VLLMEngine("outputs/sft")
    out = engine.generate(prompt_ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=256))
    out[i][j].token_ids, out[i][j].logprobs, out[i][j].finish_reason   # prompt i, sample j

Both engines take token ids (the stage tokenizes, so `prompt_ids` in the rollouts is exactly what
was sampled from), and return per sample the generated ids, the log-probability of every generated
token and the finish reason: "stop" (an end-of-sequence token, kept as the last id, or a stop
string, kept in the text) or "length" (max_new_tokens reached).

`logprobs` are of the distribution each token was drawn from: log_softmax of the logits divided by
the temperature, after top-k and top-p (`filter_logits`); greedy decoding (temperature 0) records
the raw log_softmax. vLLM returns the same quantity in its `processed_logprobs` mode (vllm_engine.py).
The trainer takes its log-probs at the same temperature (`logprob_temperature`), as TRL and veRL do;
top-k and top-p are refused for training rollouts (rollout/config.py), so the two sides agree.

Vision-language prompts: `images` gives per prompt its encoded images (their placeholders are
already expanded in the prompt's ids, see models/vision.py); the HF engine feeds their pixel inputs
to the prefill, vLLM gets them as multi-modal data.

The HF engine is a KV-cache loop: one prefill per prompt (its cache is copied for the n samples),
then one forward of a single token per step. Sequences that finish are dropped from the batch
(their cache rows too), so a batch runs only as long as its longest live sample. The naive
alternative, a full forward of prompt + response for every new token, costs O(T^2) instead of
O(T); benchmarks/perf/bench_rollout.py measures both against `model.generate`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..models.chat import stop_token_ids
from ..models.modeling import own_positions
from ..models.vision import Vision, batch_pixels

log = logging.getLogger(__name__)

STOP, LENGTH = "stop", "length"


@dataclass
class SamplingParams:
    """What to sample; the same fields mean the same thing for every engine."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = 64
    """Generated tokens per sample at most (the EOS token counts)."""
    stop: Sequence[str] = ()
    """Strings that end a sample once they appear in its text (kept in the response)."""
    seed: int = 0
    """Seed of the sampling random numbers: the same seed, prompts and batch size give the same samples,
    on one rank or split over several (each generation batch, or each vLLM request, has its own seed)."""
    ignore_eos: bool = False
    """Keep generating after an end-of-sequence token (benchmarks: every sample gets max_new_tokens)."""


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]  # one per token in token_ids, of the distribution it was drawn from (module docstring)
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    """generate(prompts as token ids, params) -> for every prompt, its params.n completions."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None) -> list[list[Completion]]: ...


# --- sampling ----------------------------------------------------------------------------------

def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p applied to logits (B, V) -> (B, V), removed tokens at -inf.

    The slow equivalent is transformers' TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper in that order (tests compare them). Top-p keeps a token when the probability
    of the tokens ranked above it is below top_p, so the most likely token always stays.
    """
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_above >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def logprob_temperature(temperature: float) -> float:
    """The temperature the log-probs of a sample drawn at `temperature` are taken at: itself, and 1 for
    greedy decoding (0), whose tokens are the raw distribution's argmax (vLLM's sampler likewise leaves
    greedy rows' logits undivided: v0.33.0 vllm/v1/sample/sampler.py:326-335)."""
    return float(temperature) if temperature > 0 else 1.0


def batch_seed(seed: int, batch: int) -> int:
    """The seed of generation batch `batch` (batch 0 keeps `seed` itself)."""
    return (seed + batch * 1_000_000_007) % (2**63)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of logits (B, V) -> (B,) long."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config (may list several), the tokenizer's eos
    and the chat template's end of turn (Qwen2.5's `<|im_end|>`; `chat.stop_token_ids`)."""
    return stop_token_ids(model, tokenizer)


class StopStrings:
    """Finds a stop string in the tail of each sample's text as tokens arrive.

    Only the last few tokens are decoded per step (enough to hold the longest stop string twice),
    so the cost per step does not grow with the response.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.window = 2 * max((len(s) for s in self.stops), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, tokens: torch.Tensor, length: int) -> list[bool]:
        """tokens (b, >=length) long: the ids so far of each live sample -> which ones just hit a stop."""
        tail = tokens[:, max(0, length - self.window):length].tolist()
        texts = self.tokenizer.batch_decode(tail, skip_special_tokens=True)
        return [any(s in t for s in self.stops) for t in texts]


# --- the Hugging Face engine -------------------------------------------------------------------

def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids padded on the left with `pad_id` and the (B, T) attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, T - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


class HFEngine:
    """Batched sampling with a transformers causal LM and its KV cache (CPU or one GPU).

    batch_size counts sequences (prompts x samples) per forward; prompts are grouped by length so
    a batch carries little padding.
    """

    def __init__(self, model, tokenizer, batch_size: int = 64, device: str | torch.device | None = None):
        if own_positions(model):
            raise ValueError(f"{type(model).__name__} places its tokens with multimodal rope (Qwen2-VL style); the HF "
                             f"engine's KV-cache loop uses 1-D positions. Sample it with sampler=vllm.")
        self.vision = Vision.of(tokenizer, model.config)
        self.model = model
        self._no_sample = torch.tensor([self.vision.image_token_id] if self.vision else [], dtype=torch.long,
                                       device=torch.device(device) if device else next(model.parameters()).device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.model.to(self.device).eval()
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        params = inspect.signature(model.forward).parameters
        self._prefill_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # transformers 5.x renamed the KV cache `past_key_values` -> `cache` (argument and output field, the old
        # names warn and go away in 5.40); releases before the rename know only the old name
        self._cache_name = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None, rank: int = 0, world: int = 1) -> list[list[Completion]]:
        """Completions per prompt. With world > 1 this is rank `rank` of `world` processes given the
        same prompts: every rank cuts the same length-sorted batches, samples batches rank, rank +
        world, ... and leaves the other prompts' lists empty. Each batch draws from its own seed, so
        a prompt's samples are the same whichever rank samples it (the same batch, the same numbers)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if images is not None and any(images) and self.vision is None:
            raise ValueError("prompts with images need a vision-language model (its tokenizer carries the processor)")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        per_batch = max(1, self.batch_size // params.n)
        out: list[list[Completion]] = [[] for _ in prompts]
        for k, b in enumerate(range(0, len(order), per_batch)):
            if k % world != rank:
                continue
            generator = torch.Generator(device=self.device).manual_seed(batch_seed(params.seed, k))
            chunk = order[b:b + per_batch]
            pixels = {}
            if images is not None and any(images[i] for i in chunk):
                pixels = batch_pixels([self.vision.pixels(images[i], f"prompt {i}") for i in chunk], self.device)
            done = self._generate_batch([prompts[i] for i in chunk], params, generator, pixels)
            for k, i in enumerate(chunk):
                out[i] = done[k * params.n:(k + 1) * params.n]
            if progress is not None:
                progress(len(chunk))
        return out

    def _generate_batch(self, prompts: list[Sequence[int]], params: SamplingParams,
                        generator: torch.Generator, pixels: dict | None = None) -> list[Completion]:
        model, n, T = self.model, params.n, params.max_new_tokens
        stops = StopStrings(self.tokenizer, params.stop)
        eos = torch.tensor(self.eos_ids if not params.ignore_eos else [], dtype=torch.long, device=self.device)

        # prefill the prompts once, then copy each prompt's cache for its n samples
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # (P, L)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **self._prefill_kwargs,
                    **(pixels or {}))
        cache = out[self._cache_name]
        logits = out.logits[:, -1].float()  # (P, V)
        next_pos = positions[:, -1] + 1  # (P,)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask, next_pos = (x.repeat_interleave(n, dim=0) for x in (logits, mask, next_pos))

        B = len(prompts) * n
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)  # (B, T)
        logps = torch.zeros((B, T), dtype=torch.float32, device=self.device)  # (B, T)
        lengths = torch.full((B,), T, dtype=torch.long)
        finish = [LENGTH] * B
        rows = torch.arange(B, device=self.device)  # output row of each live batch row
        for t in range(T):
            # (b, V) the distribution the token is drawn from (temperature, top-k, top-p), recorded
            logp = torch.log_softmax(logits if params.temperature == 0 else
                                     filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
            if self.vision is not None:  # an image placeholder in a response would have no image behind it
                logits = logits.index_fill(-1, self._no_sample, float("-inf"))
            tok = sample_tokens(logits, params, generator)  # (b,)
            tokens[rows, t] = tok
            logps[rows, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
            ended = torch.isin(tok, eos) if len(eos) else torch.zeros_like(tok, dtype=torch.bool)
            if stops:
                ended |= torch.tensor(stops.hit(tokens[rows], t + 1), device=self.device)
            if ended.any():
                for r in rows[ended].tolist():
                    lengths[r], finish[r] = t + 1, STOP
            if t == T - 1 or ended.all():
                break
            if ended.any():  # drop finished samples from the batch, cache rows included
                keep = (~ended).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                        use_cache=True, **{self._cache_name: cache})
            logits = out.logits[:, -1].float()  # (b, V)
            next_pos = next_pos + 1
        tokens, logps = tokens.cpu(), logps.cpu()
        return [Completion(tokens[i, :lengths[i]].tolist(), logps[i, :lengths[i]].tolist(), finish[i]) for i in range(B)]
