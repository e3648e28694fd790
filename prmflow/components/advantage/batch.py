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


# --- environment tokens: the estimators see the policy's tokens only ------------------------------

@dataclass
class PolicyTokens:
    """Where a batch's policy tokens sit among all its response tokens (multi-turn episodes)."""

    full: Ragged
    """The rows' whole responses (policy and environment tokens)."""
    policy: np.ndarray
    """(N_full,) bool: response token is the policy's."""


def policy_tokens(t: pa.Table) -> PolicyTokens | None:
    """The batch's policy tokens when some response token is the environment's (policy_mask 0), else None:
    single-turn rows and version-1 files (no policy_mask) are every token the policy's."""
    if "policy_mask" not in t.column_names or t["policy_mask"].null_count == t.num_rows:
        return None
    full = Ragged.from_lengths(pc.list_value_length(t["response_ids"]).to_numpy(zero_copy_only=False))
    has = ~pc.is_null(t["policy_mask"]).to_numpy(zero_copy_only=False)
    policy = np.ones(full.n_tokens, bool)
    policy[full.broadcast(has)] = flat_values(t, "policy_mask") != 0
    return None if policy.all() else PolicyTokens(full, policy)


def compact(t: pa.Table, where: PolicyTokens) -> pa.Table:
    """`t` with every per-token column cut to the policy's tokens and step_ends re-indexed into them.

    The estimators then run over the policy's tokens as if the environment's were never there: an
    environment token gets no reward, no KL, and does not sit between two policy tokens in a discounted sum
    (the observation is not an action; veRL's agent loop and TRL mask it the same way). `scatter` puts the
    results back, 0 at environment tokens. step_ends lie on policy tokens (schema.validate)."""
    full, policy = where.full, where.policy
    row_of = np.repeat(np.arange(t.num_rows), full.lengths)
    lengths = np.bincount(row_of[policy], minlength=t.num_rows)
    for name in (*schema.PER_TOKEN_COLUMNS, "response_ids"):
        if name not in t.column_names or t[name].null_count == t.num_rows:
            continue
        col = t[name].combine_chunks()
        present = ~pc.is_null(col).to_numpy(zero_copy_only=False)
        keep = policy[full.broadcast(present)]
        offsets = np.zeros(t.num_rows + 1, np.int32)
        np.cumsum(np.where(present, lengths, 0), out=offsets[1:])
        values = pc.list_flatten(col).to_numpy(zero_copy_only=False)[keep]
        arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=col.type.value_type),
                                       mask=None if present.all() else pa.array(~present))
        t = t.set_column(t.schema.get_field_index(name), name, arr)
    if t["step_ends"].null_count < t.num_rows:
        ends = t["step_ends"].combine_chunks()
        n_ends = pc.list_value_length(ends).fill_null(0).to_numpy(zero_copy_only=False)
        end_row = np.repeat(np.arange(t.num_rows), n_ends)
        rank = np.cumsum(policy) - 1  # (N_full,) index of each token among the policy tokens of the batch
        new_offsets = np.zeros(t.num_rows + 1, np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        flat = pc.list_flatten(ends).to_numpy(zero_copy_only=False).astype(np.int64)
        remapped = rank[full.offsets[:-1][end_row] + flat] - new_offsets[:-1][end_row]
        end_offsets = np.zeros(t.num_rows + 1, np.int32)
        np.cumsum(n_ends, out=end_offsets[1:])
        arr = pa.ListArray.from_arrays(pa.array(end_offsets), pa.array(remapped.astype(np.int32)),
                                       mask=pc.is_null(ends) if ends.null_count else None)
        t = t.set_column(t.schema.get_field_index("step_ends"), "step_ends", arr)
    return t


def scatter(values: np.ndarray, policy: np.ndarray) -> np.ndarray:
    """(N_policy,) values -> (N_full,) with 0 at the environment's tokens."""
    out = np.zeros(len(policy), values.dtype)
    out[policy] = values
    return out


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
    policy: PolicyTokens | None = None
    """Multi-turn rows: where the (compact, policy-only) columns above go among all response tokens."""


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
    """Token rewards, advantages and returns for one validated rollouts table, over the policy's tokens only
    (`compact`: environment tokens carry nothing)."""
    cfg, est = plan.cfg, plan.est
    check_not_null(t, plan, plan.needs)
    where = policy_tokens(t)
    if where is not None:
        t = compact(t, where)
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
    return BatchResult(layout, rewards, advantages, returns, kl, kl_rows, where)


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
    written = {**columns, "kl": kl}  # the policy's tokens: what the metrics average
    if res.policy is not None:  # back to every response token, 0 at the environment's
        full, policy = res.policy.full, res.policy.policy
        if not keep.all():
            policy = policy[full.broadcast(keep)]
            full = Ragged.from_lengths(full.lengths[keep])
        columns = {k: scatter(v, policy) for k, v in columns.items()}
        if kl is not None:
            kl = scatter(kl, policy[full.broadcast(kl_rows)])
        layout = full
    offsets = layout.offsets.astype(np.int32)
    for name, values in columns.items():
        t = t.append_column(name, _list_column(offsets, values, name, t))
    if kl is None:
        t = t.append_column("kl", pa.nulls(t.num_rows, pa.list_(pa.float32())))
    else:
        kl_offsets = np.zeros(t.num_rows + 1, dtype=np.int32)
        np.cumsum(layout.lengths * kl_rows, out=kl_offsets[1:])
        t = t.append_column("kl", _list_column(kl_offsets, kl, "kl", t, mask=None if kl_rows.all() else ~kl_rows))
    return t, written
