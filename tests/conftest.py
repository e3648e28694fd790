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
