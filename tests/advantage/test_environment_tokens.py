"""Multi-turn rows: environment tokens carry nothing in any estimator.

The reference is the same episodes with the environment's tokens cut out by hand (a plain loop over each
row's policy_mask, step_ends re-indexed by counting): the advantage stage must give the policy's tokens
exactly what it gives that stripped rollout, and every environment token 0 in token_rewards, advantages,
returns and kl, whatever the rollout wrote at those tokens (old/ref log-probs, values)."""

import random

import pyarrow as pa
import pytest

from prmflow.components.advantage import stage
from prmflow.components.data import schema
from prmflow.tracking import TrackingConfig

OFF = TrackingConfig(enabled=False)

CONFIGS = {
    "gae": dict(estimator="gae", kl_coef=0.1, gamma=0.9, lam=0.8),
    "reinforce": dict(estimator="reinforce", kl_coef=0.1, gamma=0.95),
    "reinforce_baseline": dict(estimator="reinforce_baseline", kl_coef=0.05),
    "grpo": dict(estimator="grpo"),
    "dr_grpo": dict(estimator="dr_grpo"),
    "rloo": dict(estimator="rloo"),
    "grpo_process": dict(estimator="grpo_process"),
    "grpo_progress": dict(estimator="grpo_progress", step_reward_mode="progress", process_auc_min=0.0,
                          process_auc_full=0.0),
    "grpo_progress baseline": dict(estimator="grpo_progress", step_reward_mode="progress", process_credit="baseline",
                                   process_auc_min=0.0, process_auc_full=0.0),
}


def episodes(seed: int = 0) -> list[dict]:
    """Two groups of three episodes: policy turns of 1-4 tokens, observations of 1-5 tokens between them, random
    numbers everywhere (environment tokens included), one step per policy turn."""
    rng = random.Random(seed)
    rows = []
    for g in range(2):
        for i in range(3):
            mask, ends = [], []
            for turn in range(rng.randint(1, 3)):
                if turn:
                    mask += [0] * rng.randint(1, 5)
                mask += [1] * rng.randint(1, 4)
                ends.append(len(mask) - 1)
            n = len(mask)
            rows.append({"prompt_id": f"p{g}", "sample_idx": i, "iteration": 0, "response_ids": list(range(n)),
                         "policy_mask": mask, "old_logprobs": [rng.uniform(-3, 0) for _ in range(n)],
                         "ref_logprobs": [rng.uniform(-3, 0) for _ in range(n)],
                         "values": [rng.uniform(-1, 1) for _ in range(n)], "step_ends": ends,
                         "step_rewards": [rng.random() for _ in ends], "outcome_reward": float(rng.random() < 0.5)})
    return rows


def strip(row: dict) -> dict:
    """The episode without its environment tokens: what a single-turn rollout of the policy's tokens would hold."""
    keep = [t for t, m in enumerate(row["policy_mask"]) if m]
    out = {k: v for k, v in row.items() if k != "policy_mask"}
    for k in ("response_ids", "old_logprobs", "ref_logprobs", "values"):
        out[k] = [row[k][t] for t in keep]
    out["step_ends"] = [keep.index(e) for e in row["step_ends"]]
    return out


def run(tmp_path, name, rows, options):
    d = tmp_path / name
    schema.write_dataset(d / "rollouts", pa.Table.from_pylist(rows), "rollouts")
    stage.run(stage.Config(input=str(d / "rollouts"), output=str(d / "advantages"), tracking=OFF, **options))
    return schema.read_dataset(d / "advantages", "advantages").to_pylist()


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_environment_tokens_get_nothing_and_change_nothing(tmp_path, config):
    rows = episodes()
    got = run(tmp_path, "episodes", rows, CONFIGS[config])
    want = run(tmp_path, "stripped", [strip(r) for r in rows], CONFIGS[config])
    assert len(got) == len(want) == len(rows)
    for g, w, r in zip(got, want, rows):
        mask = r["policy_mask"]
        assert g["policy_mask"] == mask and g["response_ids"] == r["response_ids"]  # the row keeps every token
        for col in ("token_rewards", "advantages", "returns", "kl"):
            assert len(g[col]) == len(mask)
            assert [x for x, m in zip(g[col], mask) if not m] == [0.0] * mask.count(0), col
            assert [x for x, m in zip(g[col], mask) if m] == pytest.approx(w[col], abs=1e-6), col
    assert any(0 in r["policy_mask"] for r in rows)
