"""What a ppo run records as its params: what the stage read, nothing it ignored."""

import pytest

from ppo_helpers import FAST, build_rows, write_advantages
from prmflow import cli
from prmflow.components import config
from prmflow.components.ppo import stage


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> str:
    """A random-init tiny policy: what it was trained on does not matter to what the run logs."""
    out = tmp_path_factory.mktemp("policy") / "tiny"
    assert cli.main(["make-tiny-model", str(out)]) == 0
    return str(out)


class _Started(Exception):
    pass


def test_params_leave_out_what_the_run_never_read(tiny_policy, tmp_path, monkeypatch):
    """With the ptx loss off, nothing builds an arithmetic prompt: a run compared with another must not
    show `arithmetic.prompt_prefix` and `arithmetic.min_ops` it never used (the quickstart's task says
    otherwise). With ptx on, on the arithmetic task, they are read and logged, with the run's values.
    The params are taken where the stage hands them to MLflow's run (which logs them as given: tests of
    the tracking package); the run stops there, before any update."""
    adv = write_advantages(tmp_path / "adv", build_rows(tiny_policy, 8), 1.0)
    logged = {}

    def start_stage_run(cfg, stage_name, params=None, **kw):
        logged[stage_name] = params
        raise _Started

    monkeypatch.setattr(stage.tracking, "start_stage_run", start_stage_run)
    common = {**FAST, "policy": tiny_policy, "input": str(adv), "epochs": 1, "minibatch_size": 8, "micro_batch_size": 8,
              "arithmetic.prompt_prefix": "", "arithmetic.min_ops": 3}
    with pytest.raises(_Started):
        stage.run(config.load(stage.Config, overrides={**common, "output": str(tmp_path / "out")}))
    off = logged["ppo"]
    assert not [k for k in off if k.startswith("arithmetic.") or k.startswith("ptx_") and k != "ptx_coef"], off
    assert "kl_target" not in off and "critic_lr" not in off  # fixed KL control, no critic
    assert off["optim.lr"] == FAST["optim.lr"] and off["ptx_coef"] == 0.0 and off["policy"] == tiny_policy
    on = stage.used_params(config.load(stage.Config, overrides={**common, "ptx_coef": 0.1}))
    assert on["arithmetic.prompt_prefix"] == "" and on["arithmetic.min_ops"] == 3 and "ptx_num_prompts" in on
