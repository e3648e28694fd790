"""benchmarks/perf/ and benchmarks/experiments/: every script finds the repository from where it lies, the scripts
that name others name files that exist, and each starts (its --help)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for folder in ("perf", "experiments") for p in (ROOT / "benchmarks" / folder).glob("*.py"))
#: Files that run benchmark scripts by path.
RUNNERS = [ROOT / "benchmarks" / "perf" / "gpu_check.sh", ROOT / ".ci" / "run", *SCRIPTS]


def test_the_folders_hold_the_scripts():
    assert {p.parent.name for p in SCRIPTS} == {"perf", "experiments"}
    assert not sorted((ROOT / "benchmarks").glob("*.py")), "a benchmark script belongs in perf/ or experiments/"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_finds_the_repository(script):
    """`Path(__file__).resolve().parents[k]` is how a script reaches configs/ and prmflow/: after a move it must
    still be the repository root."""
    ks = {int(k) for k in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d)\]", script.read_text(encoding="utf-8"))}
    assert all(script.resolve().parents[k] == ROOT for k in ks), f"{script.name}: parents{sorted(ks)} is not the repository"


def test_runners_name_scripts_that_exist():
    named = {(runner.relative_to(ROOT), m) for runner in RUNNERS if runner.exists()
             for m in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh|json)", runner.read_text(encoding="utf-8"))}
    missing = sorted(f"{runner}: {path}" for runner, path in named if not (ROOT / path).exists())
    assert not missing, "benchmark paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.slow
@pytest.mark.parametrize("script", [p for p in SCRIPTS if "__main__" in p.read_text(encoding="utf-8")],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_answers_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
