"""Best-of-N: aggregations, majority vote and the random pick against hand-computed references, and
the sampling + scoring pipeline run end to end with the shared SFT policy."""

from __future__ import annotations

import math
import random

import pytest

from prmflow import tasks
from prmflow.tasks import arithmetic
from prmflow.components.scoring import bestofn
from prmflow.errors import ConfigError


def _record(expr="7+5*3", answer="36"):
    return tasks.PromptRecord("p", f"Compute left to right: {expr}\n", answer)


@pytest.mark.parametrize("how, want", [("min", 0.2), ("product", 0.9 * 0.2 * 0.8), ("last", 0.8), ("mean", 1.9 / 3)])
def test_aggregations(how, want):
    assert bestofn.aggregate([0.9, 0.2, 0.8], how) == pytest.approx(want)
    assert bestofn.aggregate([], how) == -math.inf


def test_score_table_against_hand_counts():
    rec = _record()
    right, wrong = "7+5=12\n12*3=36\nanswer: 36", "7+5=12\n12*3=35\nanswer: 35"
    cands = [[wrong, right, wrong, "no answer at all"]]
    scores = [[[0.9, 0.1, 0.1], [0.8, 0.7, 0.9], [0.9, 0.6, 0.95], []]]
    m = bestofn.score_table([rec], cands, scores, [wrong], ["min", "last", "mean", "product"])
    assert m["eval/bon_min"] == 1.0  # 0.7 is the best weakest step
    assert m["eval/bon_last"] == 0.0  # the confident wrong one
    assert m["eval/majority"] == 0.0  # 35 twice beats 36 once
    assert m["eval/random"] == 0.25 and m["eval/pass1"] == 0.0 and m["eval/pass_at_n"] == 1.0


def test_majority_vote_groups_answers_as_the_grader_reads_them():
    """A dataset row: three forms of 3/4 outvote two of 5 only when the vote uses the grader's answer."""
    rec = tasks.PromptRecord("q", "What is 3 divided by 4?", "\\frac{3}{4}", source="dataset")
    cands = [["so \\boxed{\\frac{3}{4}}", "answer: 0.75", "#### 3/4", "\\boxed{5}", "#### 5"]]
    m = bestofn.score_table([rec], cands, [[[0.5]] * 5], [cands[0][0]], ["min"])
    assert m["eval/majority"] == 1.0 and m["eval/pass1"] == 1.0 and m["eval/random"] == pytest.approx(0.6)


def test_ties_count_as_a_uniform_random_choice():
    rec = _record()
    right, wrong = "7+5=12\n12*3=36\nanswer: 36", "7+5=12\n12*3=35\nanswer: 35"
    m = bestofn.score_table([rec], [[right, wrong, wrong, right]], [[[0.5]] * 4], [right], ["min"])
    assert m["eval/bon_min"] == 0.5 and m["eval/majority"] == 0.5 and m["eval/random"] == 0.5


def test_perfect_prm_reaches_pass_at_n_and_constant_prm_equals_random():
    """Independent references: step scores from the exact checker pick a right solution whenever one
    exists; a PRM that says the same thing about every solution is a random pick."""
    rng = random.Random(0)
    records, cands = [], []
    for p in arithmetic.generate(30, seed=2, split="test"):
        rec = tasks.PromptRecord(p.prompt_id, p.prompt, p.answer, p.solution)
        options = [p.solution] + [arithmetic.corrupt(p, rng)[0] for _ in range(3)]
        records.append(rec)
        cands.append(rng.sample(options, k=rng.randint(1, 4)))
    exact = [[[float(y) for y in arithmetic.step_labels(r.prompt, c)] for c in cs] for r, cs in zip(records, cands)]
    constant = [[[0.5] * len(arithmetic.split_steps(c)) for c in cs] for cs in cands]
    greedy = [cs[0] for cs in cands]
    perfect = bestofn.score_table(records, cands, exact, greedy, ["min", "product", "last", "mean"])
    flat = bestofn.score_table(records, cands, constant, greedy, ["min", "product", "last", "mean"])
    for how in ("min", "product", "last", "mean"):
        assert perfect[f"eval/bon_{how}"] == pytest.approx(perfect["eval/pass_at_n"])
    assert flat["eval/bon_min"] == pytest.approx(flat["eval/random"])
    assert perfect["eval/pass_at_n"] > perfect["eval/random"]


