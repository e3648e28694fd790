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
    """Hash of everything that can change what a cached fixture holds: every file of the prmflow package
    and the versions of Python and the libraries that train and save the model. A cached policy is
    never trusted across a change to any of them."""
    import hashlib
    import importlib.metadata as md
    import platform
    from pathlib import Path

    import prmflow

    root = Path(prmflow.__file__).parent
    h = hashlib.sha256(platform.python_version().encode())
    for dist in ("torch", "transformers", "deepspeed", "peft", "tokenizers", "safetensors"):
        try:
            h.update(f"{dist}=={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            h.update(f"{dist} missing".encode())
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in {".py", ".yaml", ".json", ".txt"} and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


#: The SFT recipe of the shared test policy: about 40 s on 2 cores, held-out accuracy around 0.3-0.5,
#: so it makes both right and wrong solutions (what PRM, rollout and RL tests need).
POLICY_OVERRIDES = {"max_steps": 500, "eval_every": 500, "save_every": 0, "num_prompts": 6000, "eval_size": 100,
                    "engine.backend": "torch", "tracking.enabled": False}


def cached_sft(name: str, overrides: dict):
    """Train (once) an SFT policy with `overrides`, cached under $PRMFLOW_TEST_CACHE (default
    ~/.cache/prmflow-tests; .ci/run points it inside the checkout, so CI always starts cold) by the
    recipe and `_source_digest()`, so it is rebuilt whenever the code or the libraries change, and a hit
    is used only when its files match the manifest's checksums."""
    import hashlib
    import json
    import shutil
    from pathlib import Path

    from prmflow.components.common import config, io
    from prmflow.components.common.errors import DataError
    from prmflow.components.sft import stage

    recipe = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    root = Path(os.environ.get("PRMFLOW_TEST_CACHE", Path.home() / ".cache" / "prmflow-tests"))
    out = root / f"{name}-{_source_digest()}-{recipe}"
    if out.exists():
        try:  # a hit must be intact: every file the manifest lists, with its checksum
            io.verify_files(out, io.read_manifest(out))
            return out
        except DataError:
            shutil.rmtree(out)
    stage.run(config.load(stage.Config, overrides={**overrides, "output": str(out)}))
    return out


@pytest.fixture(scope="session")
def sft_policy():
    """Path of a tiny policy trained with SFT on the arithmetic task (HF directory)."""
    return cached_sft("sft-policy", POLICY_OVERRIDES)


#: The quickstart's warm-up: mixed demonstrations, half of them the bare answer with no working. The
#: policy answers directly about half the time; its bare answers are right ~13% of the time, its worked
#: solutions ~80% (sampled), so RL has something to find. 1000 steps are not enough: the worked
#: solutions are then right only ~20% of the time and the reward barely moves.
MIXED_POLICY_OVERRIDES = {"max_steps": 2000, "eval_every": 2000, "save_every": 0, "num_prompts": 6000,
                          "eval_size": 50, "micro_batch_size": 32, "lr": 3.0e-3, "warmup_steps": 30,
                          "arithmetic.direct_answer_frac": 0.5, "engine.backend": "torch", "tracking.enabled": False}


@pytest.fixture(scope="session")
def mixed_sft_policy():
    """Path of a tiny SFT policy trained on MIXED_POLICY_OVERRIDES' mix (about 3 min on 2 cores)."""
    return cached_sft("mixed-sft-policy", MIXED_POLICY_OVERRIDES)
