"""Advantage stage: rollouts Parquet in, advantages Parquet out, on CPU with no model in memory.

    prmflow advantage --input ROLLOUTS_DIR --output ADV_DIR --iteration K \\
        [--estimator grpo_process] [--gamma 1.0] [--lam 0.95] [--kl_coef 0.05 | --kl_state PPO_DIR] \\
        [--step_reward_mode raw] [--whiten true] [--zero_variance drop]

Algorithmic choices:
- Token reward r_t = -beta*kl_t + step reward at each step end + outcome reward at the last token
  (rewards.py); the KL term is k1, k2 or k3 of old_logprobs vs ref_logprobs, beta is kl_coef or
  the PPO stage's adaptive value read from kl_state. Step rewards enter raw (PRM probability),
  centered (minus 0.5, a fixed point, not a group mean) or min-form (only the worst step counts).
- Estimators are small functions registered by name in estimators.ESTIMATORS: gae, reinforce,
  reinforce_baseline, grpo, dr_grpo, rloo, grpo_process.
- A group is all rows with the same (iteration, prompt_id). Its statistics (mean, std with
  ddof=1, sum) are taken over the group signal: the outcome reward, or every step reward of the
  group when outcome rewards are off (grpo_process). A group of >= 2 samples whose signal is all
  equal is a zero-variance group: kept, dropped or down-weighted (zero_variance).
- Streaming in passes over the input, each batch vectorized over a flat ragged layout (no padding,
  no Python loop over samples or tokens; discounted sums are one scipy lfilter pass):
  1. group pass over (prompt_id, iteration, outcome_reward | step_rewards) only -> group stats;
  2. whitening pass, only when whitening: mean/std of the advantages over all written tokens;
  3. write pass: token rewards, advantages, returns, kl -> DatasetWriter (atomic: nothing appears
     at --output unless every row was computed), reading one batch ahead and writing one behind
     on threads; Parquet dictionary encoding only for the columns that repeat within a group.
  Memory: a few batches in flight (read ahead, computing, being written) plus 4 bytes per input
  row (its group) and a few numbers per group.
- `returns` are the critic targets A + V for gae and the discounted returns-to-go of the token
  rewards otherwise, always before whitening, down-weighting or clamping.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..common import config as config_lib
from ..common import io, schema
from ..common.errors import ConfigError, DataError
from ..common.tracking import TrackingConfig, start_stage_run
from .estimators import ESTIMATORS, Estimator, EstimatorInput, Moments, Ragged, group_moments, \
    merge_group_moments
from .rewards import KL_ESTIMATORS, STEP_REWARD_MODES, clip_rewards, kl_per_token, make_steps, \
    step_contributions, token_rewards

log = logging.getLogger(__name__)


@dataclass
class Config:
    input: str = ""
    """Scored rollouts directory (or a parent of rollout shard directories) to read."""
    output: str = ""
    """Advantages directory to create; written to a temporary sibling and renamed when complete."""
    iteration: int = 0
    """RL iteration k: tags the tracking run and is the step of its metrics."""
    estimator: str = "grpo_process"
    """gae, reinforce, reinforce_baseline, grpo, dr_grpo, rloo or grpo_process (table in README)."""
    gamma: float = 1.0
    """Discount per token in [0, 1]; 1 is usual for responses whose reward comes at the end."""
    lam: float = 0.95
    """GAE lambda in [0, 1] (gae only): lower leans on the critic, less variance but more bias."""
    kl_coef: float = 0.0
    """beta of the per-token KL penalty in the token reward; 0 = off, then ref_logprobs is not needed."""
    kl_state: str = ""
    """The ppo stage's KL-controller state (its output dir or kl_state.json); its kl_coef overrides kl_coef."""
    kl_estimator: str = "k1"
    """Per-token KL with x = old_logprob - ref_logprob: k1 = x, k2 = x^2/2, k3 = exp(-x) - 1 + x."""
    outcome_reward: bool | None = None
    """Add outcome_reward at the last response token. Empty: on, except for grpo_process."""
    step_rewards: bool | None = None
    """Add each PRM step reward at its step's last token. Empty: on, except for grpo, dr_grpo, rloo."""
    step_reward_mode: str = "raw"
    """How a step reward enters: raw (PRM probability), centered (minus 0.5), min (worst step only)."""
    reward_clip: float = 0.0
    """Clip outcome_reward and each step's contribution to [-reward_clip, reward_clip]; 0 = off."""
    whiten: bool | None = None
    """(A - mean) / (std + norm_eps) over all written tokens; costs one more read. Empty: reinforce_baseline only."""
    adv_clip: float = 0.0
    """Clamp the final advantages to [-adv_clip, adv_clip] (after whitening); 0 = off."""
    norm_eps: float = 1e-6
    """Added to every std divided by (group normalization, whitening), so equal rewards give 0."""
    zero_variance: Literal["keep", "drop", "downweight"] = "keep"
    """Groups (>= 2 samples) with all rewards equal: keep, drop their rows (less PPO work), or downweight."""
    zero_variance_weight: float = 0.1
    """Advantage multiplier in [0, 1] for zero-variance groups when zero_variance=downweight."""
    batch_size: int = 512
    """Rows per batch and per output row group; peak memory grows with batch_size x response length."""
    overwrite: bool = False
    """Replace an existing output made from another config or input; off: that is an error. One made from this config and input is kept (nothing to do)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow run settings (common/tracking.py)."""

    def __post_init__(self) -> None:
        _check_choice("estimator", self.estimator, ESTIMATORS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("step_reward_mode", self.step_reward_mode, STEP_REWARD_MODES)
        _check_choice("zero_variance", self.zero_variance, ("keep", "drop", "downweight"))
        for key, lo, hi in (("gamma", 0, 1), ("lam", 0, 1), ("zero_variance_weight", 0, 1)):
            if not lo <= getattr(self, key) <= hi:
                raise ConfigError(f"{key}={getattr(self, key)} is outside [{lo}, {hi}]; set it in that range.")
        for key in ("kl_coef", "reward_clip", "adv_clip"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0 (0 turns it off).")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps} must be > 0, or equal-reward groups divide by zero.")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be >= 1.")
        # Empty switches stay None here and are resolved in `switches`: storing the resolved value
        # would pin it when config.load rebuilds the config with command-line overrides.
        _check_reward_switches(self, ESTIMATORS[self.estimator])

    def switches(self) -> tuple[bool, bool, bool]:
        """(outcome_reward, step_rewards, whiten) with empty values filled in from the estimator."""
        est = ESTIMATORS[self.estimator]
        outcome = est.signal != "steps" if self.outcome_reward is None else self.outcome_reward
        steps = (est.uses_token_rewards or est.signal == "steps") if self.step_rewards is None else self.step_rewards
        whiten = est.whiten if self.whiten is None else self.whiten
        return outcome, steps, whiten


def _check_choice(key: str, value: str, known) -> None:
    if value not in known:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(known)}; set {key} to one of those.")


