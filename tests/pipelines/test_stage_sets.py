"""`--set STAGE.KEY=VALUE` on the pipeline commands: a change is checked over the section it lands in, so one that
is valid only beside the base is taken, and a bad one is refused naming the stage and key."""

from __future__ import annotations

import pytest

from prmflow.errors import ConfigError
from prmflow.pipelines.params import merge_section

BASE = {"estimator": "reinforce_baseline", "step_rewards": True}  # configs/agent-memory.yaml's advantage


def test_a_change_valid_beside_its_base_is_taken():
    # alone, step_rewards=false fails the default estimator (grpo_process reads step rewards only)
    assert merge_section("advantage", BASE, {"step_rewards": False}, "--set") == {
        "estimator": "reinforce_baseline", "step_rewards": False}


@pytest.mark.parametrize("base, change, says", [
    ({"estimator": "grpo_process"}, {"step_rewards": False}, r"--set \[advantage\]: estimator=grpo_process normalizes"),
    (BASE, {"stepp_rewards": False}, r"--set \[advantage\]: 'stepp_rewards' is not a config key. Did you mean 'step_rewards'"),
    (BASE, {"gamma": "x"}, r"--set \[advantage\]: .*gamma"),
])
def test_a_bad_change_is_refused_naming_the_stage_and_key(base, change, says):
    with pytest.raises(ConfigError, match=says):
        merge_section("advantage", base, change, "--set")
