"""Every estimator, run through the stage on random ragged rollouts, against the slow reference.

Batches are small (7 rows) and rows are shuffled, so groups span batches: group statistics must
come from the first pass, not from whatever part of a group a batch happens to hold.
"""

import zlib

import advantage_reference as ref
import numpy as np
import pyarrow as pa
import pytest

from prmflow.components.advantage import stage
from prmflow.components.advantage.estimators import ESTIMATORS
from prmflow.components.data import schema
from prmflow.tracking import TrackingConfig

COLUMNS = ("token_rewards", "advantages", "returns", "kl")


def run_and_compare(tmp_path, table: pa.Table, **options):
    """Run the stage with `options`, compare every written row with the reference, return the summary."""
    schema.write_dataset(tmp_path / "rollouts", table, "rollouts")
    cfg = stage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "advantages"), batch_rows=7,
                       tracking=TrackingConfig(enabled=False), **options)
    summary = stage.run(cfg)
    outcome, steps, whiten = cfg.switches()
    expected = ref.reference(
        table.to_pylist(), estimator=cfg.estimator, gamma=cfg.gamma, lam=cfg.lam, beta=cfg.kl_coef,
        kl_est=cfg.kl_estimator, outcome=outcome, steps=steps, mode=cfg.step_reward_mode, c=cfg.reward_clip,
        eps=cfg.norm_eps, whiten=whiten, adv_clip=cfg.advantage_clip, zero_variance=cfg.zero_variance,
        zv_weight=cfg.zero_variance_weight, process=(cfg.process_weight, cfg.process_auc_min, cfg.process_auc_full))
    written = schema.read_dataset(tmp_path / "advantages", "advantages").to_pylist()
    assert sorted((r["iteration"], r["prompt_id"], r["sample_idx"]) for r in written) == sorted(expected)
    for row in written:
        want = expected[(row["iteration"], row["prompt_id"], row["sample_idx"])]
        for name in COLUMNS:
            np.testing.assert_allclose(row[name], want[name], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} of {row['prompt_id']}/{row['sample_idx']}")
    return summary


GAMMA_LAMBDA = [(1.0, 1.0), (1.0, 0.95), (0.9, 0.7), (0.99, 1.0)]


@pytest.mark.parametrize("gamma,lam", GAMMA_LAMBDA, ids=[f"g{g}-l{lam}" for g, lam in GAMMA_LAMBDA])
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_estimator_matches_reference(tmp_path, estimator, gamma, lam):
    seed = zlib.crc32(f"{estimator}-{gamma}-{lam}".encode())
    table = ref.random_rollouts(np.random.default_rng(seed), binary_outcome=seed % 2 == 0)
    kl = {"kl_coef": 0.05, "kl_estimator": "k3"} if ESTIMATORS[estimator].uses_token_rewards else {}
    progress = {"step_reward_mode": "progress", "process_calibration": "none", "process_auc_min": 0.0,
                "process_auc_full": 0.0} \
        if ESTIMATORS[estimator].process else {}
    run_and_compare(tmp_path, table, estimator=estimator, gamma=gamma, lam=lam, **kl, **progress)


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline"])
@pytest.mark.parametrize("mode", ["centered", "min"])
def test_step_reward_modes_and_clipping(tmp_path, estimator, mode):
    table = ref.random_rollouts(np.random.default_rng(7), binary_outcome=False)
    run_and_compare(tmp_path, table, estimator=estimator, step_reward_mode=mode, reward_clip=0.6, gamma=0.95,
                    kl_coef=0.1, kl_estimator="k2")


@pytest.mark.parametrize("options", [
    {"estimator": "reinforce", "whiten": True, "advantage_clip": 1.5},
    {"estimator": "grpo", "zero_variance": "drop"},
    {"estimator": "grpo_process", "zero_variance": "downweight", "zero_variance_weight": 0.3, "whiten": True},
    {"estimator": "gae", "outcome_reward": False, "zero_variance": "drop", "lam": 0.9},
    {"estimator": "rloo", "reward_clip": 0.5, "advantage_clip": 0.4},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_postprocessing_matches_reference(tmp_path, options):
    table = ref.random_rollouts(np.random.default_rng(3), n_groups=8, equal_groups=2)
    summary = run_and_compare(tmp_path, table, **options)
    assert summary["advantage/zero_variance_group_count"] >= 2


def test_groups_are_per_iteration_and_span_shards(tmp_path):
    rng = np.random.default_rng(11)
    # the same prompt ids in two iterations are different groups; two shards read as one dataset
    schema.write_dataset(tmp_path / "rollouts" / "shard-0", ref.random_rollouts(rng, iteration=0), "rollouts")
    schema.write_dataset(tmp_path / "rollouts" / "shard-1", ref.random_rollouts(rng, iteration=1), "rollouts")
    both = schema.read_dataset(tmp_path / "rollouts", "rollouts")
    cfg = stage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "advantages"), estimator="grpo",
                       batch_rows=5, tracking=TrackingConfig(enabled=False))
    summary = stage.run(cfg)
    expected = ref.reference(both.to_pylist(), estimator="grpo", steps=False)
    written = schema.read_dataset(tmp_path / "advantages", "advantages").to_pylist()
    assert summary["advantage/groups"] == len({(r["iteration"], r["prompt_id"]) for r in written}) == 12
    for row in written:
        want = expected[(row["iteration"], row["prompt_id"], row["sample_idx"])]
        np.testing.assert_allclose(row["advantages"], want["advantages"], rtol=1e-5, atol=1e-5)