def _check_reward_switches(cfg: Config, est: Estimator) -> None:
    """Reject reward settings the chosen estimator would silently ignore or cannot work with."""
    name = f"estimator={est.name}"
    outcome, steps, _ = cfg.switches()
    if est.signal == "outcome" and not outcome:
        raise ConfigError(f"{name} is defined on the outcome reward; set outcome_reward=true, or use "
                          f"estimator=grpo_process to learn from step rewards alone.")
    if est.signal == "steps" and (outcome or not steps):
        raise ConfigError(f"{name} normalizes step rewards only; set step_rewards=true and outcome_reward=false, "
                          f"or choose gae, reinforce or reinforce_baseline to mix outcome and step rewards.")
    if est.signal == "steps" and cfg.step_reward_mode != "raw":
        raise ConfigError(f"{name} normalizes step rewards within each group itself; step_reward_mode="
                          f"{cfg.step_reward_mode} would be undone or distorted. Set step_reward_mode=raw.")
    if not est.uses_token_rewards and steps and est.signal == "outcome":
        raise ConfigError(f"{name} uses one outcome reward per sample, so step_rewards=true would not change "
                          f"its advantages. Set step_rewards=false, or use step rewards with grpo_process, gae, "
                          f"reinforce or reinforce_baseline.")
    if not est.uses_token_rewards and (cfg.kl_coef > 0 or cfg.kl_state):
        raise ConfigError(f"{name} does not use token rewards, so a KL penalty (kl_coef/kl_state) would not change "
                          f"its advantages; GRPO-style training applies KL in the loss. Set kl_coef=0 and "
                          f"kl_state='', or choose gae, reinforce or reinforce_baseline.")
    if not outcome and not steps:
        raise ConfigError("outcome_reward=false and step_rewards=false leave no reward but the KL penalty; "
                          "turn at least one of them on.")


