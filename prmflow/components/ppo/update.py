"""One PPO update: the actor's clipped surrogate (plus entropy, KL and ptx terms) and the critic's
clipped value loss over the micro-batches of one minibatch, then one optimizer step of each.

Each micro-batch loss is its exact share of the minibatch objective (`losses.Normalizer` counts the
tokens of the whole minibatch), so gradient accumulation changes nothing but memory. Log-probs are
recomputed under the current policy in every micro-batch; the ratio's denominator is old_logprobs.
If any loss or gradient is NaN/inf the whole update is discarded (no step, no schedule step).

Formulas (docs/design.md, "The PPO update"; `losses.py` has each as a pure function):
- clipped surrogate, PPO (Schulman et al. 2017, eq. 7, https://arxiv.org/abs/1707.06347) with
  separate low/high clip (DAPO, https://arxiv.org/abs/2503.14476) and dual clip
  (Ye et al. 2020, https://arxiv.org/abs/1912.09729);
- KL estimators k1/k2/k3: http://joschu.net/blog/kl-approx.html;
- clipped value loss: as in OpenAI baselines' ppo2 (https://github.com/openai/baselines);
- Dr. GRPO aggregation (Liu et al. 2025, https://arxiv.org/abs/2503.20783);
- ptx loss: InstructGPT's pretraining mix (Ouyang et al. 2022, eq. 2, https://arxiv.org/abs/2203.02155).
"""

from __future__ import annotations

import math

import torch

from ..runtime import distributed
from ..training.engine import TrainEngine
from ..models.tensor_ops import entropy_from_logits, masked_sum
from . import losses
from .minibatches import MicroBatch
from .config import Config
from .actor_critic import PolicyScorer, entropy_sample, response_values
from .ptx import PtxScorer

#: Statistics summed over the minibatch's tokens and reported as per-token means.
TOKEN_MEANS = ("entropy", "clip_frac", "dual_clip_frac", "approx_kl", "value_clip_frac")


