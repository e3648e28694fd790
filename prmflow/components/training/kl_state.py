"""kl_state.json, the KL controller's state between RL iterations: its one reader and writer.

The KL coefficient beta of the token reward r_t = -beta * kl_t crosses iterations: the ppo stage
of iteration k measures the KL of its batch and writes beta_{k+1} to OUTPUT/kl_state.json; the
advantage stage of iteration k+1 builds its rewards with it, and the ppo stage of k+1 continues
the controller from it (docs/design.md, "The KL coefficient across iterations"). Only `kl_coef`
is needed to read the file; the rest records how it came:

    {"kl_coef": 0.051, "mode": "adaptive", "target": 6.0, "horizon": 10000,
     "previous_kl_coef": 0.05, "measured_kl": 7.2, "n_samples": 64, "iteration": 3}

Both stages take the file (or the ppo output directory holding it) as the config key `kl_state`,
so the errors name that key, the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..data import io
from ...errors import ConfigError

KL_STATE_FILE = "kl_state.json"


def state_path(path: str | Path) -> Path:
    """`path` itself when it is a file, else `path/kl_state.json` (a ppo output directory)."""
    p = Path(path)
    return p / KL_STATE_FILE if p.is_dir() else p


def read(path: str | Path) -> dict[str, Any]:
    """The state the previous iteration's ppo stage wrote (the file, or its output directory)."""
    p = state_path(path)
    if not p.is_file():
        raise ConfigError(f"kl_state '{p}' does not exist. Pass the previous iteration's ppo output (or its "
                          f"{KL_STATE_FILE}), or set kl_state='' to use kl_coef on the first iteration.")
    try:
        state = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"kl_state '{p}' is not valid JSON ({e}); it must look like {{\"kl_coef\": 0.05}}. "
                          f"Re-run the ppo stage that wrote it.") from None
    if not isinstance(state, dict) or "kl_coef" not in state:
        raise ConfigError(f"kl_state '{p}' has no field 'kl_coef'; it must look like {{\"kl_coef\": 0.05}}. "
                          f"Re-run the ppo stage that wrote it.")
    coef = state["kl_coef"]
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not (math.isfinite(coef) and coef >= 0):
        raise ConfigError(f"kl_state '{p}' holds kl_coef={coef!r}; it must be a finite number >= 0.")
    return state


def read_kl_coef(path: str | Path) -> float:
    """beta for the next iteration: `kl_coef` of the state at `path` (file or ppo output directory)."""
    return float(read(path)["kl_coef"])


def write(path: str | Path, state: dict[str, Any]) -> None:
    """Write `state` (it must hold `kl_coef`) atomically to `path` (a file, or a directory to hold it)."""
    io.write_json_atomic(state_path(path), state)