# --- what the data must hold --------------------------------------------------------------------

@dataclass
class Plan:
    """A config resolved against the run: the estimator, beta, and the columns each pass needs."""

    cfg: Config
    est: Estimator
    beta: float
    outcome: bool
    """Outcome rewards are on (resolved outcome_reward)."""
    steps: bool
    """Step rewards are on (resolved step_rewards)."""
    whiten: bool
    needs: dict[str, str]
    """column -> why it is needed and what to do if it is missing (for error messages)."""
    where: str

    @property
    def signal_columns(self) -> list[str]:
        return ["outcome_reward"] if self.outcome else ["step_rewards"]

    @property
    def compute_columns(self) -> list[str]:
        return list(dict.fromkeys(["prompt_id", "sample_idx", "iteration", "response_ids", *self.needs]))


def _resolve(cfg: Config) -> Plan:
    beta = _read_kl_state(cfg.kl_state) if cfg.kl_state else cfg.kl_coef
    est = ESTIMATORS[cfg.estimator]
    name = f"estimator={est.name}"
    outcome, steps, whiten = cfg.switches()
    needs = {}
    if outcome:
        fix = "or set outcome_reward=false" if est.signal != "outcome" else "or use estimator=grpo_process"
        needs["outcome_reward"] = f"outcome rewards are on for {name}. Score the final answers first, {fix}"
    if steps:
        fix = "or set step_rewards=false" if est.signal != "steps" else "or use an outcome estimator (grpo, rloo)"
        why = f"step rewards are on for {name}. Score the rollouts with the PRM first, {fix}"
        needs["step_rewards"] = needs["step_ends"] = why
    if est.needs_values:
        needs["values"] = (f"{name} needs a critic value per token. Score the rollouts with the critic, or choose "
                           f"an estimator without one (grpo, rloo, reinforce, reinforce_baseline, grpo_process)")
    if beta > 0:
        why = f"the KL penalty is on (beta={beta:g}). Re-score the rollouts, or set kl_coef=0 and kl_state=''"
        needs["old_logprobs"] = needs["ref_logprobs"] = why
    return Plan(cfg, est, beta, outcome, steps, whiten, needs, where=f"rollouts '{cfg.input}'")


