"""benchmarks/experiments/bare_vs_worked.py: its command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"))
import bare_vs_worked  # noqa: E402


def test_a_missing_config_is_a_usage_error_naming_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SystemExit) as e:
        bare_vs_worked.main([str(tmp_path), "--config", str(missing)])
    assert e.value.code == 2
    assert f"--config {missing}: no such file" in capsys.readouterr().err
