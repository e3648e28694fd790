"""benchmarks/experiments/agent_credit.py: its table against hand-computed differences, and its argument checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"))

import agent_credit as ac  # noqa: E402


def test_the_table_pairs_each_variant_with_outcome_only_by_seed():
    runs = {"outcome-only": [(0.10, 0.20), (0.00, 0.30), (0.20, 0.25)],
            "env-per-turn": [(0.30, 0.50), (0.10, 0.30), (0.20, 0.55)]}
    results = [{"variant": v, "seed": s, "half": h, "final": f} for v, rows in runs.items() for s, (h, f) in enumerate(rows)]
    text = ac.table(results, [0, 1, 2])
    assert "| 1 | 0.000 / 0.300 | 0.100 / 0.300 |" in text
    # differences at half 0.2, 0.1, 0.0: mean 0.1, sd 0.1; t = 0.1 / (0.1 / sqrt 3) = 1.732 on 2 df: p = 0.225
    # at the end 0.3, 0.0, 0.3: mean 0.2, sd 0.1732; t = 2.0 on 2 df: p = 0.1835
    assert "| env-per-turn | +10.0 points (10.0), p = 0.225 | +20.0 points (17.3), p = 0.184 |" in text
    assert "| prm-per-turn |" not in text  # a variant without every seed is left out, not half-counted


def test_odd_iterations_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        ac.main(["--iterations", "3", "--output", "/nonexistent/never-written"])
    assert e.value.code == 2
    assert "--iterations 3: give an even number" in capsys.readouterr().err
