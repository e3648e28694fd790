"""Passes over the batch before the first update: what the hand-off lacks or the config recomputes
(old log-probs, the top-entropy token mask, V_old from a new critic), and the prompts' images.
"""

from __future__ import annotations

import torch

from ..models import vision
from ..training.engine import TrainEngine
from ...errors import DataError
from . import losses
from .minibatches import Sample, collate, micro_split
from .config import Config
from .actor_critic import PolicyScorer, response_values


@torch.no_grad()
def precompute(cfg: Config, samples: list[Sample], plan: list[list[int]], actor: TrainEngine,
               critic: TrainEngine | None, pad_id: int) -> dict[str, float]:
    """Fill what the hand-off lacks or what the config asks to recompute, with the starting weights.

    Runs the micro-batches of the first epoch in training order, so a recomputed old_logprobs is
    bit-identical to what the first update computes (its ratio is exactly 1). Where the hand-off had
    old_logprobs too, returns how far the rollout's numbers were from this engine's:
    `train/old_logprob_gap_max` and `_mean` (|hand-off - recomputed| over the response tokens), the
    sampler-trainer mismatch that a ratio against the hand-off would have clipped as if it were a policy change.
    Then, with rollout_correction on, each sample's importance weights (`attach_rollout_correction`).
    """
    out = _fill(cfg, samples, plan, actor, critic, pad_id)
    if cfg.rollout_correction != "none":
        out.update(attach_rollout_correction(cfg, samples))
    return out


def attach_rollout_correction(cfg: Config, samples: list[Sample]) -> dict[str, float]:
    """Give every sample its rollout_correction weights (`is_weight`, from its final old_logprobs and
    the hand-off's behavior_logprobs) and return the batch's statistics as `train/is_*` metrics."""
    rows = [i for i, s in enumerate(samples) if s.old_logprobs is not None and s.behavior_logprobs is not None]
    if not rows:
        return {}
    R = max(max(len(samples[i].response_ids) for i in rows), 1)
    old, behavior = torch.zeros((len(rows), R)), torch.zeros((len(rows), R))  # (N, R)
    mask = torch.zeros((len(rows), R), dtype=torch.bool)
    for b, i in enumerate(rows):
        r = len(samples[i].response_ids)
        old[b, :r], behavior[b, :r], mask[b, :r] = torch.tensor(samples[i].old_logprobs), torch.tensor(samples[i].behavior_logprobs), True
    corr = losses.rollout_correction(old, behavior, mask, cfg.rollout_correction, cfg.rollout_correction_cap)
    for b, i in enumerate(rows):
        samples[i].is_weight = corr.weights[b, :len(samples[i].response_ids)].tolist()
    return {f"train/{k}": v for k, v in losses.rollout_correction_stats(corr, mask, cfg.rollout_correction).items()}


def _fill(cfg: Config, samples: list[Sample], plan: list[list[int]], actor: TrainEngine, critic: TrainEngine | None,
          pad_id: int) -> dict[str, float]:
    need_logp = cfg.recomputes_old_logprobs()
    gaps: list[torch.Tensor] = []
    need_entropy = cfg.top_entropy_frac < 1
    need_values = critic is not None and any(s.values is None for s in samples)
    if not (need_logp or need_entropy or need_values):
        return {}
    per_epoch = len(samples) // cfg.minibatch_size
    seen = [i for rows in plan[:per_epoch] for i in rows]
    rest = sorted(set(range(len(samples))) - set(seen))
    chunks = [c for rows in plan[:per_epoch] for c in micro_split(rows, cfg.micro_batch_size)]
    chunks += micro_split(rest, cfg.micro_batch_size)
    score = PolicyScorer(actor, cfg.head_chunk_rows)
    entropies: dict[int, torch.Tensor] = {}
    for rows in chunks:
        rows = [i for i in rows if not samples[i].image_mismatch]  # their batches are skipped
        if not rows:
            continue
        mb = collate(samples, rows, pad_id, fields=()).to(actor.device)
        if need_logp or need_entropy:
            scores = score(mb, entropy=need_entropy)
            logp, ent = scores.logp.cpu(), scores.entropy.cpu() if need_entropy else None
        if need_values:
            values = response_values(critic, mb).cpu()
        for b, i in enumerate(rows):
            r = len(samples[i].response_ids)
            if need_logp:
                if samples[i].old_logprobs is not None:
                    gaps.append((logp[b, :r] - torch.tensor(samples[i].old_logprobs)).abs())
                samples[i].old_logprobs = logp[b, :r].tolist()
            if need_entropy:
                entropies[i] = ent[b, :r]
            if need_values:
                samples[i].values = values[b, :r].tolist()
    if need_entropy:  # threshold over every token of the batch, not per micro-batch
        order = sorted(entropies)
        keep_mask = losses.top_fraction(torch.cat([entropies[i] for i in order]), cfg.top_entropy_frac)
        start = 0
        for i in order:
            r = entropies[i].numel()
            samples[i].pg_mask = keep_mask[start:start + r].float().tolist()
            start += r
    if not gaps:
        return {}
    gap = torch.cat(gaps)
    return {"train/old_logprob_gap_max": gap.max().item(), "train/old_logprob_gap_mean": gap.mean().item()}


def attach_pixels(cfg: Config, samples: list[Sample], vis: "vision.Vision | None") -> None:
    """Re-feed the prompts' images: each sample gets the pixel inputs of its `images` (decoded and
    processed again with the policy's image processor) and, when its image tokens do not match
    them, the reason (`image_mismatch`): the update of any minibatch holding it is skipped."""
    if not any(s.images for s in samples):
        return
    if vis is None:
        raise DataError(f"'{cfg.input}' has rows with images, but the policy '{cfg.policy}' is text-only; "
                        f"train a vision-language policy on them.")
    cache: dict[tuple, dict] = {}
    for i, s in enumerate(samples):
        images = s.images or []
        key = tuple(images)
        if key not in cache:
            cache[key] = vis.pixels(images, f"'{cfg.input}', row {i}")
        s.pixels = cache[key]
        s.image_mismatch = vis.mismatch(s.prompt_ids + s.response_ids, s.pixels)  # what the model sees

