"""PPO losses as pure tensor functions, each written from its definition in docs/design.md
("The PPO update").

Every per-token tensor is (B, T): B responses, T = the longest response of the batch, with a
boolean `mask` (B, T) that is true on real response tokens. Masked-out entries are replaced with
`torch.where` before any `exp`, so padding can never put an inf or NaN into a loss or a gradient.
The docstrings name the slow, obvious equivalent; tests/ppo/test_losses.py compares the two.

Registries (names -> small functions, no string if/elif chains):
- `KL_ESTIMATORS`: k1, k2, k3 (http://joschu.net/blog/kl-approx.html);
- `AGGREGATIONS`: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm (Dr. GRPO);
- `ROLLOUT_CORRECTIONS`: truncated / masked importance weights for the sampler-trainer gap.

Aggregation with gradient accumulation: a minibatch is split into micro-batches, and each
micro-batch contributes its *share* of the minibatch's loss, computed with the minibatch's
`Normalizer` (its token count, sequence count...). The shares add up to exactly the loss of the
whole minibatch, whatever the micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..models.tensor_ops import masked_mean, masked_sum


def _where(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


# --- KL estimators --------------------------------------------------------------------------
# x = logp - ref_logp for tokens sampled from p; each estimates KL(p || ref) per token.

def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = x: unbiased, high variance, can be negative per token."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = x^2 / 2: low variance, biased, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


K3_LOG_RATIO_CLAMP, K3_CLAMP = 20.0, 10.0
"""veRL's low-variance KL (volcengine/verl@v0.7.0 verl/trainer/ppo/core_algos.py:1637-1643, kl_penalty_forward
'low_var_kl' / 'k3'): the log-ratio clamped to [-20, 20], the estimate to [-10, 10]. One token where the reference
is far likelier than the policy (exp(-x) with x = -15 is 3.3e6) would otherwise outweigh the rest of the batch."""


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-x) - 1 + x: unbiased and >= 0 (computed with expm1 for precision near x = 0), with x clamped to
    +-K3_LOG_RATIO_CLAMP and k3 to +-K3_CLAMP as veRL does (a clamped token's gradient is 0)."""
    x = (logp - ref_logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(-x) + x).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3,
}


def kl_estimate(name: str, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate `name` (B, T), 0 on masked-out entries (masked before any exp)."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; known: {sorted(KL_ESTIMATORS)}")
    return _where(mask, KL_ESTIMATORS[name](_where(mask, logp), _where(mask, ref_logp)))


# --- policy loss ----------------------------------------------------------------------------

