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


@pytest.fixture(scope="session")
def sft_policy():
    """Path of a tiny policy trained with SFT on the arithmetic task (HF directory).

    Cached under $PRMFLOW_TEST_CACHE (default ~/.cache/prmflow-tests) keyed by the recipe and a hash
    of the code that trains it, so it is rebuilt whenever that code changes.
    """
    import json
    from pathlib import Path

    from prmflow.components.common import config
    from prmflow.components.sft import stage

    import hashlib

    recipe = hashlib.sha256(json.dumps(POLICY_OVERRIDES, sort_keys=True).encode()).hexdigest()[:8]
    digest = _source_digest() + "-" + recipe
    root = Path(os.environ.get("PRMFLOW_TEST_CACHE", Path.home() / ".cache" / "prmflow-tests"))
    out = root / f"sft-policy-{digest}"
    if not (out / "manifest.json").is_file():
        cfg = config.load(stage.Config, overrides={**POLICY_OVERRIDES, "output": str(out)})
        stage.run(cfg)
    return out
