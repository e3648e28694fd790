"""The RL loop learns: rollout -> advantage -> PPO, repeated, raises the arithmetic task's reward.

The start is `mixed_sft_policy`: SFT on demonstrations of which half state the bare answer with no
working, so the policy answers directly about half the time, and its bare answers are right far less
often than its worked solutions. Nothing in the loop is told that; the verifier's 0/1 reward and
group-normalized advantages have to find it. The judge is independent of the training batches: the
SFT policy and the trained one sample the same unseen prompts with the same sampler seed.

Two reward paths learn it: the outcome-only `grpo` (the verifier's 0/1 at the last token) and the
process path `grpo_process` with the oracle PRM (`prm: oracle`: the exact checker's step labels as
the step rewards, no outcome reward at all), the path the quickstart takes with a trained PRM
(that one: tests/prm/test_prm_recipe.py, in the heavy group, since it trains a PRM first).
"""

from __future__ import annotations

import pytest
from rl_loop import assert_learned, rl_loop


@pytest.mark.slow  # its warm-up policy alone trains for ~4 min
@pytest.mark.timeout(900)
@pytest.mark.parametrize("estimator, prm", [("grpo", ""), ("grpo_process", "oracle")], ids=["outcome", "oracle-process"])
def test_rl_loop_raises_the_reward_with_a_fixed_seed(mixed_sft_policy, tmp_path, estimator, prm):
    assert_learned(rl_loop(mixed_sft_policy, tmp_path, estimator, prm))
