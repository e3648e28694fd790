"""One batch of rollouts -> its token rewards, advantages, returns and kl, as the columns to write.

Every batch is vectorized over a flat ragged layout (estimators.Ragged: no padding, no Python loop
over samples or tokens). `compute_batch` gives the estimator's raw advantages (what the whitening
pass measures); `finish_batch` whitens, weights and clamps them, drops the rows of dropped groups and
appends the four new columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..data import schema
from ...errors import DataError
from .config import Plan
from .estimators import Moments, Ragged
from .token_rewards import (
    PROGRESS, STEPLESS_SCORE, clip_rewards, kl_per_token, make_steps, step_contributions, token_rewards,
)

# --- naming a row, nulls where values are needed ------------------------------------------------

def describe_row(t: pa.Table, i: int) -> str:
    """Row i of `t` as a user finds it again: its prompt_id, sample_idx and iteration."""
    return (f"prompt_id={t['prompt_id'][i].as_py()!r}, sample_idx={t['sample_idx'][i].as_py()}, "
            f"iteration={t['iteration'][i].as_py()}")


def check_not_null(t: pa.Table, plan: Plan, columns) -> None:
    """DataError naming the column, the first row and the config key, for nulls where values are needed."""
    for name in columns:
        col = t.column(name)
        if name in schema.REQUIRED or name not in plan.needs or not col.null_count:
            continue
        if col.null_count == t.num_rows:
            what = f"has no '{name}' column (null in every row, e.g. {describe_row(t, 0)})"
        else:
            i = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
            what = f"column '{name}' is null for {describe_row(t, i)}"
        raise DataError(f"{plan.where} {what}, but {plan.needs[name]}.")


# --- token rewards and advantages ----------------------------------------------------------

@dataclass
class BatchResult:
    """One batch's computed columns as flat arrays over its N tokens (float64)."""

    layout: Ragged
    token_rewards: np.ndarray
    advantages: np.ndarray
    """(N,) straight from the estimator: no whitening, weighting or clamping yet."""
    returns: np.ndarray
    kl: np.ndarray | None
    """(N_kl,) over the tokens of the rows in kl_rows; None when no row has both logprob columns."""
    kl_rows: np.ndarray
    """(B,) bool rows that have a kl."""


def flat_values(t: pa.Table, name: str) -> np.ndarray:
    """The list column `name` flattened: (N,) values of all rows end to end."""
    return pc.list_flatten(t[name]).to_numpy(zero_copy_only=False)


def _kl(t: pa.Table, plan: Plan) -> tuple[np.ndarray | None, np.ndarray]:
    """(N_kl,) per-token KL of rows having old_logprobs and ref_logprobs, and the (B,) mask of those rows."""
    rows = ~(pc.is_null(t["old_logprobs"]).to_numpy(zero_copy_only=False)
             | pc.is_null(t["ref_logprobs"]).to_numpy(zero_copy_only=False))
    if not rows.any():
        return None, rows
    sub = t if rows.all() else t.select(["old_logprobs", "ref_logprobs"]).filter(pa.array(rows))
    kl = kl_per_token(flat_values(sub, "old_logprobs"), flat_values(sub, "ref_logprobs"), plan.cfg.kl_estimator)
    return kl, rows


