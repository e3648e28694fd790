"""Small tensor helpers shared by the stages that run a model (sft, prm, rollout, ppo).

Each docstring names the slow, obvious equivalent; tests compare the two.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from .modeling import own_positions


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) under `logits`.

    logits: (B, T, V) float; tokens: (B, T) long -> (B, T) float32.
    Equivalent to `torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]`,
    computed as minus the per-token cross-entropy: the fused log-softmax kernels a causal-LM training
    step uses, forward and backward. (`logit - logsumexp` took six passes over the (B, T, V) logits
    against their two each way: at Qwen2.5's 151,936-token vocabulary the PPO update spent 2x the
    bare step's time in its head.)
    """
    B, T, V = logits.shape
    nll = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, V), tokens.reshape(B * T), reduction="none")
    return -nll.view(B, T)


def tempered(head, temperature: float):
    """`head` whose logits come divided by `temperature`, in float32 (the division vLLM's sampler makes:
    logits.to(float32), then div_: v0.33.0 vllm/v1/sample/sampler.py:157-158, 291-301); `head` itself at 1.

    For the chunked helpers below: the division happens inside each chunk, so no (N, V) copy exists."""
    if temperature == 1:
        return head
    return lambda hidden: head(hidden).float() / temperature


def chunked_token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                           chunk_rows: int) -> torch.Tensor:
    """log p(tokens) under logits = head(hidden), `chunk_rows` rows at a time.

    head: the LM head (hidden -> vocabulary logits); hidden: (N, H) in the model's dtype; tokens:
    (N,) long -> (N,) float32. Equivalent to `token_logprobs(head(hidden)[None], tokens[None])[0]`,
    without the (N, V) logits ever existing at once: each chunk's logits (in the model's dtype, then
    a float32 copy for the log-softmax) are reduced to chunk_rows numbers and freed. Under autograd
    each chunk is recomputed in the backward pass (torch.utils.checkpoint) instead of being kept, so
    the backward pass too holds one chunk's logits at a time, for a second pass through the head.
    TRL's selective_log_softmax (huggingface/trl, trl/trainer/utils.py) and veRL's
    logprobs_from_logits_v2 (volcengine/verl, verl/utils/torch_functional.py) loop over rows of
    logits that already exist; here the head's output itself is made chunk by chunk.
    """
    grad = torch.is_grad_enabled()
    parts = []
    for h, y in zip(hidden.split(chunk_rows), tokens.split(chunk_rows)):
        if grad:
            parts.append(torch.utils.checkpoint.checkpoint(_head_logprobs, head, h, y, use_reentrant=False))
        else:
            parts.append(_head_logprobs(head, h, y))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return -torch.nn.functional.cross_entropy(head(hidden).float(), tokens, reduction="none")


def chunked_entropy(head: torch.nn.Module, hidden: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Entropy of softmax(head(hidden)), `chunk_rows` rows at a time.

    head: the LM head; hidden: (N, H) -> (N,) float32. Equivalent to
    `entropy_from_logits(head(hidden)[None])[0]`, the (N, V) logits never existing at once; under
    autograd each chunk is recomputed in the backward pass, as in `chunked_token_logprobs`.
    """
    return _chunked(_head_entropy, head, chunk_rows, hidden)


def chunked_logprobs_entropy(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                             chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_token_logprobs` and `chunked_entropy` of the same rows from one pass through the head
    per chunk (each chunk's logits made once, not twice): ((N,), (N,)) float32."""
    out = _chunked(_head_logprobs_entropy, head, chunk_rows, hidden, tokens)
    return out[:, 0], out[:, 1]


def _chunked(fn, head: torch.nn.Module, chunk_rows: int, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """fn(head, chunk of hidden, chunks of rest...) over row chunks, checkpointed under autograd, concatenated."""
    grad = torch.is_grad_enabled()
    parts = []
    for chunk in zip(hidden.split(chunk_rows), *(t.split(chunk_rows) for t in rest)):
        if grad:
            parts.append(torch.utils.checkpoint.checkpoint(fn, head, *chunk, use_reentrant=False))
        else:
            parts.append(fn(head, *chunk))
    if parts:
        return torch.cat(parts)
    return torch.cat([fn(head, hidden[:0], *(t[:0] for t in rest))])  # no rows: the right shape, float32


def _head_entropy(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _head_logprobs_entropy(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(head(hidden).float(), dim=-1)                        # (n, V)
    return torch.stack([logp.gather(-1, tokens[:, None])[:, 0], -(logp.exp() * logp).sum(-1)], dim=-1)  # (n, 2)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: (B, T, V) -> (B, T).

    Equivalent to `-(p * log p).sum(-1)` with p = softmax(logits).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of x where mask is true (`x[mask].sum()` for dim=None). Uses where(), never x*mask, so
    a NaN or inf in a masked-out position cannot leak in."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over positions where mask is true (`x[mask].mean()` for dim=None); 0 if none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def mask_positions(model: torch.nn.Module, attention_mask: torch.Tensor, **model_kwargs) -> dict:
    """`model_kwargs` plus position ids that follow the attention mask (so a padded row's tokens sit where
    they would alone), unless the model places its tokens itself (multimodal rope, Qwen2-VL)."""
    if own_positions(model):
        return model_kwargs
    return {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0), **model_kwargs}


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, **model_kwargs) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, under `model` with its logits divided by `temperature`.

    input_ids, attention_mask: (B, T) -> (B, T-1), entry t-1 scoring token t. Position ids follow
    the attention mask, so left- and right-padded batches score the same tokens identically.
    `model_kwargs`: e.g. a vision-language batch's pixel inputs; a model with multimodal rope
    (Qwen2-VL) places its tokens itself and must get a right-padded batch.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, **mask_positions(model, attention_mask, **model_kwargs))
    logits = out.logits[:, :-1]
    return token_logprobs(logits if temperature == 1 else logits.float() / temperature, input_ids[:, 1:])
