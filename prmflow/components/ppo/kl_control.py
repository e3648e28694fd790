"""The KL-penalty coefficient beta of the token reward r_t = -beta * kl_t, fixed or adaptive.

The coefficient is state that crosses iterations: the advantage stage of iteration k uses beta_k
to build rewards, the ppo stage of iteration k measures the KL of that batch and writes
beta_{k+1} to `OUTPUT/kl_state.json`, which the next iteration's advantage and ppo stages read.

    {"kl_coef": 0.051, "mode": "adaptive", "target": 6.0, "horizon": 10000,
     "previous_kl_coef": 0.05, "measured_kl": 7.2, "n_samples": 64, "iteration": 3}

Adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", 2.2):
    beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon)
where kl is the batch's KL per response (the sum over its tokens, averaged over responses), in nats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import io
from ..common.errors import DataError

KL_STATE_FILE = "kl_state.json"


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


def state_path(path: str | Path) -> Path:
    """`path` itself when it is a file, else `path/kl_state.json` (a ppo output directory)."""
    p = Path(path)
    return p / KL_STATE_FILE if p.is_dir() else p


def read_state(path: str | Path) -> dict[str, Any]:
    """The controller state written by the previous iteration's ppo stage (file or its output dir)."""
    p = state_path(path)
    if not p.is_file():
        raise DataError(f"KL controller state '{p}' does not exist. Pass the previous iteration's ppo output "
                        f"(or its {KL_STATE_FILE}) as kl_state, or leave kl_state empty on the first iteration.")
    try:
        state = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"'{p}' is not valid JSON ({e}). Re-run the ppo stage that wrote it.") from None
    coef = state.get("kl_coef") if isinstance(state, dict) else None
    if not isinstance(coef, (int, float)) or coef < 0:
        raise DataError(f"'{p}' has no non-negative number 'kl_coef'. Re-run the ppo stage that wrote it.")
    return state


def write_state(path: str | Path, state: dict[str, Any]) -> None:
    io.write_json_atomic(state_path(path), state)


def kl_per_response(kl_tokens: list[list[float]]) -> float:
    """Mean over responses of the sum of their per-token KL (nats per response)."""
    if not kl_tokens:
        return 0.0
    return sum(float(sum(k)) for k in kl_tokens) / len(kl_tokens)
