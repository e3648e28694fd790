"""Small tensor helpers shared by the stages that run a model (sft, prm, rollout, ppo).

Each docstring names the slow, obvious equivalent; tests compare the two.
"""

from __future__ import annotations

import torch

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


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      **model_kwargs) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, under `model`.

    input_ids, attention_mask: (B, T) -> (B, T-1), entry t-1 scoring token t. Position ids follow
    the attention mask, so left- and right-padded batches score the same tokens identically.
    `model_kwargs`: e.g. a vision-language batch's pixel inputs; a model with multimodal rope
    (Qwen2-VL) places its tokens itself and must get a right-padded batch.
    """
    if not own_positions(model):
        model_kwargs = {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0), **model_kwargs}
    out = model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    return token_logprobs(out.logits[:, :-1], input_ids[:, 1:])