class Updater:
    """Runs one optimizer update of the actor and/or the critic on one minibatch."""

    def __init__(self, cfg: Config, actor: TrainEngine, critic: TrainEngine | None, max_len: int):
        self.cfg, self.actor, self.critic, self.max_len = cfg, actor, critic, max_len  # max_len: Dr. GRPO's constant
        self.score = PolicyScorer(actor, cfg.head_chunk_rows)  # the LM head read chunk by chunk (0: whole logits)
        self.ptx = PtxScorer(actor, cfg.head_chunk_rows)        # the same for the ptx loss's trained tokens

    def actor_loss(self, mb: MicroBatch, norm: losses.Normalizer, pg_norm: losses.Normalizer, ptx_mb, ptx_tokens):
        """This micro-batch's share of the policy objective and its statistics (sums over its tokens)."""
        cfg, f, mask = self.cfg, mb.fields, mb.mask
        # log-probs (and entropies) of the response tokens; without an entropy bonus, the entropy metric
        # from a sample of the tokens, without a graph
        sample, n_masked = (None, 0) if cfg.entropy_coef > 0 else entropy_sample(mask, cfg.entropy_metric_tokens)
        scores = self.score(mb, entropy=cfg.entropy_coef > 0, sample=sample)
        logp = scores.logp                                                        # (B, R)
        adv = f["advantages"].clamp(-cfg.advantage_clip, cfg.advantage_clip) if cfg.advantage_clip else f["advantages"]

        # policy loss: -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), rho = exp(logp - old_logp)
        pg = losses.ppo_policy_loss(logp, f["old_logprobs"], adv, mask, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
        pg_mask = mask & (f["pg_mask"] > 0) if "pg_mask" in f else mask          # (B, R) top-entropy tokens
        # rollout correction: each token's loss weighted by pi_old / pi_sampler, truncated or masked (prepass)
        pg_tokens = pg.loss * f["is_weight"] if "is_weight" in f else pg.loss
        pg_loss = losses.aggregate(cfg.loss_agg, pg_tokens, pg_mask, pg_norm)
        loss = pg_loss

        # entropy bonus; without one, the metric's sample: its mean times the masked count
        if cfg.entropy_coef > 0:
            entropy = scores.entropy                                              # (B, R)
            loss = loss - cfg.entropy_coef * losses.aggregate(cfg.loss_agg, entropy, mask, norm)
            entropy_sum = float(masked_sum(entropy.detach(), mask))
        else:
            entropy_sum = float(scores.sampled.sum()) * n_masked / sample.numel() if n_masked else 0.0
        stats = {"policy_loss": float(pg_loss.detach()), "entropy": entropy_sum,
                 "clip_frac": float(pg.clipped.sum()), "dual_clip_frac": float(pg.dual_clipped.sum()),
                 "approx_kl": float(masked_sum(losses.kl_estimate("k3", f["old_logprobs"], logp.detach(), mask), mask)),
                 "ratio_max": float(torch.where(mask, pg.ratio.detach(), 0).max()),
                 "ratio_min": float(torch.where(mask, pg.ratio.detach(), float("inf")).min())}

        # KL loss to the reference (GRPO style), estimator k1/k2/k3
        if cfg.kl_loss_coef > 0:
            kl = losses.kl_estimate(cfg.kl_loss_estimator, logp, f["ref_logprobs"], mask)  # (B, R)
            kl_loss = losses.aggregate(cfg.loss_agg, kl, mask, norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["kl_loss"] = float(kl_loss.detach())

        # ptx loss: token-mean cross-entropy on reference solutions, its share of the update's tokens
        if ptx_mb is not None:
            ptx_mb = {k: v.to(self.actor.device) for k, v in ptx_mb.items()}
            ce_sum = self.ptx(ptx_mb)                                             # sum of -log p over its tokens
            loss = loss + cfg.ptx_coef * ce_sum / max(ptx_tokens, 1)
            stats["ptx_loss"] = float(ce_sum.detach()) / max(ptx_tokens, 1)
        return loss, stats

    def critic_loss(self, mb: MicroBatch, norm: losses.Normalizer):
        """This micro-batch's share of the clipped value loss: V may move value_clip from V_old."""
        f = mb.fields
        values = response_values(self.critic, mb)                                 # (B, R)
        vl = losses.clipped_value_loss(values, f["values"], f["returns"], mb.mask, self.cfg.value_clip)
        loss = losses.token_mean(vl.loss, mb.mask, norm)
        return loss, {"value_loss": float(loss.detach()), "value_clip_frac": float(vl.clipped.sum())}

    def update(self, micro: list[MicroBatch], train_actor: bool, ptx_batch=None,
               whole: list[MicroBatch] | None = None) -> dict | None:
        """One optimizer update over the micro-batches of a minibatch; None when it was skipped.

        With N ranks, `micro` is this rank's share of each micro-batch and `whole` the micro-batches
        of the whole minibatch: the losses are normalized by the whole minibatch's counts, so the
        ranks' shares add up to one process's loss, and the statistics are summed over the ranks.
        """
        whole = micro if whole is None else whole
        norm = losses.Normalizer.of([m.mask for m in whole], self.max_len)
        pg_norm = (losses.Normalizer.of([m.mask & (m.fields["pg_mask"] > 0) for m in whole], self.max_len)
                   if "pg_mask" in whole[0].fields else norm)
        engines = ([self.actor] if train_actor else []) + ([self.critic] if self.critic is not None else [])
        ptx_micro, ptx_tokens = ptx_batch if (train_actor and ptx_batch is not None) else ([None] * len(micro), 0)
        sums: dict[str, float] = {}

        # forward and backward, micro-batch by micro-batch; a NaN/inf loss discards the whole update
        for j, mb in enumerate(micro):
            mb = mb.to(self.actor.device)
            pending = []
            if train_actor:
                loss, stats = self.actor_loss(mb, norm, pg_norm, ptx_micro[j], ptx_tokens)
                pending.append((self.actor, loss))
                _accumulate(sums, stats)
            if self.critic is not None:
                loss, stats = self.critic_loss(mb, norm)
                pending.append((self.critic, loss))
                _accumulate(sums, stats)
            if distributed.any_rank(not all(bool(torch.isfinite(loss.detach())) for _, loss in pending)):
                return _discard(engines)  # on every rank, whichever rank saw it
            for engine, loss in pending:
                engine.backward(loss)
            sums["tokens"] = sums.get("tokens", 0) + mb.tokens
        if distributed.any_rank(not all(engine.grads_finite() for engine in engines)):
            return _discard(engines)

        # optimizer steps and the update's statistics (sums over the ranks' shares)
        sums = _reduce_ranks(sums)
        out = {k: v for k, v in sums.items() if k in ("policy_loss", "kl_loss", "ptx_loss", "value_loss", "tokens")}
        out.update({k: sums[k] / max(norm.tokens, 1) for k in TOKEN_MEANS if k in sums})
        if train_actor:
            out.update(ratio_max=sums["ratio_max"], ratio_min=sums["ratio_min"], lr=self.actor.lr)
            out["grad_norm"] = self.actor.step()
        if self.critic is not None:
            out["critic_lr"] = self.critic.lr
            out["critic_grad_norm"] = self.critic.step()
        return out


def entropy_metric_sum(logits: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> float:
    """The sum of the entropy over the masked tokens of (B, R, V) logits, estimated from at most
    `max_tokens` of them, evenly spaced in order (0 = all): their mean times the masked count.

    Slow equivalent: `masked_sum(entropy_from_logits(logits), mask)` (exact when max_tokens is 0 or at
    least the masked count). Only the picked rows of the logits pass through the softmax."""
    where, n = entropy_sample(mask, max_tokens)
    if n == 0:
        return 0.0
    T = mask.shape[1]
    rows = logits[where // T, where % T]  # (k, V): only the picked rows (a reshape of the sliced logits would copy all)
    return float(entropy_from_logits(rows).sum()) * n / where.numel()


def _discard(engines: list[TrainEngine]) -> None:
    for engine in engines:
        engine.discard()
    return None


def _reduce_ranks(sums: dict) -> dict:
    """The statistics of the whole minibatch from each rank's: sums added, the ratio's extremes kept."""
    if distributed.world_size() == 1:
        return sums
    out = {k: distributed.sum_ranks(v) for k, v in sums.items() if k not in ("ratio_max", "ratio_min")}
    if "ratio_max" in sums:
        out["ratio_max"] = -distributed.min_ranks(-sums["ratio_max"])
        out["ratio_min"] = distributed.min_ranks(sums["ratio_min"])
    return out


def _accumulate(sums: dict, stats: dict) -> None:
    """Add a micro-batch's statistics: sums, except the ratio's extremes."""
    for k, v in stats.items():
        if k == "ratio_max":
            sums[k] = max(sums.get(k, -math.inf), v)
        elif k == "ratio_min":
            sums[k] = min(sums.get(k, math.inf), v)
        else:
            sums[k] = sums.get(k, 0.0) + v
