"""Dr. GRPO's constant length is the rollout's generation budget (sampling.max_new_tokens), carried from the
rollouts' manifest through the advantages' manifest: the same every iteration, not the batch's longest response
(issue 61 item 7)."""

import pyarrow as pa
import pytest

from prmflow.components.advantage import stage as advantage
from prmflow.components.data import io, schema
from prmflow.components.ppo import stage as ppo
from prmflow.components.ppo.minibatches import dr_grpo_length
from prmflow.errors import ConfigError
from prmflow.tracking import TrackingConfig

OFF = TrackingConfig(enabled=False)


def _rollouts(path, lengths, config: dict | None):
    rows = [{"prompt_id": "p0", "sample_idx": i, "iteration": 0, "prompt_ids": [1, 2], "response_ids": [3] * n,
             "outcome_reward": float(i % 2)} for i, n in enumerate(lengths)]
    with schema.DatasetWriter(path, "rollouts", config=config) as w:
        w.write(pa.Table.from_pylist(rows))


def _advantages(tmp_path, name: str, budget: int | None) -> str:
    d = tmp_path / name
    _rollouts(d / "rollouts", [3, 7, 5, 2], {"sampling": {"max_new_tokens": budget}} if budget else {})
    advantage.run(advantage.Config(input=str(d / "rollouts"), output=str(d / "advantages"), estimator="grpo",
                                   tracking=OFF))
    return str(d / "advantages")


def test_the_constant_is_the_rollouts_generation_budget_not_the_longest_response(tmp_path):
    adv = _advantages(tmp_path, "a", 48)
    assert io.read_manifest(adv)["max_new_tokens"] == 48  # the advantage stage passes the budget on
    cfg = ppo.Config(input=adv, loss_agg="seq-mean-token-sum-norm")
    assert dr_grpo_length(cfg) == 48  # the longest response is 7
    assert dr_grpo_length(ppo.Config(input=adv, loss_agg="seq-mean-token-sum-norm", drgrpo_max_len=64)) == 64


def test_a_budget_nobody_recorded_is_refused_naming_the_key(tmp_path):
    adv = _advantages(tmp_path, "b", None)  # rollouts from elsewhere: no sampling config in their manifest
    assert io.read_manifest(adv)["max_new_tokens"] is None
    with pytest.raises(ConfigError, match="drgrpo_max_len"):
        dr_grpo_length(ppo.Config(input=adv, loss_agg="seq-mean-token-sum-norm"))
    assert dr_grpo_length(ppo.Config(input=adv, loss_agg="token-mean")) == 0  # the other modes do not read it
