"""The environment interface's arithmetic: step and outcome rewards as weighted sums, reward_components as
the outcome components and each per-action component's mean over the episode, bad numbers refused."""

import math

import pytest

from prmflow.components.sampling import environment as env
from prmflow.errors import ConfigError, DataError


def test_weighted_sums_and_episode_components():
    cfg = env.EnvironmentConfig(factory="m:f", step_reward_weights={"tool_success": 1.0, "content_quality": 0.1},
                                outcome_weights={"qa_accuracy": 1.0, "compression": 0.05})
    steps = [{"tool_success": 1.0, "content_quality": 0.5}, {"tool_success": 0.0}, {"tool_success": 1.0, "extra": 2.0}]
    assert [env.weighted(c, cfg.step_reward_weights) for c in steps] == pytest.approx([1.05, 0.0, 1.0])
    assert env.weighted({"qa_accuracy": 0.5}, cfg.outcome_weights) == pytest.approx(0.5)  # compression missing: 0
    got = env.episode_components(steps, {"qa_accuracy": 0.5}, cfg)
    assert got == pytest.approx({"tool_success": 2 / 3, "content_quality": 0.5 / 3, "extra": 2 / 3,
                                 "qa_accuracy": 0.5, "compression": 0.0})
    with pytest.raises(DataError, match="'tool_success' is both per-action and episode-level"):
        env.episode_components(steps, {"tool_success": 1.0}, cfg)


@pytest.mark.parametrize("value,match", [(math.nan, "must return finite"), ("high", "not a number"),
                                         (math.inf, "must return finite")])
def test_a_reward_that_is_not_a_finite_number_is_refused_naming_the_episode(value, match):
    with pytest.raises(DataError, match=f"prompt_id='a', turn 2: reward component 'r' .*{match}"):
        env.check_components("prompt_id='a', turn 2", {"r": value})


def test_bad_settings_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match="environment.step_reward_weights.r is 'x'"):
        env.EnvironmentConfig(factory="m:f", step_reward_weights={"r": "x"})
    with pytest.raises(ConfigError, match="environment.on_limit is 'drop'"):
        env.EnvironmentConfig(on_limit="drop")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_here'"):
        env.load_factory("no_such_module_here:Env")
    with pytest.raises(ConfigError, match="without reset, step, outcome"):
        env.make_environment(env.EnvironmentConfig(factory="m:f"), factory=lambda config: object())
