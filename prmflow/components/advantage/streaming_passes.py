"""The three streaming passes over the rollouts, each reading only the columns it needs.

1. group pass over (prompt_id, iteration, outcome_reward | step_rewards) only -> group stats;
   grpo_progress adds a progress pass over (outcome_reward, step_rewards): its step credit for the whole
   input, computed once (progress.py), and the PRM's step AUC on this batch, which gates its weight;
2. whitening pass, only when whitening: mean/std of the advantages over all written tokens;
3. write pass: token rewards, advantages, returns, kl -> schema.DatasetWriter (atomic: nothing
   appears at the output unless every row was computed), reading one batch ahead and writing one
   behind on threads (parquet_io).
Memory: a few batches in flight plus 4 bytes per input row (its group) and a few numbers per group.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..data import io, parquet_io, schema
from ...errors import DataError
from .batch import check_not_null, compute_batch, describe_row, finish_batch, flat_values
from .config import Plan, recorded
from .estimators import Moments, group_moments, merge_group_moments
from .progress import prefix_keys, process_credit, prompt_ranks
from .token_rewards import STEPLESS_SCORE, clip_rewards, step_contributions


def check_columns_exist(ds: schema.Dataset, plan: Plan) -> None:
    """Fail before reading any data when a file lacks a needed column.

    A column that is present but null (what the writer stores for a column it was not given) is
    caught in the first batch that holds it, with the same message.
    """
    for path in ds.files:
        names = set(pq.read_schema(path).names)
        for name in plan.needs:
            if name not in names:
                raise DataError(f"{plan.where}: '{path}' has no '{name}' column, but {plan.needs[name]}.")


def _validated(ds: schema.Dataset, plan: Plan, columns: list[str] | None) -> Iterator[pa.Table]:
    """Validated batches of `columns` (all when None), read one batch ahead on a thread."""
    return parquet_io.read_ahead(ds.iter_batches(plan.cfg.batch_rows, columns))


# --- pass 1: groups -------------------------------------------------------------------------------

@dataclass
class Groups:
    """Every input row's group and the statistics of each group's signal. G groups, R rows."""

    codes: np.ndarray
    """(R,) int32 group of each input row, in reading order."""
    keys: list[tuple[int, str]]
    """(G,) (iteration, prompt_id) of each group."""
    n: np.ndarray
    """(G,) samples per group."""
    stats: dict[str, np.ndarray]
    """(G,) each: estimators.group_moments of the group signal."""
    zero_variance: np.ndarray
    """(G,) bool: >= 2 samples and every signal value equal."""
    keep: np.ndarray
    """(G,) bool: the group's rows are written."""
    weight: np.ndarray
    """(G,) advantage multiplier."""
    process: "Process | None" = None
    """grpo_progress: the progress pass's result."""

    def rows(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Per-row (count,) views of the group statistics for input rows start .. start+count-1."""
        g = self.codes[start:start + count]
        out = {"group_n": self.n[g].astype(np.float64), "group_mean": self.stats["mean"][g],
               "group_std": self.stats["std"][g], "group_sum": self.stats["sum"][g],
               "keep": self.keep[g], "weight": self.weight[g]}
        if self.process is not None:
            out["process_weight"] = self.process.weight
            out["boundary_lag"] = self.process.boundary_lag
            first, last = self.process.step_offsets[start], self.process.step_offsets[start + count]
            out["process_progress"] = self.process.progress[first:last]
            out["process_values"] = self.process.credit[first:last]
        return out


def _group_key(t: pa.Table) -> pa.ChunkedArray:
    return pc.binary_join_element_wise(pc.cast(t["iteration"], pa.string()), t["prompt_id"], "\x1f")


def group_pass(ds: schema.Dataset, plan: Plan) -> Groups:
    """Read only the group key and reward columns; compute each group's signal statistics.

    Each batch contributes its share of every group's moments; the shares are merged once the
    batches' group dictionaries are unified. Memory: 4 bytes per row plus a few numbers per group.
    """
    cfg = plan.cfg
    column = plan.signal_columns[0]
    cols = ["prompt_id", "sample_idx", "iteration", column]
    keys, shares = [], []
    for t in ds.iter_batches(max(cfg.batch_rows, 1 << 16), cols, validate_rows=False):
        for name in ("prompt_id", "iteration"):
            if t[name].null_count:
                raise DataError(f"{plan.where}: required column '{name}' is null in some rows.")
        check_not_null(t, plan, cols)
        key = pc.dictionary_encode(_group_key(t)).combine_chunks()  # batch-local group codes
        if plan.outcome:  # one signal value per row
            counts = np.ones(t.num_rows, dtype=np.int64)
            values = t[column].to_numpy().astype(np.float64)
        else:  # every step of every row
            counts = pc.list_value_length(t[column]).to_numpy(zero_copy_only=False).astype(np.int64)
            values = flat_values(t, column).astype(np.float64)
        _check_finite(t, column, values, counts, plan)
        values = clip_rewards(values, cfg.reward_clip) if plan.outcome else \
            step_contributions(values, counts, cfg.step_reward_mode, cfg.reward_clip)
        local = key.indices.to_numpy(zero_copy_only=False)
        codes = np.repeat(local, counts)
        if plan.est.signal == "steps":  # a response with no step is one step scored STEPLESS_SCORE (rewards.make_steps)
            codes = np.concatenate([codes, local[counts == 0]])
            values = np.concatenate([values, np.full(int((counts == 0).sum()), STEPLESS_SCORE)])
        shares.append(group_moments(codes, values, len(key.dictionary)))
        keys.append(key)
    if not keys:
        raise DataError(f"{plan.where} holds no rows.")
    unified = pa.chunked_array(keys).unify_dictionaries()
    codes = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in unified.chunks]).astype(np.int32)
    share_codes = []  # the global group of each batch-local group
    for key, chunk in zip(keys, unified.chunks):
        to_global = np.empty(len(key.dictionary), dtype=np.int64)
        to_global[key.indices.to_numpy(zero_copy_only=False)] = chunk.indices.to_numpy(zero_copy_only=False)
        share_codes.append(to_global)
    dictionary = unified.chunk(0).dictionary.to_pylist()
    n_groups = len(dictionary)
    stats = merge_group_moments(np.concatenate(share_codes),
                                {k: np.concatenate([m[k] for m in shares]) for k in shares[0]}, n_groups)
    n = np.bincount(codes, minlength=n_groups)
    group_keys = [(int(k.split("\x1f", 1)[0]), k.split("\x1f", 1)[1]) for k in dictionary]
    _check_group_sizes(n, group_keys, plan)
    zero_var = stats["equal"] & (n >= 2)
    keep = ~zero_var if cfg.zero_variance == "drop" else np.ones(n_groups, bool)
    weight = np.where(zero_var & (cfg.zero_variance == "downweight"), cfg.zero_variance_weight, 1.0)
    if not keep.any():
        raise DataError(f"{plan.where}: all {n_groups} groups have equal rewards, so zero_variance=drop would "
                        f"write nothing. Set zero_variance=keep or downweight, or sample more responses per prompt.")
    return Groups(codes, group_keys, n, stats, zero_var, keep, weight)


def _check_finite(t: pa.Table, column: str, values: np.ndarray, counts: np.ndarray, plan: Plan) -> None:
    """The group statistics would be NaN: fail here, naming the row (the write pass would too, later)."""
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.repeat(np.arange(t.num_rows), counts)[np.flatnonzero(bad)[0]])
        raise DataError(f"{plan.where}: column '{column}' holds NaN or inf for {describe_row(t, i)}.")


def _check_group_sizes(n: np.ndarray, keys: list[tuple[int, str]], plan: Plan) -> None:
    need = plan.est.min_group_size
    small = np.flatnonzero(n < need)
    if len(small):
        it, pid = keys[small[0]]
        raise DataError(
            f"{plan.where}: prompt_id={pid!r} (iteration {it}) has {n[small[0]]} sample(s) (column 'prompt_id'), "
            f"but estimator={plan.est.name} needs at least {need} per group; {len(small)} of {len(n)} groups are "
            f"that small. Sample at least {need} responses per prompt in the rollout stage, or use an estimator "
            f"that works on single samples (gae, reinforce).")


# --- pass 1b (grpo_progress): the process advantage's scale and its evidence gate ---------------------

@dataclass
class Process:
    """What grpo_progress needs besides the group statistics: its step credit for the whole input, computed
    once (progress.process_credit) and sliced per batch by Groups.rows."""

    progress: np.ndarray
    """(S,) every step's progress d_k (its token reward), rows in reading order."""
    credit: np.ndarray
    """(S,) every step's process term before the weight."""
    step_offsets: np.ndarray
    """(R+1,) where each input row's steps start in progress and credit."""
    step_auc: float
    """The PRM's step AUC on this batch: its scores of every step but the last (the last is replaced by
    the outcome) against their response's outcome (>= 0.5 counts as a success); NaN without both kinds."""
    weight: float
    """process_weight after the gate (0 when step_auc is NaN or below process_auc_min)."""
    steps: int
    """Steps whose score entered step_auc."""
    spread: float | None = None
    """process_calibration=isotonic: the mean range of the cross-fitted maps; None: off."""
    boundary_lag: int = 1
    """Tokens the step separator can span (`separator_bytes`): the baseline credit's step boundary lag."""
    label_auc: float | None = None
    """calibration_labels=shared_prefix: the PRM's step AUC against the shared-prefix labels (progress.ProcessCredit)."""
    labelled: float | None = None
    """calibration_labels=shared_prefix: the share of intermediate prefixes in groups with a success."""


def gate(auc: float, weight: float, auc_min: float, auc_full: float) -> float:
    """The process weight the evidence allows: 0 below auc_min (or without evidence), weight from
    auc_full on, linear in between."""
    if not np.isfinite(auc) or auc < auc_min:
        return 0.0
    if auc >= auc_full:
        return weight
    return weight * (auc - auc_min) / (auc_full - auc_min)


def separator_bytes(ds: schema.Dataset) -> int:
    """The UTF-8 bytes of the rollouts' step_separator (the longest over the input's shards) as their manifests
    record it: the most tokens a separator can span, each token holding at least one byte. A shard that does not
    record it (plain Parquet) counts as the shared default, a newline: 1."""
    seps = [((m or {}).get("config") or {}).get("step_separator") for m in ds.manifests]
    return max([len(x.encode()) for x in seps if isinstance(x, str) and x] or [1])


def progress_pass(ds: schema.Dataset, plan: Plan, groups: Groups) -> Process:
    """Read (outcome_reward, step_rewards) of the whole input and compute grpo_progress's step credit once
    (progress.process_credit: the PRM's step AUC against the outcomes, with process_calibration=isotonic the
    cross-fitted map of its scores, every step's progress and process term); gate the weight by the AUC.
    Memory: 3 numbers per row and 4 per scored step, the whole input's at once (the fit needs every score)."""
    cfg = plan.cfg
    group_of, outcome_of, steps_of, values_of, keys_of = [], [], [], [], []
    shared = cfg.calibration_labels == "shared_prefix"  # the prefixes' token ids say which responses share them
    columns = ["outcome_reward", "step_rewards",
               *(["prompt_id", "sample_idx", "iteration", "response_ids", "step_ends"] if shared else [])]
    start = 0
    # with the prefixes read, their rows are checked here (step_ends as long as step_rewards, inside the response):
    # the keys must line up with the scores before any label is made
    for t in ds.iter_batches(max(cfg.batch_rows, 1 << 16), columns, validate_rows=shared):
        group_of.append(groups.codes[start:start + t.num_rows])
        start += t.num_rows
        if shared:
            keys_of.append(prefix_keys(t["response_ids"].to_pylist(), t["step_ends"].to_pylist(), group_of[-1]))
        steps_of.append(pc.list_value_length(t["step_rewards"]).fill_null(0).to_numpy(zero_copy_only=False)
                        .astype(np.int64))
        values_of.append(flat_values(t, "step_rewards").astype(np.float64))
        outcome_of.append(clip_rewards(t["outcome_reward"].to_numpy().astype(np.float64), cfg.reward_clip))
    g, outcome, counts = np.concatenate(group_of), np.concatenate(outcome_of), np.concatenate(steps_of)
    prompts = None
    if cfg.process_calibration == "isotonic":
        prompts = prompt_ranks([pid for _, pid in groups.keys])[g]
    pc_ = process_credit(np.concatenate(values_of), counts, outcome, g, groups.stats["mean"][g], prompts,
                         cfg.process_credit, cfg.norm_eps, np.concatenate(keys_of) if shared else None)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    weight = gate(pc_.step_auc, cfg.process_weight, cfg.process_auc_min, cfg.process_auc_full)
    return Process(pc_.progress, pc_.credit, offsets, pc_.step_auc, weight, pc_.steps, pc_.spread,
                   separator_bytes(ds), pc_.label_auc, pc_.labelled)


# --- pass 2 (optional): whitening statistics ------------------------------------------------------------

def whitening_pass(ds: schema.Dataset, plan: Plan, groups: Groups) -> Moments:
    """Mean and std of the estimator's advantages over every token that will be written."""
    moments = Moments()
    start = 0
    with contextlib.closing(_validated(ds, plan, plan.compute_columns)) as batches:
        for t in batches:
            rows = groups.rows(start, t.num_rows)
            start += t.num_rows
            res = compute_batch(t, rows, plan)
            keep = res.layout.broadcast(rows["keep"])
            moments.add(res.advantages if keep.all() else res.advantages[keep])
    return moments


# --- pass 3: write -------------------------------------------------------------------------------

def generation_budget(ds: schema.Dataset) -> int | None:
    """The rollouts' generation budget (sampling.max_new_tokens, the largest over the input's shards) as their
    manifests record it, passed on in the advantages' manifest for ppo's Dr. GRPO constant; None when a shard
    does not record it (plain Parquet from elsewhere)."""
    budgets = [((m or {}).get("config") or {}).get("sampling", {}).get("max_new_tokens") for m in ds.manifests]
    if not budgets or not all(isinstance(b, int) and b > 0 for b in budgets):
        return None
    return max(budgets)


def write_pass(ds: schema.Dataset, plan: Plan, groups: Groups, whitening: Moments | None) -> dict:
    """Compute and write every batch; return row counts and Moments of the written columns."""
    cfg = plan.cfg
    moments = {name: Moments() for name in ("advantages", "returns", "kl", "token_rewards")}
    rows_in = rows_out = 0
    writer = schema.DatasetWriter(cfg.output, "advantages", config=recorded(cfg),
                                  parents=[str(d) for d in ds.dirs], overwrite=cfg.overwrite,
                                  extra={"kl_coef_used": plan.beta, "inputs": io.fingerprint(ds.dirs),
                                         "max_new_tokens": generation_budget(ds)})
    # inputs were validated on read and finish_batch checks the new columns: the writer skips re-validating
    write_validated = functools.partial(writer.write, validated=True)
    with writer, parquet_io.write_behind(write_validated) as write, \
            contextlib.closing(_validated(ds, plan, None)) as batches:
        for t in batches:
            rows = groups.rows(rows_in, t.num_rows)
            rows_in += t.num_rows
            res = compute_batch(t, rows, plan)
            out, written = finish_batch(t, res, rows, plan, whitening)
            if out.num_rows:
                write(out)
            rows_out += out.num_rows
            for name, m in moments.items():
                if written[name] is not None:
                    m.add(written[name])
    if rows_in != len(groups.codes):
        raise DataError(f"{plan.where} changed while it was read ({len(groups.codes)} then {rows_in} rows).")
    return {"rows_out": rows_out, "tokens_out": moments["advantages"].n, **moments}