class PolicyLoss(NamedTuple):
    loss: torch.Tensor          # (B, T) per-token loss, 0 where masked
    ratio: torch.Tensor         # (B, T) exp(logp - old_logp), 1 where masked
    clipped: torch.Tensor       # (B, T) bool: the clipped term was taken (its gradient is 0)
    dual_clipped: torch.Tensor  # (B, T) bool: the dual-clip bound was taken (A < 0, ratio > c)


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float = 0.0) -> PolicyLoss:
    """Clipped surrogate per token.

    rho = exp(logp - old_logp); L = -min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A).
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5), for A < 0 only:
    the objective is max(min(rho*A, clip(rho)*A), c*A), i.e. the loss is min(L, -c*A), which bounds
    the loss of a negative-advantage token whose ratio has run away (rho > c). `dual_clip` = c > 1,
    0 = off. Slow equivalent: a Python loop over tokens with `math.exp` and `min`/`max`.
    """
    mask = mask.bool()
    log_ratio = _where(mask, logp - old_logp)          # masked before exp: padding cannot overflow
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = mask & (clipped_term > unclipped)
    dual = torch.zeros_like(mask)
    if dual_clip > 0:
        bound = -dual_clip * advantages
        dual = mask & (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return PolicyLoss(_where(mask, loss), ratio, clipped, dual)


# --- value loss -----------------------------------------------------------------------------

class ValueLoss(NamedTuple):
    loss: torch.Tensor     # (B, T), 0 where masked
    clipped: torch.Tensor  # (B, T) bool: the clipped error was the larger one (its gradient is 0)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_eps: float = 0.2) -> ValueLoss:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2) per token; eps <= 0: 0.5*(V-R)^2."""
    mask = mask.bool()
    unclipped = (values - returns) ** 2
    if clip_eps <= 0:
        return ValueLoss(_where(mask, 0.5 * unclipped), torch.zeros_like(mask))
    v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped_err = (v_clipped - returns) ** 2
    return ValueLoss(_where(mask, 0.5 * torch.maximum(unclipped, clipped_err)), mask & (clipped_err > unclipped))


# --- aggregation ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Normalizer:
    """Counts of the whole minibatch that a micro-batch's share is divided by."""

    tokens: int
    """Valid tokens in the minibatch (token-mean)."""
    sequences: int
    """Sequences with at least one valid token (seq-mean-token-mean)."""
    rows: int
    """Sequences in the minibatch, valid tokens or not (Dr. GRPO's batch size)."""
    max_len: int
    """Dr. GRPO's constant length: the generation budget (ppo.batch.dr_grpo_length); `of` without one takes the
    longest response of the masks, for callers that aggregate a batch on its own."""

    @classmethod
    def of(cls, masks: list[torch.Tensor] | torch.Tensor, max_len: int | None = None) -> "Normalizer":
        """Counts over one mask (B, T) or the masks of all micro-batches of a minibatch."""
        masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
        tokens = sum(int(m.bool().sum()) for m in masks)
        sequences = sum(int(m.bool().any(-1).sum()) for m in masks)
        rows = sum(m.shape[0] for m in masks)
        longest = max(int(m.bool().sum(-1).max()) if m.numel() else 0 for m in masks)
        return cls(tokens, sequences, rows, max_len if max_len else max(longest, 1))


def token_mean(x: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """sum of x over valid tokens / valid tokens of the minibatch (every token weighs the same)."""
    return masked_sum(x, mask) / max(norm.tokens, 1)


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """mean over sequences of (mean over that sequence's valid tokens): every sequence weighs the same."""
    per_seq = masked_mean(x, mask, dim=-1)  # (B,), 0 for a sequence with no valid token
    return per_seq.sum() / max(norm.sequences, 1)


def seq_mean_token_sum_norm(x: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): sum over valid tokens / (sequences * constant max_len), no length bias."""
    return masked_sum(x, mask) / max(norm.rows * norm.max_len, 1)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Normalizer], torch.Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(mode: str, x: torch.Tensor, mask: torch.Tensor, norm: Normalizer | None = None) -> torch.Tensor:
    """This (micro-)batch's share of the minibatch loss under `mode` (the whole loss when norm is None)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](x, mask, norm if norm is not None else Normalizer.of(mask))


# --- rollout correction (the sampler-trainer gap) ---------------------------------------------
# The responses were drawn by the sampler (vLLM's bf16 kernels, or the HF engine), whose
# probabilities differ from the trainer's own forward even at the same weights. PPO's ratio is
# taken against the trainer's old log-probs, so the gradient is an expectation under the trainer's
# policy over samples that came from the sampler's: each token's loss is weighted by
# w = pi_old(y_t) / pi_sampler(y_t), truncated (TIS) or dropped (MIS) above a cap so a rare token
# the sampler under-weighted cannot dominate. Sequence modes use the product over the response.
# Peers: TRL GRPOTrainer `vllm_importance_sampling_mode` (token/sequence x truncate/mask), veRL
# rollout correction (token/sequence TIS, MIS), OpenRLHF `tis|icepop`.

ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
MAX_LOG_WEIGHT = 50.0  # a sequence's summed log-ratio can exceed exp's float32 range; 5e21 is "above any cap"


class RolloutCorrection(NamedTuple):
    weights: torch.Tensor  # (B, T) the weight each token's policy loss is multiplied by, 0 where masked
    raw: torch.Tensor      # (B, T) the weight before truncation / masking (a sequence's on each of its tokens)
    capped: torch.Tensor   # (B, T) bool: the raw weight was above the cap (truncated or dropped)


def rollout_correction(old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> RolloutCorrection:
    """Importance weights of the trainer's policy over the sampler's, per token (B, T).

    token_*: w_t = exp(old_t - behavior_t); sequence_*: every token of response i gets
    w_i = exp(sum_t (old_t - behavior_t)). *_truncate: min(w, cap); *_mask: 0 where w > cap (the
    token or response leaves the policy loss). Slow equivalent: per row, a Python loop with
    `math.exp` of each difference (or of their sum) and `min(w, cap)` / `0 if w > cap else w`.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; known: {list(ROLLOUT_CORRECTIONS)}")
    mask = mask.bool()
    log_w = _where(mask, old_logp - behavior_logp)                                  # (B, T), 0 on padding
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)                        # (B, T), one value per row
    raw = torch.exp(log_w.clamp(max=MAX_LOG_WEIGHT))
    capped = mask & (raw > cap)
    weights = raw.clamp(max=cap) if mode.endswith("truncate") else torch.where(capped, torch.zeros_like(raw), raw)
    return RolloutCorrection(_where(mask, weights), _where(mask, raw), capped)


def rollout_correction_stats(corr: RolloutCorrection, mask: torch.Tensor, mode: str) -> dict[str, float]:
    """Mean of the applied weight, max of the raw weight and the share above the cap: over the valid
    tokens (token modes) or over the responses with a token (sequence modes)."""
    mask = mask.bool()
    if mode.startswith("sequence"):
        rows = mask.any(-1)
        w, raw, capped = corr.weights[rows, 0], corr.raw[rows, 0], corr.capped[rows, 0]
    else:
        w, raw, capped = corr.weights[mask], corr.raw[mask], corr.capped[mask]
    if w.numel() == 0:
        return {}
    return {"is_weight_mean": float(w.mean()), "is_weight_raw_max": float(raw.max()),
            "is_capped_frac": float(capped.float().mean())}


# --- token selection ------------------------------------------------------------------------

def top_fraction(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Boolean mask of the entries of 1-D `scores` in the highest `fraction` (at least one entry).

    Used to train only on the highest-entropy tokens (Wang et al. 2025, "Beyond the 80/20 rule").
    Ties at the threshold are kept. Slow equivalent: sort descending, threshold = the
    ceil(fraction*n)-th value, keep scores >= threshold.
    """
    n = scores.numel()
    if fraction >= 1.0 or n == 0:
        return torch.ones_like(scores, dtype=torch.bool)
    k = max(1, math.ceil(fraction * n))
    threshold = torch.topk(scores, k).values.min()
    return scores >= threshold
