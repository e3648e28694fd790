"""A fixed-seed RL loop (rollout -> advantage -> PPO, repeated) and its independent judge, shared by the
learning tests of the outcome, oracle-PRM and trained-PRM reward paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.components.data import schema
from prmflow.components.ppo import stage as ppo
from prmflow.components.rollout import stage as rollout

OFF = {"enabled": False}
PROMPTS, SAMPLES, ITERATIONS = 32, 8, 3


def sample(policy, out: Path, iteration: int, prm: str = "") -> tuple[float, float]:
    """(mean outcome reward, share of responses with at least one worked step) of the policy's rollouts."""
    m = rollout.run(config.build(rollout.Config, {
        "policy": str(policy), "output": str(out), "num_prompts": PROMPTS, "n_samples": SAMPLES, "seed": 0,
        "iteration": iteration, "sampling.max_new_tokens": 48, "log_samples": 0, "prm": prm, "tracking": OFF}))
    responses = schema.read_dataset(out, "rollouts").column("response").to_pylist()
    assert len(responses) == PROMPTS * SAMPLES
    return m["rollout/reward_mean"], sum("=" in r for r in responses) / len(responses)


@dataclass
class Outcome:
    train_rewards: list[float]
    before: float          # the judge: SFT policy's mean outcome reward on unseen prompts
    after: float           # the trained policy's, same prompts and sampler seed
    worked_before: float   # share of responses that work at least one step out
    worked_after: float

    def __str__(self) -> str:
        return (f"train rewards {[round(r, 3) for r in self.train_rewards]}; judge: SFT {self.before:.3f} "
                f"({self.worked_before:.0%} worked) -> RL {self.after:.3f} ({self.worked_after:.0%} worked)")


def rl_loop(start, work: Path, estimator: str, prm: str = "") -> Outcome:
    """ITERATIONS on-policy iterations from `start` with `estimator` (and `prm`: a PRM directory, 'oracle' or
    none), then both policies sample the next iteration's unseen prompts with the same seed."""
    policy, optimizer, train_rewards = start, "", []
    for k in range(ITERATIONS):
        reward, _ = sample(policy, work / f"rollouts{k}", k, prm)
        train_rewards.append(reward)
        advantage.run(config.build(advantage.Config, {
            "input": str(work / f"rollouts{k}"), "output": str(work / f"adv{k}"), "iteration": k,
            "estimator": estimator, "tracking": OFF}))
        ppo.run(config.build(ppo.Config, {
            "policy": str(policy), "input": str(work / f"adv{k}"), "output": str(work / f"ppo{k}"),
            "iteration": k, "rl_iterations": ITERATIONS, "epochs": 2, "minibatch_size": 64, "micro_batch_size": 32,
            "optim.lr": 1e-4, "optimizer_state": optimizer, "engine": {"backend": "torch"}, "tracking": OFF}))
        policy, optimizer = work / f"ppo{k}" / "policy", str(work / f"ppo{k}" / "optimizer")
    before, worked_before = sample(start, work / "judge-sft", ITERATIONS)
    after, worked_after = sample(policy, work / "judge-rl", ITERATIONS)
    return Outcome(train_rewards, before, after, worked_before, worked_after)


def assert_learned(out: Outcome) -> None:
    """What every reward path must do from the mixed policy: a higher judged reward, by working the steps out."""
    report = str(out)
    print(report)
    assert out.after >= out.before + 0.10, report
    assert out.worked_after > out.worked_before + 0.2, report  # what it learned: to work the steps out
    assert out.train_rewards[-1] > out.train_rewards[0], report
