"""What a fresh clone tells a user about itself: what git ignores, how big the quick suite is."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_rerun_folder_is_ignored_by_git():
    """`prmflow stage-command` writes to ./rerun by default: run from a clone, what it writes
    must not show up as untracked files to commit."""
    from prmflow import cli

    argv = ["stage-command", "sft", "--run-id", "r"]
    default = cli.build_parser(argv)[0].parse_args(argv).output
    probe = f"{default}/sft/model.safetensors"
    assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0, f"{probe} is not ignored"


@pytest.mark.slow
def test_docs_testing_gives_the_quick_suite_size():
    """docs/testing.md's "about N tests" is within 5 % of what `pytest --collect-only` counts (slow: the
    collection imports every test module)."""
    said = re.search(r"about ([\d,]+) tests", (ROOT / "docs" / "testing.md").read_text())
    assert said, "docs/testing.md does not say how many tests the quick suite has"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    counted = int(re.match(r"(\d+)(/\d+)? tests? collected", out).group(1))
    assert abs(int(said.group(1).replace(",", "")) - counted) <= 0.05 * counted, (said.group(0), out)
