"""Scoring sampled responses: old/ref logprobs, critic values, step ends and PRM step rewards.

Every per-token quantity is aligned with response_ids (see the rollouts contract):
- `forward_logprobs`: entry t = log p(response token t | prompt + response[:t]), from one full
  forward pass of prompt + response (right-padded, position ids from the attention mask, as
  `tensor_ops.sequence_logprobs`, the function the PPO stage trains with, places them), the LM head
  read at the response positions only. This is the training engine's view of the tokens; the
  sampling engine's own numbers stay in behavior_logprobs.
- `forward_values`: entry t = the critic's scalar at sequence index prompt_len - 1 + t, the
  position whose hidden state predicts response token t.
- `step_ends`: the index in response_ids of the last token of each step, placed by
  `steps.step_end_tokens` on the character offsets of the policy's own tokens in the decoded
  response (`token_offsets`).
- PRM step rewards come from the PRM's own tokenization of the text (`lib.prm_scoring.PRMScorer`),
  never from the policy's ids, so a PRM with another tokenizer scores the same steps.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..data import steps as steps_lib
from ..models.prm_model import logit_chunk_rows, response_positions, selected_logprobs
from ..models.tensor_ops import mask_positions, sequence_logprobs
from ..models.vision import batch_pixels
from ..scoring.prm_scoring import PRMScorer, right_pad

REPLACEMENT = "\ufffd"  # what a decoder shows for the first bytes of a character split across tokens


# --- character offsets of generated tokens -----------------------------------------------------

def token_offsets(tokenizer, ids: Sequence[int], window: int = 8) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of `ids` and the (start, end) characters each token contributes to it.

    text = tokenizer.decode(ids, skip_special_tokens=True); special tokens get zero-width offsets.
    Each token's piece is the difference between decoding a few tokens before it with and without
    it (so SentencePiece's dropped leading space and byte-level BPE's split characters decode as in
    the full text); a token holding the first bytes of a split character gets a zero-width piece
    and the token that completes the character gets the character. The pieces must join to the
    text; when they do not (an unusual decoder), every prefix is decoded instead: exact, O(T^2).
    """
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not ids:
        return text, []
    starts = [max(0, k - window) for k in range(len(ids))]
    before = tokenizer.batch_decode([ids[s:k] for k, s in enumerate(starts)], skip_special_tokens=True)
    after = tokenizer.batch_decode([ids[s:k + 1] for k, s in enumerate(starts)], skip_special_tokens=True)
    pieces = []
    for b, a in zip(before, after):
        b, a = b.rstrip(REPLACEMENT), a.rstrip(REPLACEMENT)
        if not a.startswith(b):
            pieces = None
            break
        pieces.append(a[len(b):])
    if pieces is None or "".join(pieces) != text:
        return text, _prefix_offsets(tokenizer, ids, text)
    offsets, pos = [], 0
    for p in pieces:
        offsets.append((pos, pos + len(p)))
        pos += len(p)
    return text, offsets


def _prefix_offsets(tokenizer, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Offsets from decoding every prefix: token k ends where decode(ids[:k+1]) ends (monotone)."""
    prefixes = tokenizer.batch_decode([ids[:k + 1] for k in range(len(ids))], skip_special_tokens=True)
    offsets, pos = [], 0
    for p in prefixes:
        end = min(max(len(p.rstrip(REPLACEMENT)), pos), len(text))
        offsets.append((pos, end))
        pos = end
    return offsets


def step_ends(tokenizer, response_ids: Sequence[int], separator: str = "\n") -> tuple[str, list[int]]:
    """(decoded response, index in response_ids of the last token of each step): one per step.

    Placed by `steps.step_end_tokens` (the last token starting before the step's end character).
    That function skips a step whose characters all lie in the previous step's last token (a BPE
    token such as "2\nx=1\n" can close two steps); here such a step gets that same token again, so
    step_ends has one entry per step, like the PRM's scores (the advantage stage adds rewards that
    share a token).
    """
    text, offsets = token_offsets(tokenizer, response_ids)
    spans = steps_lib.step_spans(text, separator)
    ends = steps_lib.step_end_tokens(offsets, spans)
    if len(ends) != len(spans):
        starts = [a for a, _ in offsets]
        ends = [bisect.bisect_left(starts, end) - 1 for _, end in spans]
    return text, ends


# --- forward passes over prompt + response -----------------------------------------------------

def _batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], batch_size: int, pad_id: int,
             device) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, list[int], list[int]]]:
    """Right-padded batches of prompt + response, grouped by length.

    Yields (row indices, ids (B, T), attention mask (B, T), prompt lengths, response lengths).
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        ids, mask = right_pad([list(prompts[i]) + list(responses[i]) for i in idx], pad_id)  # (B, T) each
        yield idx, ids.to(device), mask.to(device), [len(prompts[i]) for i in idx], [len(responses[i]) for i in idx]


