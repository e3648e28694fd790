"""Passes over the batch before the first update: what the hand-off lacks or the config recomputes
(old log-probs, the top-entropy token mask, V_old from a new critic), and the prompts' images.
"""

from __future__ import annotations

import torch

from ..runtime import distributed
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

    Runs the micro-batches of the first epoch in training order, each rank its own share of each (as the
    update cuts them), so a recomputed old_logprobs is bit-identical to what the first update computes on
    every rank (its ratio is exactly 1) and each rank forwards 1/N of the batch; the ranks then exchange
    their rows' results, as a later epoch trains a row on another rank. Where the hand-off had
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
        old[b, :r] = torch.tensor(samples[i].old_logprobs)
        behavior[b, :r] = torch.tensor(samples[i].behavior_logprobs)
        mask[b, :r] = samples[i].trained()
    corr = losses.rollout_correction(old, behavior, mask, cfg.rollout_correction, cfg.rollout_correction_cap)
    for b, i in enumerate(rows):
        samples[i].is_weight = corr.weights[b, :len(samples[i].response_ids)].tolist()
    return {f"train/{k}": v for k, v in losses.rollout_correction_stats(corr, mask, cfg.rollout_correction).items()}


def _fill(cfg: Config, samples: list[Sample], plan: list[list[int]], actor: TrainEngine, critic: TrainEngine | None,
          pad_id: int) -> dict[str, float]:
    need_logp = cfg.recomputes_old_logprobs()
    need_entropy = cfg.top_entropy_frac < 1
    need_values = critic is not None and any(s.values is None for s in samples)
    if not (need_logp or need_entropy or need_values):
        return {}
    per_epoch = len(samples) // cfg.minibatch_size
    seen = [i for rows in plan[:per_epoch] for i in rows]
    rest = sorted(set(range(len(samples))) - set(seen))
    chunks = [c for rows in plan[:per_epoch] for c in micro_split(rows, cfg.micro_batch_size)]
    chunks += micro_split(rest, cfg.micro_batch_size)
    mine = _score(cfg, samples, _forwards(samples, chunks), actor, critic, pad_id, need_logp, need_entropy, need_values)
    order = {i: k for k, i in enumerate(i for rows in chunks for i in rows)}  # the rows in the order one process scores
    scored = sorted((item for part in distributed.gather_objects(mine) for item in part), key=lambda item: order[item[0]])
    gaps: list[torch.Tensor] = []
    for i, got in scored:
        if need_logp:
            if samples[i].old_logprobs is not None:
                gaps.append((got["logp"] - torch.tensor(samples[i].old_logprobs)).abs())
            samples[i].old_logprobs = got["logp"].tolist()
        if need_values:
            samples[i].values = got["values"].tolist()
    if need_entropy:  # threshold over every trained token of the batch, not per micro-batch
        entropies = {i: got["entropy"][samples[i].trained()] for i, got in scored}
        order = sorted(entropies)
        keep_mask = losses.top_fraction(torch.cat([entropies[i] for i in order]), cfg.top_entropy_frac)
        start = 0
        for i in order:
            trained = samples[i].trained()
            r = int(trained.sum())
            pg = torch.zeros(len(trained))
            pg[trained] = keep_mask[start:start + r].float()
            samples[i].pg_mask = pg.tolist()
            start += r
    if not gaps:
        return {}
    gap = torch.cat(gaps)
    return {"train/old_logprob_gap_max": gap.max().item(), "train/old_logprob_gap_mean": gap.mean().item()}


def _forwards(samples: list[Sample], chunks: list[list[int]]) -> list[tuple[list[int], bool]]:
    """This rank's forward passes over `chunks` (micro-batches of row indices): (rows, keep the results?).

    Each rank takes its share of each micro-batch as the update cuts it (`distributed.shard`), less the rows
    whose image tokens do not match their images (their updates are skipped). The ranks' shares, in rank
    order, are the micro-batch again. Every rank forwards in step with the others (ZeRO-3 gathers the
    weights inside each forward): one whose share is empty scores another rank's first row and drops it."""
    n, me = distributed.world_size(), distributed.rank()
    out = []
    for rows in chunks:
        shares = [[i for i in distributed.shard(rows, r, n) if not samples[i].image_mismatch] for r in range(n)]
        if shares[me]:
            out.append((shares[me], True))
        elif any(shares):
            out.append(([next(i for share in shares for i in share)], False))
    return out


def _score(cfg: Config, samples: list[Sample], forwards: list[tuple[list[int], bool]], actor: TrainEngine,
           critic: TrainEngine | None, pad_id: int, need_logp: bool, need_entropy: bool,
           need_values: bool) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Forward each (rows, keep) of `_forwards` as one micro-batch: [(row, {"logp", "entropy", "values":
    (r,) float32 over its r response tokens, those asked for})] of the kept rows, in order, on the CPU."""
    score = PolicyScorer(actor, cfg.head_chunk_rows)
    out = []
    for rows, keep in forwards:
        mb = collate(samples, rows, pad_id, fields=()).to(actor.device)
        got: dict[str, torch.Tensor] = {}
        if need_logp or need_entropy:
            scores = score(mb, entropy=need_entropy)
            got["logp"] = scores.logp.cpu()
            if need_entropy:
                got["entropy"] = scores.entropy.cpu()
        if need_values:
            got["values"] = response_values(critic, mb).cpu()
        for b, i in enumerate(rows if keep else ()):
            r = len(samples[i].response_ids)
            out.append((i, {k: v[b, :r].clone() for k, v in got.items()}))
    return out


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

