"""Advantage stage: rollouts Parquet in, advantages Parquet out, on CPU with no model in memory.

    prmflow advantage --input ROLLOUTS_DIR --output ADV_DIR --iteration K \\
        [--estimator grpo_process] [--gamma 1.0] [--lam 0.95] [--kl_coef 0.05 | --kl_state PPO_DIR] \\
        [--step_reward_mode raw] [--whiten true] [--zero_variance drop]

The config and its validation are in config.py. Algorithmic choices:
- Token reward r_t = -beta*kl_t + step reward at each step end + outcome reward at the last token
  (token_rewards.py); the KL term is k1, k2 or k3 of old_logprobs vs ref_logprobs, beta is kl_coef or
  the PPO stage's adaptive value read from kl_state. Step rewards enter raw (PRM probability),
  centered (minus 0.5, a fixed point, not a group mean) or min-form (only the worst step counts).
- Estimators are small functions registered by name in estimators.ESTIMATORS: gae, reinforce,
  reinforce_baseline, grpo, dr_grpo, rloo, grpo_process, grpo_progress.
- grpo_progress (step_reward_mode=progress): outcome GRPO plus w times a process advantage, the
  steps' progress Phi_k - Phi_{k-1} (the last Phi is the outcome) centered within each response and
  scaled to unit RMS over the input, shrunk never to flip the outcome advantage's sign nor to exceed
  PROCESS_BOUND x its size; w = process_weight gated by the PRM's step AUC on this batch (passes.gate).
  process_credit=baseline instead adds w(start_{-i} - Phi_j), j the last step whose separator lies wholly
  before the token: the PRM's value of the prefix as a baseline, unbiased whatever the PRM says.
  process_calibration=isotonic reads Phi as the PRM's score mapped to this batch's mean outcome by
  an isotonic fit (rewards.fit_calibration): a PRM whose ranking the outcomes do not bear out gets a
  flat Phi and moves no credit by what it likes.
- A group is all rows with the same (iteration, prompt_id). Its statistics (mean, std with
  ddof=1, sum) are taken over the group signal: the outcome reward, or every step reward of the
  group when outcome rewards are off (grpo_process). A group of >= 2 samples whose signal is all
  equal is a zero-variance group: kept, dropped or down-weighted (zero_variance).
- Streaming in passes over the input (streaming_passes.py), each batch vectorized over a flat ragged layout
  (batch.py: no padding, no Python loop over samples or tokens; discounted sums are one scipy
  lfilter pass):
  1. group pass over (prompt_id, iteration, outcome_reward | step_rewards) only -> group stats;
  2. whitening pass, only when whitening: mean/std of the advantages over all written tokens;
  3. write pass: token rewards, advantages, returns, kl -> DatasetWriter (atomic: nothing appears
     at --output unless every row was computed), reading one batch ahead and writing one behind
     on threads (data/parquet_io.py); Parquet dictionary encoding only for the columns that
     repeat within a group.
  Memory: a few batches in flight (read ahead, computing, being written) plus 4 bytes per input
  row (its group) and a few numbers per group.
- `returns` are the critic targets A + V for gae and the discounted returns-to-go of the token
  rewards otherwise, always before whitening, down-weighting or clamping.
"""

from __future__ import annotations

import logging
import time

from .. import config as config_lib
from ..data import io, schema
from ...tracking import start_stage_run
from .config import Config, recorded, resolve
from .streaming_passes import check_columns_exist, group_pass, progress_pass, whitening_pass, write_pass

log = logging.getLogger(__name__)


def run(cfg: Config) -> dict:
    """Read the rollouts at cfg.input, write the advantages to cfg.output; return summary metrics."""
    started = time.perf_counter()
    plan = resolve(cfg)
    ds = schema.open_dataset(cfg.input, "rollouts")
    # a re-run (retried pipeline step, restarted pod) whose result is already committed does nothing
    done = io.finished_output("advantage", cfg.output, recorded(cfg), cfg.overwrite,
                              inputs=io.input_fingerprints(ds.dirs), kl_coef_used=plan.beta)
    if done is not None:
        return {"advantage/rows_out": done["rows"]}
    check_columns_exist(ds, plan)
    with start_stage_run(cfg.tracking, stage="advantage", params=config_lib.flat_dict(cfg.filled()),
                         iteration=cfg.iteration) as tracker:
        groups = group_pass(ds, plan)
        if plan.est.process:
            groups.process = progress_pass(ds, plan, groups)
        whitening = whitening_pass(ds, plan, groups) if plan.whiten else None
        out = write_pass(ds, plan, groups, whitening)
        seconds = time.perf_counter() - started
        adv, ret, kl = out["advantages"], out["returns"], out["kl"]
        n_groups = len(groups.n)
        summary = {
            "advantage/advantage_mean": adv.mean,
            "advantage/advantage_std": adv.std,
            "advantage/return_mean": ret.mean,
            "advantage/token_reward_mean": out["token_rewards"].mean,
            "advantage/kl_coef": plan.beta,
            "advantage/zero_variance_groups": float(groups.zero_variance.sum()) / n_groups,
            "advantage/zero_variance_group_count": int(groups.zero_variance.sum()),
            "advantage/groups": n_groups,
            "advantage/rows_in": len(groups.codes),
            "advantage/rows_out": out["rows_out"],
            "advantage/tokens_out": out["tokens_out"],
            "perf/tokens_per_s": out["tokens_out"] / seconds,
            "perf/seconds": seconds,
        }
        if groups.process is not None:  # the evidence gate, every iteration (NaN AUC: one outcome only)
            summary.update({"advantage/prm_step_auc": groups.process.step_auc,
                            "advantage/process_weight": groups.process.weight,
                            "train/prm_scored_steps": groups.process.steps})
            if groups.process.spread is not None:  # how far Phi can move once mapped to the outcomes
                summary["advantage/prm_calibrated_spread"] = groups.process.spread
            if groups.process.label_auc is not None:  # calibration_labels=shared_prefix: the evidence it fits on
                summary["advantage/prm_label_auc"] = groups.process.label_auc
                summary["advantage/labelled_share"] = groups.process.labelled
        if kl.n:  # no row had both old_logprobs and ref_logprobs: no KL to report
            summary["advantage/kl_mean"] = kl.mean
        tracker.log_metrics(summary, step=cfg.iteration)
    log.info("advantage: %d rows -> %s (%d dropped, %d/%d zero-variance groups), %.0f tokens/s",
             summary["advantage/rows_in"], cfg.output, summary["advantage/rows_in"] - summary["advantage/rows_out"],
             summary["advantage/zero_variance_group_count"], n_groups, summary["perf/tokens_per_s"])
    return summary
