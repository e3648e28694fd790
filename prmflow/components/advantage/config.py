"""The advantage stage's config (the CLI and README are generated from its field docstrings) and the
plan it resolves to: the estimator, beta, and which rollout columns each pass needs and why.

Bad combinations are rejected in `Config.__post_init__` with a message naming the key to change;
`resolve` reads the KL-controller state (training/kl_state.py, the one reader of kl_state.json) and
states, per column, what to do when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...errors import ConfigError
from ...tracking import TrackingConfig
from .. import config as config_lib
from ..training.kl_state import read_kl_coef
from .estimators import ESTIMATORS, Estimator
from .token_rewards import KL_ESTIMATORS, PROGRESS, STEP_REWARD_MODES


@dataclass
class Config:
    input: str = ""
    """Scored rollouts directory (or a parent of rollout shard directories) to read."""
    output: str = ""
    """Advantages directory to create; written to a temporary sibling and renamed when complete."""
    iteration: int = 0
    """RL iteration k: tags the tracking run and is the step of its metrics."""
    estimator: str = "grpo_process"
    """gae, reinforce, reinforce_baseline, grpo, dr_grpo, rloo, grpo_process or grpo_progress (table in README)."""
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
    """How a step reward enters: raw (PRM probability), centered (minus 0.5), min (worst step only), progress (Phi after
    the step minus before, the last Phi the outcome: sums to R - mean_group however steps are cut; grpo_progress only;
    docs/process-rewards.md#1-progress-credit-step_reward_mode-progress)."""
    reward_clip: float = 0.0
    """Clip outcome_reward and each step's contribution to [-reward_clip, reward_clip]; 0 = off."""
    whiten: bool | None = None
    """(A - mean) / (std + norm_eps) over all written tokens; costs one more read. Empty: reinforce_baseline only."""
    advantage_clip: float = 0.0
    """Clamp the final advantages to [-advantage_clip, advantage_clip] (after whitening); 0 = off."""
    norm_eps: float = 1e-6
    """Added to every std divided by (group normalization, whitening), so equal rewards give 0."""
    process_weight: float = 0.5
    """grpo_progress: weight w of the process advantage (unit RMS over the input's steps) added to the outcome advantage
    before the evidence gate scales it."""
    process_credit: Literal["step", "baseline"] = "step"
    """grpo_progress. step: each step's progress, balanced per token, sign-guarded, bounded. baseline: the PRM only as
    each step's baseline, so the expected gradient is GRPO's whatever it says (for a PRM not fitted to this policy).
    docs/process-rewards.md#2b-baseline-credit-process_credit-baseline"""
    process_calibration: Literal["none", "isotonic"] = "none"
    """grpo_progress: what Phi is. none: the PRM's score. isotonic: the score mapped to the batch's mean outcome by a
    cross-fitted isotonic fit, read only where it beats a flat map on held-out prompts (else outcome-only GRPO).
    docs/process-rewards.md#2c-calibrated-potential-process_calibration-isotonic"""
    process_auc_min: float = 0.6
    """grpo_progress gate: w is 0 when the PRM's step AUC on this batch (its scores of every step but the last, against
    the response's outcome) is below this; a PRM that cannot tell the current policy's winning prefixes from losing ones
    then falls back to outcome-only GRPO."""
    process_auc_full: float = 0.8
    """grpo_progress gate: w reaches process_weight at this AUC, growing linearly from process_auc_min (equal values: a step)."""
    zero_variance: Literal["keep", "drop", "downweight"] = "keep"
    """Groups (>= 2 samples) with all rewards equal: keep, drop their rows (less PPO work), or downweight."""
    zero_variance_weight: float = 0.1
    """Advantage multiplier in [0, 1] for zero-variance groups when zero_variance=downweight."""
    batch_rows: int = 512
    """Rows per batch and per output row group; peak memory grows with batch_rows x response length."""
    overwrite: bool = False
    """Replace an existing output made from another config or input; off: that is an error. One made from this config
    and input is kept (nothing to do)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow run settings (prmflow/tracking/)."""

    def __post_init__(self) -> None:
        _check_choice("estimator", self.estimator, ESTIMATORS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("step_reward_mode", self.step_reward_mode, [*STEP_REWARD_MODES, PROGRESS])
        _check_choice("zero_variance", self.zero_variance, ("keep", "drop", "downweight"))
        _check_choice("process_credit", self.process_credit, ("step", "baseline"))
        _check_choice("process_calibration", self.process_calibration, ("none", "isotonic"))
        for key, lo, hi in (("gamma", 0, 1), ("lam", 0, 1), ("zero_variance_weight", 0, 1)):
            if not lo <= getattr(self, key) <= hi:
                raise ConfigError(f"{key}={getattr(self, key)} is outside [{lo}, {hi}]; set it in that range.")
        if not 0 <= self.process_auc_min <= self.process_auc_full <= 1:
            raise ConfigError(f"process_auc_min={self.process_auc_min} and process_auc_full={self.process_auc_full} must "
                              f"satisfy 0 <= process_auc_min <= process_auc_full <= 1.")
        for key in ("kl_coef", "reward_clip", "advantage_clip", "process_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0 (0 turns it off).")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps} must be > 0, or equal-reward groups divide by zero.")
        if self.batch_rows < 1:
            raise ConfigError(f"batch_rows={self.batch_rows} must be >= 1.")
        # Empty switches stay None here and are resolved in `switches`: storing the resolved value
        # would pin it when config.load rebuilds the config with command-line overrides.
        _check_reward_switches(self, ESTIMATORS[self.estimator])

    def switches(self) -> tuple[bool, bool, bool]:
        """(outcome_reward, step_rewards, whiten) with empty values filled in from the estimator."""
        est = ESTIMATORS[self.estimator]
        outcome = est.signal != "steps" if self.outcome_reward is None else self.outcome_reward
        steps = (est.uses_token_rewards or est.signal == "steps" or est.process) if self.step_rewards is None \
            else self.step_rewards
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
    if est.process and (not steps or cfg.step_reward_mode != PROGRESS):
        raise ConfigError(f"{name} builds its process advantage from the steps' progress; set step_rewards=true and "
                          f"step_reward_mode=progress (or use estimator=grpo for the outcome alone).")
    if cfg.process_calibration != "none" and not est.process:
        raise ConfigError(f"process_calibration={cfg.process_calibration} maps the PRM's scores for estimator=grpo_progress "
                          f"only; {name} would ignore it. Set process_calibration=none, or estimator=grpo_progress.")
    if cfg.step_reward_mode == PROGRESS and not est.process:
        raise ConfigError(f"step_reward_mode=progress is read by estimator=grpo_progress only (its last step holds the "
                          f"outcome, so {name} would count the outcome twice or not at all); set estimator=grpo_progress "
                          f"or choose raw, centered or min.")
    if not est.uses_token_rewards and steps and est.signal == "outcome" and not est.process:
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


def recorded(cfg: Config) -> dict:
    """The config as the output's manifest records it (its identity): process_calibration only when it
    is on, so outputs written before the key existed still match."""
    d = config_lib.to_dict(cfg)
    if cfg.process_calibration == "none":
        d.pop("process_calibration")
    return d


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
        return list(dict.fromkeys(["prompt_id", "sample_idx", "iteration", "response_ids", "policy_mask", *self.needs]))


def resolve(cfg: Config) -> Plan:
    """The plan for `cfg`: its estimator, beta (kl_state read now) and why each column is needed."""
    beta = read_kl_coef(cfg.kl_state) if cfg.kl_state else cfg.kl_coef
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
