"""The recommended recipe is one line: `estimator: grpo_progress` with nothing else is the six keys every regime config
spelled out until 2026-11-29, bit for bit, and a key given explicitly still wins."""

import glob
from pathlib import Path

import numpy as np
import pytest
import sparse_rollouts
import yaml
from test_advantage_stage import write_rows

from prmflow.components import config as config_lib
from prmflow.components.advantage import stage
from prmflow.components.advantage.config import RECIPE, Config, recorded
from prmflow.errors import ConfigError
from prmflow.tracking import TrackingConfig

ROOT = Path(__file__).resolve().parents[2]

# the advantage section of `prm-implicit-trained-units` in configs/prm-vs-outcome-mixed.yaml as 5f and 5g ran it
# (commit f64bf3b, the same at be05e93), and of every -cv arm of configs/prm-vs-outcome.yaml: written out, not
# imported, so a change to RECIPE cannot pass by changing what it is compared with
REGIME_SIX = {"estimator": "grpo_progress", "step_reward_mode": "progress", "process_calibration": "isotonic",
              "process_auc_min": 0.0, "process_auc_full": 0.0, "process_weight": 0.5}


def test_grpo_progress_alone_is_the_six_keys_the_regimes_ran():
    one, six = Config(estimator="grpo_progress"), Config(**REGIME_SIX)
    assert config_lib.to_dict(one.filled()) == config_lib.to_dict(six.filled())  # every key, not only the six
    filled = one.filled()
    got = {k: getattr(filled, k) for k in REGIME_SIX}
    assert got == REGIME_SIX and all(type(got[k]) is type(v) for k, v in REGIME_SIX.items())  # 0.0, not 0
    assert RECIPE == REGIME_SIX
    # the output's identity: an output written by the six keys counts as finished for the one line
    assert recorded(one) == recorded(six)


def test_the_one_line_writes_the_six_keys_advantages_bit_for_bit(tmp_path):
    # on rollouts where the recipe's calibrated map is read (a PRM that ranks steps well, right answers rare), the
    # two configs write the same advantages, float for float
    rows = sparse_rollouts.chain_rows(np.random.default_rng(0), "good")
    for r in rows:
        r.pop("right_steps")
    write_rows(tmp_path, rows)
    out = {}
    for name, keys in (("one", {"estimator": "grpo_progress"}), ("six", REGIME_SIX)):
        summary = stage.run(Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / name),
                                   tracking=TrackingConfig(enabled=False), **keys))
        out[name] = (summary, _advantages(tmp_path / name))
    assert out["one"][0]["advantage/prm_calibrated_spread"] > 0  # the map is read: the credit is not GRPO's
    assert out["one"][1] == out["six"][1]
    # the six keys' output is the one line's finished output: run again, nothing is written (a re-run keeps it)
    again = stage.run(Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "six"),
                             tracking=TrackingConfig(enabled=False), estimator="grpo_progress"))
    assert set(again) == {"advantage/rows_out"}


def _advantages(d):
    from prmflow.components.data import schema
    return {(r["prompt_id"], r["sample_idx"]): r["advantages"] for r in schema.read_dataset(d, "advantages").to_pylist()}


@pytest.mark.parametrize("explicit, want", [
    ({"process_calibration": "none"},  # without calibration the gate guards again, at its old defaults
     {"process_calibration": "none", "process_auc_min": 0.6, "process_auc_full": 0.8}),
    ({"process_weight": 0.2}, {"process_weight": 0.2}),
    ({"process_auc_min": 0.5, "process_auc_full": 0.65}, {"process_auc_min": 0.5, "process_auc_full": 0.65}),
    ({"process_credit": "baseline", "process_weight": 1.0}, {"process_credit": "baseline", "process_weight": 1.0}),
    ({"calibration_labels": "shared_prefix"}, {"calibration_labels": "shared_prefix"}),
])
def test_an_explicit_key_overrides_the_recipe(explicit, want):
    filled = Config(estimator="grpo_progress", **explicit).filled()
    expected = {**REGIME_SIX, **want}
    assert {k: getattr(filled, k) for k in expected} == expected


def test_another_estimator_on_the_command_line_is_not_pinned_to_the_recipe(tmp_path):
    # the filled keys are not stored: `--set estimator=grpo` over a file that says grpo_progress is plain GRPO
    # (stored, step_reward_mode=progress would make grpo refuse the config)
    f = tmp_path / "adv.yaml"
    f.write_text("advantage:\n  estimator: grpo_progress\n")
    cfg = config_lib.load(Config, f, {"estimator": "grpo"}, section="advantage")
    assert (cfg.filled().step_reward_mode, cfg.filled().process_calibration) == ("raw", "none")
    with pytest.raises(ConfigError, match="step_reward_mode=progress"):
        Config(estimator="grpo_progress", step_reward_mode="raw")


def test_every_regime_config_writes_the_recipe_as_one_line():
    # a variant whose advantage section resolves to the recipe says so in one line; the others name what differs
    sections = 0
    for path in sorted(glob.glob(str(ROOT / "configs" / "prm-vs-outcome*.yaml"))):
        for name, variant in yaml.safe_load(Path(path).read_text())["variants"].items():
            adv = variant.get("advantage", {})
            if adv.get("estimator") != "grpo_progress":
                continue
            filled = config_lib.build(Config, config_lib.flatten(adv)).filled()
            if config_lib.to_dict(filled) == config_lib.to_dict(Config(estimator="grpo_progress").filled()):
                assert adv == {"estimator": "grpo_progress"}, f"{path}: variants.{name}.advantage spells the recipe out"
                sections += 1
    assert sections >= 20  # the -units, -cv, -calibrated arms and the regimes' recipe arms

