"""`pipeline plan` refuses a number that cannot be meant, naming the flag, before it compiles anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from prmflow import cli

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "cluster" / "ppo-7b-2x8.yaml")


@pytest.mark.parametrize("flag, value", [
    ("--model-params", "-5"), ("--model-params", "0"), ("--model-params", "nan"), ("--model-params", "inf"),
    ("--model-params", "7"),  # 7 parameters: 7e9 was meant
    ("--volume", "-2Ti"), ("--volume", "0"), ("--volume", "2TiB"), ("--volume", "lots"),
])
def test_plan_refuses_a_nonsensical_number_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["pipeline", "plan", "--config", CONFIG, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"argument {flag}: '{value}'" in err and "e.g." in err, err


@pytest.mark.slow  # compiles the 7B pipeline twice: 14 s on 2 cores
def test_plan_reads_a_valid_volume_and_warns_when_the_run_needs_more(capsys):
    assert cli.main(["pipeline", "plan", "--config", CONFIG, "--model-params", "7.62e9"]) == 0  # --volume is optional
    assert "the workspace needs" not in capsys.readouterr().out  # the PVC's size is unknown: nothing to compare
    assert cli.main(["pipeline", "plan", "--config", CONFIG, "--model-params", "7.62e9", "--volume", "1Gi"]) == 0
    out = capsys.readouterr().out
    assert "warning: the workspace needs" in out and "is 1 GB" in out, out


@pytest.mark.parametrize("flag, value, says", [
    ("--timeout", "-5", "give more than 0 seconds"), ("--timeout", "0", "give more than 0 seconds"),
    ("--poll", "-1", "give 0 or more seconds"), ("--poll", "-0.5", "give 0 or more seconds"),
    ("--poll", "nan", "give 0 or more seconds"),
    ("--log-lines", "-3", "give 0 or more lines"), ("--log-lines", "2.5", "is not a whole number of lines"),
])
def test_submit_refuses_a_wait_setting_that_cannot_be_meant_before_it_reads_the_config(flag, value, says, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["pipeline", "submit", "--config", CONFIG, "--wait", f"{flag}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: '{value}'" in err and says in err, err


def test_submit_takes_zero_log_lines_and_a_fractional_or_zero_poll():
    for poll in (0.5, 0.0):
        argv = ["pipeline", "submit", "--config", CONFIG, "--log-lines", "0", "--poll", str(poll)]
        args = cli.build_parser(argv)[0].parse_args(argv)
        assert (args.log_lines, args.poll) == (0, poll)
