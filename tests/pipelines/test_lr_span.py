"""ppo's LR schedule spans the pipeline's whole run: a config that leaves `ppo.rl_iterations` out gets
`pipeline.iterations` (a chain's whole length), and one whose schedule would end early is refused at compile
time, not by ppo at iteration rl_iterations, hours into a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from prmflow.components import config as config_lib
from prmflow.components.ppo.config import Config as PPOConfig
from prmflow.errors import ConfigError
from prmflow.pipelines.settings import load_spec, resolved

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = sorted(p for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/cluster/*.yaml")]
                   if "ppo" in config_lib.read_yaml(p, "config") and "pipeline" in config_lib.read_yaml(p, "config"))


def ppo_at(spec, iteration: int) -> PPOConfig:
    """ppo's config as a task at `iteration` of the run builds it (its validation is ppo's own refusal)."""
    section = config_lib.flatten(dict(spec.stages["ppo"]))
    return config_lib.build(PPOConfig, {**section, "iteration": iteration}, where="[ppo]")


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_every_pipeline_config_trains_every_iteration_of_a_300_iteration_run(path):
    data = config_lib.read_yaml(path, "config")
    data.pop("variants", None)  # pipeline compare's: laid over this base, which is checked here
    spec = load_spec(path, overrides={"iterations": 300}, data=data)
    assert resolved(spec, "ppo").rl_iterations == 300
    ppo_at(spec, 299)  # the last iteration of the run is inside the schedule
    if resolved(spec, "ppo").optim.lr_schedule != "constant":
        with pytest.raises(ConfigError, match="past the end of the LR schedule"):
            ppo_at(spec, 300)  # and the schedule ends there, not later


def test_a_schedule_shorter_than_the_run_is_refused_naming_both_keys(tmp_path):
    data = config_lib.read_yaml(ROOT / "configs/quickstart.yaml", "config")
    data["ppo"] = {**data["ppo"], "rl_iterations": 10}
    with pytest.raises(ConfigError, match=r"rl_iterations is 10.*pipeline.iterations \(300\)"):
        load_spec("quickstart.yaml", overrides={"iterations": 300}, data=data)
    assert resolved(load_spec("quickstart.yaml", overrides={"iterations": 10}, data=data), "ppo").rl_iterations == 10
    data["ppo"]["optim"] = {**data["ppo"]["optim"], "lr_schedule": "constant"}  # no schedule to outrun
    assert resolved(load_spec("quickstart.yaml", overrides={"iterations": 300}, data=data), "ppo").rl_iterations == 10


def test_a_stage_command_reading_a_pipeline_config_spans_the_pipeline_too(tmp_path, capsys):
    """`prmflow ppo --config configs/quickstart.yaml --iteration 2`: the file's ppo section leaves rl_iterations out,
    so the command fills pipeline.iterations (3) as the pipeline does; a value given on the command line wins."""
    from prmflow import cli

    args = ["ppo", "--config", str(ROOT / "configs/quickstart.yaml"), "--iteration", "2", "--policy", str(tmp_path),
            "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "missing' does not exist" in err and "LR schedule" not in err  # past the config, at its input
    assert cli.main([*args, "--set", "rl_iterations=2"]) == 2
    assert "iteration (2) is past the end of the LR schedule (rl_iterations=2)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
