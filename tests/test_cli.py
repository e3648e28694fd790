"""The `prmflow` command's own help: what a new user reads first."""

import re

import pytest

from prmflow import cli, stages


def test_top_level_help_gives_every_stage_summary_whole(capsys):
    """Each stage's line in `prmflow --help` is the first paragraph of its module docstring, whole: a
    summary wrapped over two lines in the source is not cut at the line break (prm-label's read "label a
    step by what")."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse re-wraps to the terminal width
    for name in stages.STAGES:
        first_paragraph = " ".join(stages.load(name).__doc__.strip().split("\n\n")[0].split())
        assert re.search(rf"\b{re.escape(name)}\s+{re.escape(first_paragraph)}", shown), (name, first_paragraph)
    assert "label a step by what the policy can still reach from it." in shown
