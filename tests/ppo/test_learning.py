"""The RL loop learns: rollout -> advantage -> PPO, repeated, raises the arithmetic task's reward.

The start is `mixed_sft_policy`: SFT on demonstrations of which half state the bare answer with no
working, so the policy answers directly about half the time, and its bare answers are right far less
often than its worked solutions. Nothing in the loop is told that; the verifier's 0/1 reward and
group-normalized advantages have to find it. The judge is independent of the training batches: the
SFT policy and the trained one sample the same unseen prompts with the same sampler seed.

Two reward paths learn it: the outcome-only `grpo` (the verifier's 0/1 at the last token) and the
process path `grpo_process` with the oracle PRM (`prm: oracle`: the exact checker's step labels as
the step rewards, no outcome reward at all), the path the quickstart takes with a trained PRM.
"""

from __future__ import annotations

import pytest

from prmflow.components.advantage import stage as advantage
from prmflow.components.common import config, schema
from prmflow.components.ppo import stage as ppo
from prmflow.components.rollout import stage as rollout

OFF = {"enabled": False}
PROMPTS, SAMPLES, ITERATIONS = 32, 8, 3


def sample(policy, out, iteration: int, prm: str = "") -> tuple[float, float]:
    """(mean outcome reward, share of responses with at least one worked step) of the policy's rollouts."""
    m = rollout.run(config.build(rollout.Config, {
        "policy": str(policy), "output": str(out), "num_prompts": PROMPTS, "n_samples": SAMPLES, "seed": 0,
        "iteration": iteration, "sampling.max_new_tokens": 48, "log_samples": 0, "prm": prm, "tracking": OFF}))
    responses = schema.read_dataset(out, "rollouts").column("response").to_pylist()
    assert len(responses) == PROMPTS * SAMPLES
    return m["rollout/reward_mean"], sum("=" in r for r in responses) / len(responses)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("estimator, prm", [("grpo", ""), ("grpo_process", "oracle")], ids=["outcome", "oracle-process"])
def test_rl_loop_raises_the_reward_with_a_fixed_seed(mixed_sft_policy, tmp_path, estimator, prm):
    policy, optimizer, train_rewards = mixed_sft_policy, "", []
    for k in range(ITERATIONS):
        reward, _ = sample(policy, tmp_path / f"rollouts{k}", k, prm)
        train_rewards.append(reward)
        advantage.run(config.build(advantage.Config, {
            "input": str(tmp_path / f"rollouts{k}"), "output": str(tmp_path / f"adv{k}"), "iteration": k,
            "estimator": estimator, "tracking": OFF}))
        ppo.run(config.build(ppo.Config, {
            "policy": str(policy), "input": str(tmp_path / f"adv{k}"), "output": str(tmp_path / f"ppo{k}"),
            "iteration": k, "rl_iterations": ITERATIONS, "epochs": 2, "minibatch_size": 64, "micro_batch_size": 32,
            "optim.lr": 1e-4, "optimizer_state": optimizer, "engine": {"backend": "torch"}, "tracking": OFF}))
        policy, optimizer = tmp_path / f"ppo{k}" / "policy", str(tmp_path / f"ppo{k}" / "optimizer")

    # unseen prompts (the next iteration's), the same sampler seed for both policies
    before, worked_before = sample(mixed_sft_policy, tmp_path / "judge-sft", ITERATIONS)
    after, worked_after = sample(policy, tmp_path / "judge-rl", ITERATIONS)
    report = f"train rewards {train_rewards}; judge: SFT {before:.3f} ({worked_before:.0%} worked) -> RL {after:.3f} ({worked_after:.0%} worked)"
    print(report)
    assert after >= before + 0.10, report
    assert worked_after > worked_before + 0.2, report  # what it learned: to work the steps out
    assert train_rewards[-1] > train_rewards[0], report
