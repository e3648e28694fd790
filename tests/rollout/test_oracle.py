"""`prm: oracle`: step rewards from the exact checker, against hand-labelled responses."""

import pytest

from prmflow.errors import ConfigError
from prmflow.components.rollout import oracle

PROMPT = "Compute left to right: 7+5*3-4\n"  # 7+5=12, 12*3=36, 36-4=32


@pytest.mark.parametrize("response, want", [
    ("7+5=12\n12*3=36\n36-4=32\nanswer: 32", [1, 1, 1, 1]),
    ("7+5=12\n12*3=35\n35-4=31\nanswer: 31", [1, 0, 0, 0]),   # later steps right from a wrong value: still 0
    ("7+5=12\n\n12*3=36\n36-4=32\nanswer: 32\n", [1, 1, 1, 1]),  # empty lines are no steps
    ("answer: 32", [0]),                                          # a bare answer skips the working
    ("7+5=12\n12*3=36", [1, 1]),                                  # cut short: what is there is right
])
def test_oracle_labels_each_step_up_to_the_first_error(response, want):
    assert oracle.step_rewards(["arithmetic"], [PROMPT], [response], "\n") == [want]


def test_oracle_refuses_prompts_without_an_exact_step_checker():
    with pytest.raises(ConfigError, match="row 1 .*'gsm8k'.*trained PRM"):
        oracle.step_rewards(["arithmetic", "gsm8k"], [PROMPT, "Janet has 3 ducks"], ["answer: 32", "#### 3"], "\n")


@pytest.mark.parametrize("configured, wired, want", [({"prm": "oracle"}, False, None), ({}, True, "/pvc/prm_model")])
def test_pipeline_step_uses_the_oracle_only_when_configured(monkeypatch, configured, wired, want):
    """In the pipeline the rollout step is handed the trained PRM artifact, except with `rollout: {prm: oracle}`,
    where no PRM is wired (pipelines/pipeline.py) and the config's `oracle` stands."""
    from kfp import dsl

    from prmflow.pipelines import kfp_shim
    from prmflow.pipelines import kfp_components as component

    seen = {}
    monkeypatch.setattr(kfp_shim, "run_stage", lambda name, stage, config, paths, *a, **k: seen.update(paths))
    monkeypatch.setattr(kfp_shim, "dataset_metadata", lambda path: {})

    def art(cls, path):
        a = cls(uri=f"file://{path}")
        a.path = path
        return a

    component.rollout(configured, "", "exp", 0, 0, 1, art(dsl.Model, "/pvc/policy"), art(dsl.Dataset, "/pvc/rollouts"),
                      prm_model=art(dsl.Model, "/pvc/prm_model") if wired else None, ref=art(dsl.Model, "/pvc/ref"))
    assert seen.get("prm") == want and seen["policy"] == "/pvc/policy" and "critic" not in seen
