"""Step data: exact arithmetic labels, the stepwise file format, and every bad input (nothing written)."""

import itertools
import json
import math
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings, strategies as st

from prmflow.components import config
from prmflow.errors import DataError
from prmflow.tasks import arithmetic
from prmflow.components.scoring.prm_metrics import roc_auc, step_metrics
from prmflow.components.models.prm_model import PRM
from prmflow.components.prm import step_examples as data, stage

GOOD = {"prompt": "Compute left to right: 7+5*3\n", "steps": ["7+5=12", "12*3=36", "answer: 36"], "labels": [1, 1, 1]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_arithmetic_examples_follow_the_exact_checker():
    cfg = arithmetic.ArithmeticConfig()
    examples = data.arithmetic_examples(40, seed=3, split="train", cfg=cfg, negatives_per_problem=2)
    assert len(examples) == 120
    n_wrong = 0
    for ex in examples:
        # independent check: recompute every step from the prompt
        start, ops = arithmetic.parse_problem(ex.prompt)
        value, ok, want = start, True, []
        for k, s in enumerate(ex.steps):
            if k < len(ops):
                op, b = ops[k]
                nxt = value + b if op == "+" else value - b if op == "-" else value * b
                ok = ok and s == f"{value}{op}{b}={nxt}"
                value = nxt
            else:
                ok = ok and s == f"answer: {value}"
            want.append(1.0 if ok else 0.0)
        assert ex.labels == want
        n_wrong += min(want) == 0
        assert want == sorted(want, reverse=True)  # 1...1 0...0: everything after the first error is wrong
    assert n_wrong >= 75  # the negatives really are wrong (a corruption can never be right)


def test_corrupt_solutions_are_labelled_from_the_corrupted_step():
    rng = random.Random(0)
    for p in arithmetic.generate(30, seed=1):
        response, k = arithmetic.corrupt(p, rng)
        ex = data.from_records([arithmetic_record(p)], [response])[0]
        assert ex.labels == [1.0] * k + [0.0] * (len(ex.steps) - k)


def arithmetic_record(p):
    from prmflow.tasks import PromptRecord

    return PromptRecord(p.prompt_id, p.prompt, p.answer, p.solution)


def test_stepwise_jsonl_and_parquet_round_trip(tmp_path):
    soft = {**GOOD, "labels": [1, 0.5, 0.25]}
    from_response = {"prompt": GOOD["prompt"], "response": "7+5=12\n\n12*3=36\nanswer: 36", "labels": [1, 1, 0]}
    got = data.load_stepwise(_write(tmp_path / "s.jsonl", [GOOD, soft, from_response]))
    assert [e.labels for e in got] == [[1.0, 1.0, 1.0], [1.0, 0.5, 0.25], [1.0, 1.0, 0.0]]
    assert got[2].steps == GOOD["steps"]
    pq.write_table(pa.Table.from_pylist([GOOD, soft]), tmp_path / "s.parquet")
    got_pq = data.load_stepwise(tmp_path / "s.parquet")
    assert [(e.steps, e.labels) for e in got_pq] == [(e.steps, e.labels) for e in got[:2]]


BAD_ROWS = {
    "label_count": ({**GOOD, "labels": [1, 1]}, r"line 2: 2 labels for 3 steps"),
    "step_with_separator": ({**GOOD, "steps": ["7+5=12\n12*3=36", "answer: 36"], "labels": [1, 1]},
                            r"line 2: step 0 .* contains the step separator"),
    "empty_step": ({**GOOD, "steps": ["7+5=12", "  ", "answer: 36"]}, r"line 2: step 1 is empty"),
    "label_above_one": ({**GOOD, "labels": [1, 1.5, 1]}, r"line 2: label 1 is 1.5; labels must be numbers in \[0, 1\]"),
    "label_negative": ({**GOOD, "labels": [1, -0.1, 1]}, r"line 2: label 1 is -0.1"),
    "label_not_a_number": ({**GOOD, "labels": [1, "yes", 1]}, r"line 2: label 1 is 'yes'"),
    "no_steps": ({"prompt": "p", "steps": [], "labels": []}, r"line 2: no steps"),
    "steps_a_string": ({**GOOD, "steps": "7+5=12", "labels": [1]}, r"line 2: 'steps' is a str \('7\+5=12'\), not a list"),
    "no_prompt": ({"steps": ["a"], "labels": [1]}, r"line 2: no 'prompt'"),
    "not_json": ("{nope", r"line 2: not valid JSON"),
    "no_labels": ({"prompt": GOOD["prompt"], "steps": GOOD["steps"]}, r"line 2: no labels for 3 steps"),
    "label_nan": ({**GOOD, "labels": [1, float("nan"), 1]}, r"line 2: label 1 is nan"),
    # a response whose steps are not separated reads as one step: the labels no longer fit
    "response_without_separator": ({"prompt": GOOD["prompt"], "response": "7+5=12 12*3=36 answer: 36", "labels": [1, 1, 1]},
                                   r"line 2: 3 labels, but its response cut at the step separator '\\n' has 1 step"),
    "response_empty": ({"prompt": GOOD["prompt"], "response": " \n ", "labels": []}, r"line 2: no steps"),
    # Python 3.11's decoder gives up on this depth (RecursionError), 3.12's parses it into a list
    "too_deep": ("[" * 5000 + "]" * 5000, r"line 2: (JSON nested too deeply|expected a JSON object, got list)"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_name_file_and_line_and_nothing_is_written(tmp_path, case, no_tracking):
    row, message = BAD_ROWS[case]
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(DataError, match=message) as err:
        data.load_stepwise(path)
    assert str(path) in str(err.value)
    out = tmp_path / "prm"
    cfg = config.load(stage.Config, overrides={"task": str(path), "output": str(out), "eval_size": 1,
                                                 "backbone": "tiny-llama", **no_tracking})
    with pytest.raises(DataError, match=message):
        stage.run(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]  # no output, no temporaries


def test_non_utf8_line_is_named(tmp_path, no_tracking):
    path = tmp_path / "steps.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"steps.jsonl, line 2: not UTF-8 text"):
        stage.run(config.load(stage.Config, overrides={"task": str(path), "output": str(tmp_path / "prm"),
                                                       "eval_size": 1, "backbone": "tiny-llama", **no_tracking}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]


def test_bad_eval_file_fails_before_training(tmp_path, no_tracking, monkeypatch):
    """A bad held-out file is found before any model is loaded or step is trained."""
    bad = _write(tmp_path / "eval.jsonl", [GOOD, {**GOOD, "labels": [1, 1]}])
    monkeypatch.setattr(PRM, "load", lambda *a, **k: pytest.fail("the model was loaded before the data was checked"))
    with pytest.raises(DataError, match=r"eval.jsonl, line 2: 2 labels for 3 steps"):
        stage.run(config.load(stage.Config, overrides={"eval_task": str(bad), "output": str(tmp_path / "prm"),
                                                       "num_prompts": 8, "backbone": "tiny-llama", **no_tracking}))
    assert not (tmp_path / "prm").exists()


def test_empty_dataset_and_parquet_row_are_named(tmp_path, no_tracking):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl' is empty"):
        stage.run(config.load(stage.Config, overrides={"task": str(tmp_path / "empty.jsonl"),
                                                       "output": str(tmp_path / "prm"),
                                                       "backbone": "tiny-llama", **no_tracking}))
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "labels": [1, 0, 2]}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet, row 1: label 2 is 2"):
        data.load_stepwise(tmp_path / "bad.parquet")
    assert not (tmp_path / "prm").exists()


def test_bce_on_step_positions_only_hard_and_soft():
    examples = [data.Tokenized([5, 6, 7, 8], [1, 3], [1.0, 0.25], None), data.Tokenized([5, 6], [1], [0.0], None)]
    b = data.collate(examples, pad_id=0)
    z = torch.randn(2, 4)
    z[1, 2:] = float("nan")  # padding: must never enter the loss
    loss, n = data.step_bce(z, b["targets"], b["step_mask"])
    # slow reference, written out per step
    want = 0.0
    for i, e in enumerate(examples):
        for pos, y in zip(e.step_ends, e.labels):
            p = 1 / (1 + math.exp(-float(z[i, pos])))
            want += -(y * math.log(p) + (1 - y) * math.log(1 - p))
    assert n == 3 and float(loss) == pytest.approx(want, rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=25))
def test_roc_auc_matches_pairwise_count(pairs):
    scores = [float(s) for s, _ in pairs]
    labels = [int(y) for _, y in pairs]
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    got = roc_auc(scores, labels)
    if not pos or not neg:
        assert math.isnan(got)
        return
    want = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert got == pytest.approx(want)


def test_first_error_recall_and_accuracy():
    labels = [[1, 1, 0, 0], [1, 0], [1, 1]]
    scores = [[0.9, 0.8, 0.1, 0.7], [0.2, 0.1], [0.9, 0.6]]
    m = step_metrics(labels, scores)
    assert m["eval/first_error_recall"] == 0.5  # found in the first solution; the second flagged too early
    assert m["eval/step_accuracy"] == pytest.approx(6 / 8)
