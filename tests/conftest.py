"""Shared test fixtures. Tests run on CPU with the tiny model built from a config."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture
def no_tracking():
    """Override for stage configs: tracking off."""
    return {"tracking.enabled": False}


@pytest.fixture
def sqlite_store(tmp_path):
    """A real MLflow SQLite store in the test's directory."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _source_digest() -> str:
    """Hash of the code that decides what the SFT fixture produces (so a cached policy is never stale)."""
    import hashlib
    from pathlib import Path

    import prmflow

    root = Path(prmflow.__file__).parent / "components"
    h = hashlib.sha256()
    # what decides the trained weights: the SFT loop, the engine, the model and tokenizer, the task
    deciding = ["engine.py", "modeling.py", "config.py", "tensor_ops.py", "generation.py", "tasks"]
    files = [p for name in deciding for p in sorted((root / "common").glob(name + ("/*.py" if "." not in name else "")))]
    for p in files + sorted((root / "sft").glob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


#: The SFT recipe of the shared test policy: about 40 s on 2 cores, held-out accuracy around 0.3-0.5,
#: so it makes both right and wrong solutions (what PRM, rollout and RL tests need).
POLICY_OVERRIDES = {"max_steps": 500, "eval_every": 500, "save_every": 0, "train_size": 6000, "eval_size": 100,
                    "engine.backend": "torch", "tracking.enabled": False}


def _cached_sft(name: str, overrides: dict):
    """Train (once) an SFT policy with `overrides`, cached under $PRMFLOW_TEST_CACHE (default
    ~/.cache/prmflow-tests) by the recipe and a hash of the code that trains it, so it is rebuilt
    whenever that code changes."""
    import hashlib
    import json
    from pathlib import Path

    from prmflow.components.common import config
    from prmflow.components.sft import stage

    recipe = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    root = Path(os.environ.get("PRMFLOW_TEST_CACHE", Path.home() / ".cache" / "prmflow-tests"))
    out = root / f"{name}-{_source_digest()}-{recipe}"
    if not (out / "manifest.json").is_file():
        stage.run(config.load(stage.Config, overrides={**overrides, "output": str(out)}))
    return out


@pytest.fixture(scope="session")
def sft_policy():
    """Path of a tiny policy trained with SFT on the arithmetic task (HF directory)."""
    return _cached_sft("sft-policy", POLICY_OVERRIDES)


#: The quickstart's warm-up: mixed demonstrations, half of them the bare answer with no working. The
#: policy answers directly about half the time; its bare answers are right ~13% of the time, its worked
#: solutions ~80% (sampled), so RL has something to find. 1000 steps are not enough: the worked
#: solutions are then right only ~20% of the time and the reward barely moves.
MIXED_POLICY_OVERRIDES = {"max_steps": 2000, "eval_every": 2000, "save_every": 0, "train_size": 6000,
                          "eval_size": 50, "micro_batch_size": 32, "lr": 3.0e-3, "warmup_steps": 30,
                          "arithmetic.direct_answer_frac": 0.5, "engine.backend": "torch", "tracking.enabled": False}


@pytest.fixture(scope="session")
def mixed_sft_policy():
    """Path of a tiny SFT policy trained on MIXED_POLICY_OVERRIDES' mix (about 3 min on 2 cores)."""
    return _cached_sft("mixed-sft-policy", MIXED_POLICY_OVERRIDES)