def _read_kl_state(path: str) -> float:
    """beta from the ppo stage's KL-controller state: a file {"kl_coef": float, ...} or a ppo output
    directory holding kl_state.json (the format of ppo/kl_control.py)."""
    p = Path(path)
    if p.is_dir():
        p = p / "kl_state.json"
    if not p.is_file():
        raise ConfigError(f"kl_state '{p}' does not exist. Pass the previous iteration's ppo output (or its "
                          f"kl_state.json), or set kl_state='' to use kl_coef on the first iteration.")
    try:
        beta = float(json.loads(p.read_text())["kl_coef"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"kl_state '{p}' must be JSON like {{\"kl_coef\": 0.05}} ({e!r}).") from None
    if not (math.isfinite(beta) and beta >= 0):
        raise ConfigError(f"kl_state '{p}' holds kl_coef={beta}; it must be a finite number >= 0.")
    return beta


def _row(t: pa.Table, i: int) -> str:
    return (f"prompt_id={t['prompt_id'][i].as_py()!r}, sample_idx={t['sample_idx'][i].as_py()}, "
            f"iteration={t['iteration'][i].as_py()}")


def _check_not_null(t: pa.Table, plan: Plan, columns) -> None:
    """DataError naming the column, the first row and the config key, for nulls where values are needed."""
    for name in columns:
        col = t.column(name)
        if name in schema.REQUIRED or name not in plan.needs or not col.null_count:
            continue
        if col.null_count == t.num_rows:
            what = f"has no '{name}' column (null in every row, e.g. {_row(t, 0)})"
        else:
            i = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
            what = f"column '{name}' is null for {_row(t, i)}"
        raise DataError(f"{plan.where} {what}, but {plan.needs[name]}.")


def _check_columns_exist(ds: schema.Dataset, plan: Plan) -> None:
    """Fail before reading any data when a file lacks a needed column.

    A column that is present but null (what the writer stores for a column it was not given) is
    caught in the first batch that holds it, with the same message.
    """
    for path in ds.files:
        names = set(pq.read_schema(path).names)
        for name in plan.needs:
            if name not in names:
                raise DataError(f"{plan.where}: '{path}' has no '{name}' column, but {plan.needs[name]}.")


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

    def rows(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Per-row (count,) views of the group statistics for input rows start .. start+count-1."""
        g = self.codes[start:start + count]
        return {"group_n": self.n[g].astype(np.float64), "group_mean": self.stats["mean"][g],
                "group_std": self.stats["std"][g], "group_sum": self.stats["sum"][g],
                "keep": self.keep[g], "weight": self.weight[g]}


def _group_key(t: pa.Table) -> pa.ChunkedArray:
    return pc.binary_join_element_wise(pc.cast(t["iteration"], pa.string()), t["prompt_id"], "\x1f")


def _group_pass(ds: schema.Dataset, plan: Plan) -> Groups:
    """Read only the group key and reward columns; compute each group's signal statistics.

    Each batch contributes its share of every group's moments; the shares are merged once the
    batches' group dictionaries are unified. Memory: 4 bytes per row plus a few numbers per group.
    """
    cfg = plan.cfg
    column = plan.signal_columns[0]
    cols = ["prompt_id", "sample_idx", "iteration", column]
    keys, shares = [], []
    for t in read_batches(ds, max(cfg.batch_size, 1 << 16), cols, validate=False):
        for name in ("prompt_id", "iteration"):
            if t[name].null_count:
                raise DataError(f"{plan.where}: required column '{name}' is null in some rows.")
        _check_not_null(t, plan, cols)
        key = pc.dictionary_encode(_group_key(t)).combine_chunks()  # batch-local group codes
        if plan.outcome:  # one signal value per row
            counts = np.ones(t.num_rows, dtype=np.int64)
            values = t[column].to_numpy().astype(np.float64)
        else:  # every step of every row
            counts = pc.list_value_length(t[column]).to_numpy(zero_copy_only=False).astype(np.int64)
            values = _flat(t, column).astype(np.float64)
        _check_finite(t, column, values, counts, plan)
        values = clip_rewards(values, cfg.reward_clip) if plan.outcome else \
            step_contributions(values, counts, cfg.step_reward_mode, cfg.reward_clip)
        local = key.indices.to_numpy(zero_copy_only=False)
        shares.append(group_moments(np.repeat(local, counts), values, len(key.dictionary)))
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
        raise DataError(f"{plan.where}: column '{column}' holds NaN or inf for {_row(t, i)}.")


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


# --- per batch: token rewards and advantages ----------------------------------------------------------

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


def _flat(t: pa.Table, name: str) -> np.ndarray:
    """The list column `name` flattened: (N,) values of all rows end to end."""
    return pc.list_flatten(t[name]).to_numpy(zero_copy_only=False)


def _kl(t: pa.Table, plan: Plan) -> tuple[np.ndarray | None, np.ndarray]:
    """(N_kl,) per-token KL of rows having old_logprobs and ref_logprobs, and the (B,) mask of those rows."""
    rows = ~(pc.is_null(t["old_logprobs"]).to_numpy(zero_copy_only=False)
             | pc.is_null(t["ref_logprobs"]).to_numpy(zero_copy_only=False))
    if not rows.any():
        return None, rows
    sub = t if rows.all() else t.select(["old_logprobs", "ref_logprobs"]).filter(pa.array(rows))
    return kl_per_token(_flat(sub, "old_logprobs"), _flat(sub, "ref_logprobs"), plan.cfg.kl_estimator), rows


def compute_batch(t: pa.Table, group_rows: dict[str, np.ndarray], plan: Plan) -> BatchResult:
    """Token rewards, advantages and returns for one validated rollouts table."""
    cfg, est = plan.cfg, plan.est
    _check_not_null(t, plan, plan.needs)
    layout = Ragged.from_lengths(pc.list_value_length(t["response_ids"]).to_numpy(zero_copy_only=False))
    if plan.outcome and est.uses_token_rewards and not layout.nonempty.all():
        i = int(np.flatnonzero(~layout.nonempty)[0])
        raise DataError(f"{plan.where}: response_ids is empty for {_row(t, i)}, so the outcome reward has no "
                        f"token to go to. Drop empty responses in the rollout stage, or set outcome_reward=false.")
    kl, kl_rows = _kl(t, plan)
    steps = outcome = None
    if plan.steps:
        counts = pc.list_value_length(t["step_rewards"]).to_numpy(zero_copy_only=False).astype(np.int64)
        contrib = step_contributions(_flat(t, "step_rewards"), counts, cfg.step_reward_mode, cfg.reward_clip)
        steps = make_steps(layout, _flat(t, "step_ends").astype(np.int64), counts, contrib)
    if plan.outcome:
        outcome = clip_rewards(t["outcome_reward"].to_numpy().astype(np.float64), cfg.reward_clip)
    rewards = token_rewards(layout, kl if plan.beta > 0 else None, plan.beta, steps, outcome)
    values = _flat(t, "values").astype(np.float64) if est.needs_values else None
    inp = EstimatorInput(layout, rewards, cfg.gamma, cfg.lam, cfg.norm_eps, values=values, outcome=outcome,
                         steps=steps, **{k: v for k, v in group_rows.items() if k.startswith("group_")})
    advantages, returns = est.fn(inp)
    return BatchResult(layout, rewards, advantages, returns, kl, kl_rows)


# --- pass 2 (optional): whitening statistics ------------------------------------------------------------

def _whitening_pass(ds: schema.Dataset, plan: Plan, groups: Groups) -> Moments:
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


# --- pass 3: write ----------------------------------------------------------------------------------

def _list_column(offsets: np.ndarray, values: np.ndarray, name: str, t: pa.Table,
                 mask: np.ndarray | None = None) -> pa.Array:
    """A list<float32> column from (B+1,) int32 offsets and flat float64 values; non-finite is a DataError."""
    v32 = values.astype(np.float32)
    bad = ~np.isfinite(v32)
    if bad.any():
        row = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
        raise DataError(f"computing '{name}' overflowed float32 for {_row(t, row)}: check old_logprobs, "
                        f"ref_logprobs and values for extreme entries (kl_estimator=k3 grows like exp(ref - old)).")
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(v32), mask=None if mask is None else pa.array(mask))


def _finish_batch(t: pa.Table, res: BatchResult, rows: dict[str, np.ndarray], plan: Plan,
                  whitening: Moments | None) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Post-process the advantages (whiten, weight, clamp), drop rows, append the four new columns."""
    cfg = plan.cfg
    layout = res.layout
    adv = res.advantages
    if whitening is not None:
        adv = (adv - whitening.mean) / (whitening.std + cfg.norm_eps)
    if (rows["weight"] != 1.0).any():
        adv = adv * layout.broadcast(rows["weight"])
    if cfg.adv_clip > 0:
        adv = np.clip(adv, -cfg.adv_clip, cfg.adv_clip)
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


def _write_pass(ds: schema.Dataset, plan: Plan, groups: Groups, whitening: Moments | None) -> dict:
    """Compute and write every batch; return row counts and Moments of the written columns."""
    cfg = plan.cfg
    moments = {name: Moments() for name in ("advantages", "returns", "kl", "token_rewards")}
    rows_in = rows_out = 0
    meta = config_lib.to_dict(cfg)
    with schema.DatasetWriter(cfg.output, "advantages", config=meta, parents=[str(d) for d in ds.dirs],
                 overwrite=cfg.overwrite, extra={"kl_coef_used": plan.beta, "inputs": io.fingerprint(ds.dirs)}) as writer, \
            _write_behind(writer) as write, contextlib.closing(_validated(ds, plan, None)) as batches:
        for t in batches:
            rows = groups.rows(rows_in, t.num_rows)
            rows_in += t.num_rows
            res = compute_batch(t, rows, plan)
            out, written = _finish_batch(t, res, rows, plan, whitening)
            if out.num_rows:
                write(out)
            rows_out += out.num_rows
            for name, m in moments.items():
                if written[name] is not None:
                    m.add(written[name])
    if rows_in != len(groups.codes):
        raise DataError(f"{plan.where} changed while it was read ({len(groups.codes)} then {rows_in} rows).")
    return {"rows_out": rows_out, "tokens_out": moments["advantages"].n, **moments}


# --- run ---------------------------------------------------------------------------------------------

def run(cfg: Config) -> dict:
    """Read the rollouts at cfg.input, write the advantages to cfg.output; return summary metrics."""
    started = time.perf_counter()
    plan = _resolve(cfg)
    ds = schema.open_dataset(cfg.input, "rollouts")
    # a re-run (retried pipeline step, restarted pod) whose result is already committed does nothing
    done = io.completed_output(cfg.output, {"config": io.config_identity(config_lib.to_dict(cfg)),
                                            "inputs": io.fingerprint(ds.dirs), "kl_coef_used": plan.beta},
                               cfg.overwrite, "advantage")
    if done is not None:
        print(f"advantage: '{cfg.output}' is already complete for this config and input; nothing to do.")
        return {"train/rows_out": done["rows"]}
    _check_columns_exist(ds, plan)
    with start_stage_run(cfg.tracking, stage="advantage", params=config_lib.flat_dict(cfg),
                         iteration=cfg.iteration) as tracker:
        groups = _group_pass(ds, plan)
        whitening = _whitening_pass(ds, plan, groups) if plan.whiten else None
        out = _write_pass(ds, plan, groups, whitening)
        seconds = time.perf_counter() - started
        adv, ret, kl = out["advantages"], out["returns"], out["kl"]
        n_groups = len(groups.n)
        summary = {
            "train/advantage_mean": adv.mean,
            "train/advantage_std": adv.std,
            "train/return_mean": ret.mean,
            "train/token_reward_mean": out["token_rewards"].mean,
            "train/kl_coef": plan.beta,
            "train/zero_variance_groups": float(groups.zero_variance.sum()) / n_groups,
            "train/zero_variance_group_count": int(groups.zero_variance.sum()),
            "train/groups": n_groups,
            "train/rows_in": len(groups.codes),
            "train/rows_out": out["rows_out"],
            "train/tokens_out": out["tokens_out"],
            "perf/tokens_per_s": out["tokens_out"] / seconds,
            "perf/seconds": seconds,
        }
        if kl.n:  # no row had both old_logprobs and ref_logprobs: no KL to report
            summary["train/kl_mean"] = kl.mean
        tracker.log_metrics(summary, step=cfg.iteration)
    log.info("advantage: %d rows -> %s (%d dropped, %d/%d zero-variance groups), %.0f tokens/s",
             summary["train/rows_in"], cfg.output, summary["train/rows_in"] - summary["train/rows_out"],
             summary["train/zero_variance_group_count"], n_groups, summary["perf/tokens_per_s"])
    return summary


# --- streaming I/O (candidates for common/schema.py) ---------------------------------------------

def read_batches(ds: schema.Dataset, batch_size: int, columns: list[str] | None = None,
                 validate: bool = True) -> Iterator[pa.Table]:
    """Batches of `columns` of every shard (schema.Dataset.iter_batches; validate=False: raw columns)."""
    return ds.iter_batches(batch_size, columns, validate_rows=validate)


def _validated(ds: schema.Dataset, plan: Plan, columns: list[str] | None) -> Iterator[pa.Table]:
    """Validated batches of `columns` (all when None), read one batch ahead on a thread."""
    return _read_ahead(read_batches(ds, plan.cfg.batch_size, columns))


def _read_ahead(it: Iterator[pa.Table], depth: int = 1) -> Iterator[pa.Table]:
    """Yield from `it` while a thread reads, decompresses and validates the next batch.

    Arrow releases the GIL while decoding, so reading overlaps the computing and compressing of
    the batch before it: on 2 cores this is most of the gap to a bare read + write.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in it:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as e:  # handed to the consumer, which re-raises it
            q.put(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()


@contextlib.contextmanager
def _write_behind(writer: schema.DatasetWriter) -> Iterator:
    """Yield write(table): hands the table to a thread that writes it while the next batch is computed.

    Parquet encoding and compression release the GIL, so on 2 cores writing batch i overlaps
    reading batch i+2 and computing batch i+1. Inputs were validated on read and the new columns
    are checked in _list_column, so the writer skips re-validation. A write error surfaces at the
    next write() or at the end of the block; on any error the thread is stopped before the
    DatasetWriter removes its temporary directory.
    """
    tables: queue.Queue = queue.Queue(maxsize=1)
    errors: list[BaseException] = []
    cancelled = threading.Event()

    def work():
        while (t := tables.get()) is not None:
            if not errors and not cancelled.is_set():
                try:
                    writer.write(t, validated=True)
                except BaseException as e:  # re-raised in the caller's thread
                    errors.append(e)

    def write(t: pa.Table) -> None:
        if errors:
            raise errors[0]
        tables.put(t)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield write
    except BaseException:
        cancelled.set()  # the output is abandoned: skip what is still queued
        raise
    finally:
        tables.put(None)
        thread.join()
    if errors:
        raise errors[0]