def compute_batch(t: pa.Table, group_rows: dict[str, np.ndarray], plan: Plan) -> BatchResult:
    """Token rewards, advantages and returns for one validated rollouts table."""
    cfg, est = plan.cfg, plan.est
    check_not_null(t, plan, plan.needs)
    layout = Ragged.from_lengths(pc.list_value_length(t["response_ids"]).to_numpy(zero_copy_only=False))
    if plan.outcome and est.uses_token_rewards and not layout.nonempty.all():
        i = int(np.flatnonzero(~layout.nonempty)[0])
        raise DataError(f"{plan.where}: response_ids is empty for {describe_row(t, i)}, so the outcome reward has no "
                        f"token to go to. Drop empty responses in the rollout stage, or set outcome_reward=false.")
    kl, kl_rows = _kl(t, plan)
    steps = outcome = None
    if plan.outcome:
        outcome = clip_rewards(t["outcome_reward"].to_numpy().astype(np.float64), cfg.reward_clip)
    at_last = outcome
    if plan.steps:
        counts = pc.list_value_length(t["step_rewards"]).to_numpy(zero_copy_only=False).astype(np.int64)
        if cfg.step_reward_mode == PROGRESS:  # computed once by the progress pass; the last step holds the outcome
            contrib = group_rows["process_progress"]
            at_last = np.where(counts > 0, 0.0, outcome)
        else:
            contrib = step_contributions(flat_values(t, "step_rewards"), counts, cfg.step_reward_mode, cfg.reward_clip)
        steps = make_steps(layout, flat_values(t, "step_ends").astype(np.int64), counts, contrib,
                           to_end=not est.uses_token_rewards,  # grpo_process, grpo_progress
                           stepless=STEPLESS_SCORE if est.signal == "steps" else None)
    rewards = token_rewards(layout, kl if plan.beta > 0 else None, plan.beta, steps, at_last)
    values = flat_values(t, "values").astype(np.float64) if est.needs_values else None
    available = {"layout": layout, "token_rewards": rewards, "gamma": cfg.gamma, "lam": cfg.lam, "eps": cfg.norm_eps,
                 "values": values, "outcome": outcome, "steps": steps, "group_n": group_rows["group_n"],
                 "group_mean": group_rows["group_mean"], "group_std": group_rows["group_std"],
                 "group_sum": group_rows["group_sum"]}
    if est.process:
        recorded = layout.offsets[:-1][steps.row] + flat_values(t, "step_ends").astype(np.int64)
        available.update(process_weight=group_rows["process_weight"], process_values=group_rows["process_values"],
                         process_credit=cfg.process_credit, recorded_ends=recorded,
                         boundary_lag=group_rows["boundary_lag"])
    advantages, returns = est.compute(available)
    return BatchResult(layout, rewards, advantages, returns, kl, kl_rows)


# --- the columns to write -------------------------------------------------------------------------

def _list_column(offsets: np.ndarray, values: np.ndarray, name: str, t: pa.Table,
                 mask: np.ndarray | None = None) -> pa.Array:
    """A list<float32> column from (B+1,) int32 offsets and flat float64 values; non-finite is a DataError."""
    v32 = values.astype(np.float32)
    bad = ~np.isfinite(v32)
    if bad.any():
        row = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
        raise DataError(f"computing '{name}' overflowed float32 for {describe_row(t, row)}: check old_logprobs, "
                        f"ref_logprobs and values for extreme entries (kl_estimator=k3 grows like exp(ref - old)).")
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(v32), mask=None if mask is None else pa.array(mask))


def finish_batch(t: pa.Table, res: BatchResult, rows: dict[str, np.ndarray], plan: Plan,
                 whitening: Moments | None) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Post-process the advantages (whiten, weight, clamp), drop rows, append the four new columns."""
    cfg = plan.cfg
    layout = res.layout
    adv = res.advantages
    if whitening is not None:
        adv = (adv - whitening.mean) / (whitening.std + cfg.norm_eps)
    if (rows["weight"] != 1.0).any():
        adv = adv * layout.broadcast(rows["weight"])
    if cfg.advantage_clip > 0:
        adv = np.clip(adv, -cfg.advantage_clip, cfg.advantage_clip)
    columns = {"token_rewards": res.token_rewards, "advantages": adv, "returns": res.returns}
    kl, kl_rows = res.kl, res.kl_rows
    keep = rows["keep"]
    if not keep.all():
        tokens = layout.broadcast(keep)
        columns = {k: v[tokens] for k, v in columns.items()}
        if kl is not None:
            kl = kl[np.repeat(keep[kl_rows], layout.lengths[kl_rows])]
        kl_rows = kl_rows[keep]
        t = t.filter(pa.array(keep))
        layout = Ragged.from_lengths(layout.lengths[keep])
    offsets = layout.offsets.astype(np.int32)
    for name, values in columns.items():
        t = t.append_column(name, _list_column(offsets, values, name, t))
    if kl is None:
        t = t.append_column("kl", pa.nulls(t.num_rows, pa.list_(pa.float32())))
    else:
        kl_offsets = np.zeros(t.num_rows + 1, dtype=np.int32)
        np.cumsum(layout.lengths * kl_rows, out=kl_offsets[1:])
        t = t.append_column("kl", _list_column(kl_offsets, kl, "kl", t, mask=None if kl_rows.all() else ~kl_rows))
    return t, {**columns, "kl": kl}
