"""The PRM recipe, shortened to what CI can afford, ranks steps and picks solutions well above chance.

The documented recipe (configs/prm-arithmetic-cpu.yaml, 6000 steps, ~15 min) reaches step AUC ~0.9;
CI trains the same recipe for 400 steps on the shared SFT policy's backbone (measured: held-out step
AUC 0.76) and reranks 8 samples of the quickstart's mixed policy (half bare answers, far more often
wrong) on 100 held-out prompts (measured: best-of-8 by mean step score 0.69 against a random pick's
0.46; picking the lowest-scored sample instead gave 0.19). The margin asserted below is one that a
selector picking at random, or the worst sample, cannot meet: both are at or below `eval/random`.
Then the RL loop of tests/ppo/test_learning.py runs on this PRM's step rewards alone (grpo_process).
"""

import pytest
from rl_loop import assert_learned, rl_loop

from prmflow.components import config
from prmflow.components.prm import stage


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_short_recipe_ranks_steps_and_best_of_n_beats_random_by_a_margin(tmp_path, sft_policy, mixed_sft_policy):
    m = stage.run(config.load(stage.Config, overrides={
        "output": str(tmp_path / "prm"), "backbone": str(sft_policy), "extra_layers": 2, "train_layers": 2,
        "num_prompts": 6000, "negatives_per_problem": 2, "eval_size": 300, "max_steps": 400, "micro_batch_size": 32,
        "optim.lr": 1e-3, "eval_every": 0, "save_every": 0, "engine.backend": "torch", "tracking.enabled": False,
        "bon.policy": str(mixed_sft_policy), "bon.num_prompts": 100, "bon.n_samples": 8,
        "bon.sampling.max_new_tokens": 40}))
    report = {k: round(v, 3) for k, v in m.items() if k.startswith("eval/")}
    print(report)
    assert m["eval/step_auc"] >= 0.72, report
    assert m["eval/bon_mean"] >= m["eval/random"] + 0.10, report
    assert m["eval/pass_at_n"] > m["eval/bon_mean"] - 1e-9, report

    # the quickstart's RL path with this trained PRM: process-supervised GRPO on its step rewards alone (no
    # outcome reward) must raise the judged outcome reward, as the oracle PRM does in tests/ppo/test_learning.py
    assert_learned(rl_loop(mixed_sft_policy, tmp_path / "rl", "grpo_process", str(tmp_path / "prm")))
