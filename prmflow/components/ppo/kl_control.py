"""The KL-penalty coefficient beta of the token reward r_t = -beta * kl_t, fixed or adaptive.

The coefficient is state that crosses iterations: the advantage stage of iteration k uses beta_k
to build rewards, the ppo stage of iteration k measures the KL of that batch (`next_state`) and
writes beta_{k+1} to `OUTPUT/kl_state.json` (the file's format and its one reader and writer:
prmflow/components/training/kl_state.py), which the next iteration's advantage stage reads; that stage
records the beta it used in the advantages manifest (`kl_coef_used`), the only place ppo reads it.

Adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", 2.2):
    beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon)
where kl is the batch's KL per response (the sum over its tokens, averaged over responses), in nats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..data import schema
from ...errors import DataError
from .minibatches import Sample
from .config import Config

log = logging.getLogger(__name__)


@dataclass
class FixedKLController:
    """beta never changes."""

    kl_coef: float

    def update(self, kl: float, n_samples: int) -> float:
        return self.kl_coef

    def state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef, "mode": "fixed"}


@dataclass
class AdaptiveKLController:
    """beta moves toward the value that keeps the KL per response near `target`."""

    kl_coef: float
    target: float
    horizon: int

    def update(self, kl: float, n_samples: int) -> float:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.kl_coef = self.kl_coef * (1.0 + error * n_samples / self.horizon)
        return self.kl_coef

    def state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef, "mode": "adaptive", "target": self.target, "horizon": self.horizon}


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def make_controller(mode: str, kl_coef: float, target: float = 6.0, horizon: int = 10000):
    """A controller of `mode` ('fixed' or 'adaptive') starting at `kl_coef`."""
    if mode == "fixed":
        return FixedKLController(kl_coef)
    if mode == "adaptive":
        return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(f"unknown KL control mode {mode!r}; known: {sorted(KL_CONTROLLERS)}")


def kl_per_response(kl_tokens: list[list[float]]) -> float:
    """Mean over responses of the sum of their per-token KL (nats per response)."""
    if not kl_tokens:
        return 0.0
    return sum(float(sum(k)) for k in kl_tokens) / len(kl_tokens)


def beta_used(cfg: Config) -> float:
    """The KL coefficient the advantage stage built this batch's rewards with: the one field of the
    advantages manifest that carries it (`kl_coef_used`, decided by the advantage stage from its config
    and the previous kl_state); kl_coef only for advantages written by another tool, without it."""
    manifests = schema.open_dataset(cfg.input, "advantages", verify_checksums=False).manifests
    used = {m.get("kl_coef_used") for m in manifests}
    used.discard(None)
    if len(used) == 1:
        return float(used.pop())
    if len(used) > 1:
        raise DataError(f"'{cfg.input}' mixes shards built with different KL coefficients {sorted(used)}.")
    return cfg.kl_coef


def next_state(cfg: Config, samples: list[Sample]) -> dict[str, Any]:
    """Update beta with this batch's KL per response and return the state for the next iteration."""
    beta = beta_used(cfg)
    if cfg.kl_control == "adaptive" and beta == 0:
        log.warning("ppo: adaptive KL control of a zero coefficient keeps it at zero (the rule is multiplicative); "
                    "start the advantage stage with kl_coef > 0")
    controller = make_controller(cfg.kl_control, beta, cfg.kl_target, cfg.kl_horizon)
    per_token = []
    for s in samples:  # the hand-off's kl column when present, else k1 of old vs reference; the policy's tokens only
        if s.kl is not None:
            per_token.append([k for k, m in zip(s.kl, s.trained().tolist()) if m])
        elif s.ref_logprobs is not None and s.old_logprobs is not None:
            per_token.append([a - b for a, b, m in zip(s.old_logprobs, s.ref_logprobs, s.trained().tolist()) if m])
    measured = kl_per_response(per_token)
    if per_token:
        controller.update(measured, len(per_token))
    elif cfg.kl_control == "adaptive":
        log.warning("ppo: the batch has neither 'kl' nor 'ref_logprobs'; the adaptive KL coefficient is unchanged")
    return {**controller.state(), "previous_kl_coef": beta, "measured_kl": measured,
            "n_samples": len(per_token), "iteration": cfg.iteration}
