"""The note a pipeline config gets where grpo_progress's step credit follows a PRM nobody keeps on-policy
(docs/experiments/5d-a-prm-wrong-in-one-place.md: such a PRM, right on the whole but dropping one step late, took the
step credit 18 points below outcome-only; kept on-policy, a PRM trained with that bias shed it)."""

from pathlib import Path

import pytest

from prmflow.cli import main
from prmflow.pipelines import advice
from prmflow.pipelines.settings import load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEP_CREDIT = {"estimator": "grpo_progress", "step_reward_mode": "progress"}


def spec_with(advantage: dict, rollout: dict | None = None, prm_update: bool = False):
    return load_spec(None, data={"pipeline": {"prm_update": prm_update}, "sft": {}, "prm": {},
                                 "rollout": rollout or {}, "advantage": advantage, "ppo": {}})


@pytest.mark.parametrize("advantage, rollout, prm_update, noted", [
    (STEP_CREDIT, None, False, True),                                      # the trained PRM, frozen: noted
    ({**STEP_CREDIT, "process_calibration": "isotonic", "process_auc_min": 0, "process_auc_full": 0},
     None, False, True),                                                   # calibrated and ungated: still noted
    (STEP_CREDIT, None, True, False),                                      # kept on-policy by prm-update
    ({**STEP_CREDIT, "process_credit": "baseline"}, None, False, False),   # the credit that cannot be bent
    ({**STEP_CREDIT, "process_weight": 0.0}, None, False, False),          # no process term at all
    (STEP_CREDIT, {"prm": "oracle"}, False, False),                        # the task's exact checker
    ({"estimator": "grpo_process"}, None, False, False),                   # the quickstart's estimator: not measured
])
def test_the_note_names_a_frozen_prm_under_the_step_credit_only(advantage, rollout, prm_update, noted):
    note = advice.frozen_step_credit(spec_with(advantage, rollout, prm_update))
    assert (note is not None) == noted
    if noted:  # it says what to set, by key
        assert "pipeline.prm_update: true" in note and "advantage.process_credit: baseline" in note


def test_compile_prints_the_note_once_and_still_compiles(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    images = ["--set", "images.cpu=registry.example/prmflow-cpu:1", "--set", "images.gpu=registry.example/prmflow-gpu:1",
              "--set", "cluster.kfp_version=2.17.0"]
    assert main(["pipeline", "compile", "--config", str(CONFIGS / "pipeline-local.yaml"), "-o", str(out), *images,
                 "--set", "advantage.estimator=grpo_progress", "--set", "advantage.step_reward_mode=progress"]) == 0
    err = capsys.readouterr().err
    assert out.is_file() and err.count("note: advantage.process_credit is step") == 1
    assert main(["pipeline", "compile", "--config", str(CONFIGS / "pipeline-local.yaml"), "-o", str(out), *images,
                 "--set", "advantage.estimator=grpo_progress", "--set", "advantage.step_reward_mode=progress",
                 "--set", "pipeline.prm_update=true"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_no_shipped_pipeline_config_gets_the_note():
    """The quickstart and the cluster recipes are what users start from: none may run against the measured advice."""
    shipped = [CONFIGS / "quickstart.yaml", CONFIGS / "pipeline-local.yaml", *sorted((CONFIGS / "cluster").glob("*.yaml"))]
    assert len(shipped) > 3
    for path in shipped:
        assert advice.notes(load_spec(path)) == [], path
