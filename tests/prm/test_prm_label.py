"""prm-label (Math-Shepherd): hard = any continuation reaches the answer, soft = the fraction; the
agreement with the exact checker is reported; the output is the stepwise format the prm stage reads."""

from __future__ import annotations

import json
import random
import re

import pytest

from prmflow.components.common import config, modeling, tasks
from prmflow.components.common.errors import ModelLoadError
from prmflow.components.common.tasks import arithmetic
from prmflow.components.prm import data, label


def test_estimate_labels_any_and_fraction():
    hard, soft = label.estimate_labels([[0, 0, 1, 0], [0, 0, 0, 0]], final_correct=0.0)
    assert hard == [1.0, 0.0, 0.0] and soft == [0.25, 0.0, 0.0]
    assert label.estimate_labels([[1, 1]], 1.0) == ([1.0, 1.0], [1.0, 1.0])


def test_step_prefixes_keep_the_text_between_steps():
    assert label.step_prefixes("a=1\n\nb=2\nanswer: 2", "\n") == ["a=1\n\n", "a=1\n\nb=2\n"]
    assert label.step_prefixes("answer: 2", "\n") == []


def _perfect_completion(context: str) -> str:
    """The exact rest of the solution from the value the prefix's last step reached."""
    prompt, _, prefix = context.partition("\n")
    start, ops = arithmetic.parse_problem(prompt + "\n")
    done = [s for s in prefix.split("\n") if s.strip()]
    value = int(re.search(r"=(-?\d+)\s*$", done[-1]).group(1))
    rest, value = arithmetic.solve(value, ops[len(done):])
    return "\n".join(rest)


def test_with_a_perfect_completer_labels_equal_the_exact_checker(tmp_path, monkeypatch):
    """Independent reference: if every continuation computes correctly, a prefix reaches the answer
    exactly when it is right so far, so Math-Shepherd labels must equal arithmetic.step_labels."""
    model, tok = modeling.build_tiny_model()
    modeling.save_pretrained(model, tok, tmp_path / "policy")
    rng = random.Random(0)
    problems = {p.prompt: p for p in arithmetic.generate(12, seed=0, split="train")}
    contexts_seen = []

    def fake_generate(model, tokenizer, prompts, *args, **kwargs):
        contexts_seen.extend(prompts)
        return [(problems[c].solution if rng.random() < 0.4 else arithmetic.corrupt(problems[c], rng)[0])
                if c in problems else _perfect_completion(c) for c in prompts]

    monkeypatch.setattr(label, "generate_texts", fake_generate)
    cfg = config.load(label.Config, overrides={"policy_path": str(tmp_path / "policy"), "output": str(tmp_path / "labels"),
                                               "prompts": 12, "samples_per_prompt": 3, "completions": 2,
                                               "tracking.enabled": False})
    metrics = label.run(cfg)
    assert metrics["label/agreement"] == 1.0 and metrics["label/false_positive_rate"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 36
    for row in rows:
        assert row["labels"] == [float(y) for y in arithmetic.step_labels(row["prompt"], "\n".join(row["steps"]))]
    # every continuation started from the prompt plus a whole-step prefix of one of the solutions
    prefixes = [c for c in contexts_seen if c not in problems]
    assert len(prefixes) == 2 * sum(len(r["steps"]) - 1 for r in rows)
    assert all(c.endswith("\n") for c in prefixes)


def test_real_policy_labels_are_consistent_and_train_ready(tmp_path, sft_policy):
    cfg = config.load(label.Config, overrides={"policy_path": str(sft_policy), "output": str(tmp_path / "labels"),
                                               "prompts": 6, "samples_per_prompt": 2, "completions": 3,
                                               "max_new_tokens": 40, "tracking.enabled": False})
    metrics = label.run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    exact, hard_all = [], []
    for row in rows:
        rec = tasks.PromptRecord(row["id"], row["prompt"], row["answer"])
        assert row["hard_labels"] == [1.0 if s > 0 else 0.0 for s in row["soft_labels"]]
        assert all(abs(s * 3 - round(s * 3)) < 1e-9 for s in row["soft_labels"])  # a fraction of 3 continuations
        assert row["labels"] == row["hard_labels"]
        # the last step is the solution's own final answer
        assert row["hard_labels"][-1] == tasks.verify(rec, "\n".join(row["steps"]))
        exact += arithmetic.step_labels(row["prompt"], "\n".join(row["steps"]))
        hard_all += row["hard_labels"]
    agreement = sum(e == h for e, h in zip(exact, hard_all)) / len(exact)
    assert metrics["label/agreement"] == pytest.approx(agreement)
    manifest = json.loads((tmp_path / "labels" / "manifest.json").read_text())
    assert manifest["metrics"]["label/agreement"] == pytest.approx(agreement) and manifest["rows"] == len(rows)
    loaded = data.load_stepwise(tmp_path / "labels")  # the prm stage reads the directory as its task
    assert [e.steps for e in loaded] == [r["steps"] for r in rows]
    assert label.run(cfg) == metrics  # a finished output is not redone


def test_missing_policy_writes_nothing(tmp_path):
    cfg = config.load(label.Config, overrides={"policy_path": str(tmp_path / "nope"), "output": str(tmp_path / "labels"),
                                               "tracking.enabled": False})
    with pytest.raises(ModelLoadError, match="policy_path"):
        label.run(cfg)
    assert not (tmp_path / "labels").exists()
