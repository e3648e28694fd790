"""ppo refuses an iteration past its learning-rate schedule's span (ppo.rl_iterations); the pipeline refuses
such a run when it is compiled, before a GPU is spent on the iterations before it."""

from __future__ import annotations

import pytest
import yaml

from prmflow.components import config
from prmflow.components.ppo.config import Config as PpoConfig
from prmflow.errors import ConfigError
from prmflow.pipelines.pipeline import build
from prmflow.pipelines.settings import load_spec


@pytest.mark.parametrize("schedule", ["constant_with_warmup", "cosine", "constant"])
@pytest.mark.parametrize("iterations", [3, 4])
def test_the_run_is_refused_where_ppo_would_refuse_an_iteration(schedule, iterations):
    data = yaml.safe_load(open("configs/quickstart.yaml"))
    data["pipeline"]["iterations"] = iterations
    data["ppo"].update(rl_iterations=3, optim={**data["ppo"]["optim"], "lr_schedule": schedule})
    spec = load_spec("configs/quickstart.yaml", data=data)
    # the independent reference: the ppo stage's own check at each iteration of the run
    ppo_refuses = False
    for k in range(iterations):
        try:
            config.load(PpoConfig, overrides={"rl_iterations": 3, "iteration": k, "optim.lr_schedule": schedule})
        except ConfigError:
            ppo_refuses = True
    if ppo_refuses:
        with pytest.raises(ConfigError, match=r"pipeline.iterations is 4, but ppo.rl_iterations .* is 3: .*"
                                              r"--set ppo.rl_iterations=4\) or ppo.optim.lr_schedule: constant"):
            build(spec)
    else:
        assert build(spec).component_spec.name