@torch.no_grad()
def forward_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], batch_size: int = 32,
                     pad_id: int = 0, progress: Callable[[int], None] | None = None,
                     pixels: Sequence[dict] | None = None, chunked: bool = True,
                     temperature: float = 1.0) -> list[np.ndarray]:
    """log p(response token t | prompt + response[:t]) under `model` with its logits divided by `temperature`
    (the sampling temperature): one (R_i,) float32 array per row.

    The slow equivalent: for each row alone, log_softmax(model(prompt + response).logits[0, :-1] / temperature)
    gathered at the next tokens, then entries prompt_len - 1 ... prompt_len + R - 2. `pixels`: per
    row the pixel inputs of its prompt's images (vision-language), fed with its batch.

    The LM head reads the response positions only, prm_model.LOGIT_CHUNK_BYTES of float32 logits at a time
    (`prm_model.selected_logprobs`, the implicit PRM's pass): the (B, T, V) logits and their float32
    log-softmax never exist. At Qwen2.5's 151,936 tokens and the 1.5B recipe's 32 sequences of up to
    ~1,200 tokens those were 11 GiB in bfloat16 plus 22 GiB for each float32 copy (54 GiB at peak, 3.3 GiB
    chunked, on an H200). `chunked=False`, or a model whose logits are not its head's output (a soft-cap:
    seen on the first batch), computes the whole logits instead.
    """
    model.eval()
    device = next(model.parameters()).device
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(prompts)
    for idx, ids, mask, p_lens, r_lens in _batches(prompts, responses, batch_size, pad_id, device):
        extra = batch_pixels([pixels[i] for i in idx], device) if pixels is not None else {}
        flat = None
        if chunked:  # every row's response tokens, row by row: the rows start their responses at p_lens
            rows, positions = response_positions(ids, mask, torch.tensor(p_lens, device=device))
            flat = selected_logprobs(model, model, ids, mask, rows, positions, logit_chunk_rows(model),
                                     temperature=temperature, **mask_positions(model, mask, **extra))
            chunked = flat is not None  # a model whose logits are not its head's output: the whole path from now on
        if flat is not None:
            for i, part in zip(idx, np.split(flat.float().cpu().numpy(), np.cumsum(r_lens)[:-1])):
                out[i] = part
        else:
            # (B, T-1): entry j scores token j+1
            lp = sequence_logprobs(model, ids, mask, temperature, **extra).float().cpu().numpy()
            for r, i in enumerate(idx):
                out[i] = lp[r, p_lens[r] - 1:p_lens[r] - 1 + r_lens[r]].astype(np.float32)
        if progress is not None:
            progress(len(idx))
    return out


@torch.no_grad()
def forward_values(critic, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], batch_size: int = 32,
                   pad_id: int = 0, progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Critic value per response token: one (R_i,) float32 array per row.

    critic: a scalar-head model (AutoModelForTokenClassification, num_labels=1); entry t is its
    output at sequence index prompt_len - 1 + t.
    """
    critic.eval()
    device = next(critic.parameters()).device
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(prompts)
    for idx, ids, mask, p_lens, r_lens in _batches(prompts, responses, batch_size, pad_id, device):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        v = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[..., 0]  # (B, T)
        v = v.float().cpu().numpy()
        for r, i in enumerate(idx):
            out[i] = v[r, p_lens[r] - 1:p_lens[r] - 1 + r_lens[r]].astype(np.float32)
        if progress is not None:
            progress(len(idx))
    return out


def prm_step_rewards(prm_path: str, prompts: list[str], responses: list[str], batch_size: int = 32,
                     device: str | None = None, separator: str = "\n",
                     images: list[list[bytes]] | None = None, dtype: str = "float32") -> list[list[float]]:
    """P(step correct) for every step of every response, from the PRM's own tokenization of the
    text (and the prompt's images, for a vision-language PRM), the PRM loaded in `dtype` (the
    rollout's model dtype: a bfloat16 pass on a GPU holds half the memory of a float32 one)."""
    scorer = PRMScorer(prm_path, batch_size=batch_size, device=device, step_separator=separator, dtype=dtype)
    try:
        return scorer.score(prompts, responses, images=images)
    finally:
        del scorer