def test_unknown_aggregation_is_a_config_error():
    with pytest.raises(ConfigError, match=r"bon.aggregations has \['median'\]; known:"):
        bestofn.BestOfNConfig(aggregations=["median"])


def test_stage_learns_and_adds_best_of_n_to_a_finished_prm(tmp_path, sft_policy, capsys):
    """A short training run already ranks held-out steps well above chance; re-running the finished
    config with bon.policy adds best-of-N to it without retraining, with the baselines computed
    on the same samples."""
    import json

    from prmflow.components import config
    from prmflow.components.models import modeling
    from prmflow.components.sampling.generation import generate_texts
    from prmflow.components.prm import stage

    base = {"output": str(tmp_path / "prm"), "backbone": "tiny-llama", "extra_layers": 0, "train_layers": 0,
            "num_prompts": 400, "eval_size": 60, "max_steps": 40, "micro_batch_size": 16, "optim.warmup_steps": 5,
            "optim.lr": 3e-3,
            "eval_every": 0, "save_every": 0, "engine.backend": "torch", "tracking.enabled": False}
    trained = stage.run(config.load(stage.Config, overrides=base))
    assert trained["eval/step_auc"] >= 0.6 and trained["train/loss"] < math.log(2)  # untrained: 0.5 and log 2
    weights_before = (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns

    bon = {"bon.policy": str(sft_policy), "bon.num_prompts": 12, "bon.n_samples": 4, "bon.sampling.max_new_tokens": 40}
    m = stage.run(config.load(stage.Config, overrides={**base, **bon}))
    assert "best-of-4" in capsys.readouterr().out
    assert (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns == weights_before  # not retrained
    manifest = json.loads((tmp_path / "prm" / "manifest.json").read_text())
    assert manifest["metrics"]["eval/bon_min"] == m["eval/bon_min"]
    assert manifest["metrics"]["eval/step_auc"] == trained["eval/step_auc"]
    for how in ("min", "product", "last", "mean"):
        assert 0.0 <= m[f"eval/bon_{how}"] <= m["eval/pass_at_n"]
    assert m["eval/random"] <= m["eval/pass_at_n"] and 0 < m["perf/prm_tokens_per_s"]
    # pass1 is the policy's greedy accuracy on the same prompts, recomputed here
    records = bestofn.load_prompts(bestofn.BestOfNConfig(num_prompts=12))
    policy, tok = modeling.load_causal_lm(sft_policy)
    greedy = generate_texts(policy, tok, [r.prompt for r in records], 40)
    assert m["eval/pass1"] == pytest.approx(sum(tasks.verify(r, g) for r, g in zip(records, greedy)) / 12)
    assert stage.run(config.load(stage.Config, overrides={**base, **bon})) == manifest["metrics"]  # now complete


def test_the_policy_samples_where_and_in_the_dtype_the_config_says(monkeypatch):
    # evaluate and the prm stage's best-of-N sample with this loader: on a GPU pod the policy must leave the
    # CPU (it once stayed there: sampling a 7B policy on CPU in float32), in bfloat16 unless told otherwise
    from prmflow.components.models import modeling

    monkeypatch.setattr(modeling.torch.cuda, "is_available", lambda: True)
    assert modeling.placement() == (modeling.torch.device("cuda"), "bfloat16")
    assert modeling.placement("cuda:1", "float32") == (modeling.torch.device("cuda", 1), "float32")
    monkeypatch.setattr(modeling.torch.cuda, "is_available", lambda: False)
    assert modeling.placement() == (modeling.torch.device("cpu"), "float32")
    # "meta" stands in for a GPU here: a real device the weights must be moved to
    cfg = bestofn.BestOfNConfig(device="meta", dtype="bfloat16")
    policy = bestofn.open_sampler("tiny-llama", cfg).model
    assert {(p.device.type, p.dtype) for p in policy.parameters()} == {("meta", modeling.torch.bfloat16)}
