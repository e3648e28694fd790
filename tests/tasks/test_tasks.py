import json
import re
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prmflow import tasks
from prmflow.errors import ConfigError, DataError
from prmflow.tasks import arithmetic as ar


def test_generation_is_deterministic_and_solutions_are_right():
    a = ar.generate(50, seed=1)
    assert [p.prompt for p in a] == [p.prompt for p in ar.generate(50, seed=1)]
    assert [p.prompt for p in a] != [p.prompt for p in ar.generate(50, seed=2)]
    for p in a:
        value = p.start
        for op, b in p.ops:  # evaluate independently, left to right
            value = eval(f"{value}{op}{b}")
        assert p.answer == str(value)
        assert ar.verify(p.solution, p.answer) == 1.0
        assert ar.first_error(p.prompt, p.solution) is None
        assert len(p.steps) == len(p.ops) + 1


def test_direct_answer_frac_keeps_the_problems_and_drops_the_working_of_that_share():
    plain = ar.generate(2000, seed=3)
    mixed = ar.generate(2000, seed=3, cfg=ar.ArithmeticConfig(direct_answer_frac=0.3))
    assert [p.prompt for p in mixed] == [p.prompt for p in plain]  # the same problems, in the same order
    bare = [m for m in mixed if len(m.steps) == 1]
    assert 0.27 < len(bare) / len(mixed) < 0.33
    for m, p in zip(mixed, plain):
        assert m.solution in (p.solution, f"answer: {p.answer}")  # the answer line alone, or untouched
        assert ar.verify(m.solution, m.answer) == 1.0
    again = ar.generate(2000, seed=3, cfg=ar.ArithmeticConfig(direct_answer_frac=0.3))
    assert [m.solution for m in again] == [m.solution for m in mixed]
    assert all(len(m.steps) == 1 for m in ar.generate(50, seed=3, cfg=ar.ArithmeticConfig(direct_answer_frac=1.0)))
    with pytest.raises(ConfigError, match="direct_answer_frac=1.5 must be in"):
        ar.ArithmeticConfig(direct_answer_frac=1.5)


def test_the_prompt_prefix_changes_only_the_prompt_text_and_the_checker_reads_any_prefix():
    plain = ar.generate(300, seed=4, split="eval")
    bare = ar.generate(300, seed=4, split="eval", cfg=ar.ArithmeticConfig(prompt_prefix=""))
    assert plain[0].prompt.startswith("Compute left to right: ")
    for p, b in zip(plain, bare):  # the same problems, ids, answers and solutions; the prompt is the expression
        assert (b.prompt_id, b.answer, b.solution) == (p.prompt_id, p.answer, p.solution)
        assert b.prompt == p.prompt[len("Compute left to right: "):]
        assert ar.first_error(b.prompt, b.solution) is None
        wrong, k = ar.corrupt(b, random.Random(1))
        assert ar.first_error(b.prompt, wrong) == k == ar.first_error(p.prompt, wrong)
    recs = tasks.load("arithmetic", "eval", 5, 4, prompt_prefix="Solve: ")
    assert [r.prompt for r in recs] == ["Solve: " + p.prompt[len("Compute left to right: "):] for p in plain[:5]]
    for bad in ("x 7", "a+", "two\nlines: "):
        with pytest.raises(ConfigError, match="prompt_prefix"):
            ar.ArithmeticConfig(prompt_prefix=bad)


def test_splits_are_disjoint_whatever_the_seed():
    train = {p.prompt for p in ar.generate(1500, seed=0, split="train")}
    held = {p.prompt for p in ar.generate(150, seed=7, split="eval")} | {p.prompt for p in ar.generate(150, seed=3, split="test")}
    assert not train & held


def test_verifier():
    assert ar.verify("1+2=3\nanswer: 3", "3") == 1.0
    assert ar.verify("1+2=3\nanswer: 4", "3") == 0.0
    assert ar.verify("1+2=3", "3") == 0.0  # no answer line: a format error
    assert ar.extract_answer("junk\nanswer: -5\n") == "-5"


def test_first_error_finds_the_corrupted_step():
    rng = random.Random(0)
    for p in ar.generate(100, seed=4):
        bad, k = ar.corrupt(p, rng)
        assert ar.first_error(p.prompt, bad) == k
        labels = ar.step_labels(p.prompt, bad)
        assert labels == [1] * k + [0] * (len(labels) - k)
        assert ar.verify(bad, p.answer) == 0.0


def test_first_error_on_truncated_and_garbled_responses():
    p = ar.Problem("x", "Compute left to right: 3+4*2\n", "14", 3, [("+", 4), ("*", 2)])
    assert ar.first_error(p.prompt, "3+4=7") == 1  # stopped early
    assert ar.first_error(p.prompt, "3+4=7\n7*2=14\nanswer: 14") is None
    assert ar.first_error(p.prompt, "3+4=7\n7*2=15\nanswer: 15") == 1
    assert ar.first_error(p.prompt, "3+5=8\n8*2=16\nanswer: 16") == 0  # wrong operand
    assert ar.first_error(p.prompt, "hello") == 0
    assert ar.first_error(p.prompt, "3+4=7\n7*2=14\nanswer: 14\nmore") == 3


def test_a_shortcut_step_is_one_step_right_iff_its_value_is():
    prompt = "Compute left to right: 7+5*3-4\n"  # 7+5=12, 12*3=36, 36-4=32
    assert ar.step_labels(prompt, "7+5*3=36\n36-4=32\nanswer: 32") == [1, 1, 1]
    assert ar.first_error(prompt, "7+5*3=36\n36-4=32\nanswer: 32") is None
    assert ar.step_labels(prompt, "7+5=12\n12*3-4=32\nanswer: 32") == [1, 1, 1]  # merged at the end
    assert ar.step_labels(prompt, "7+5*3=22\n22-4=18\nanswer: 18") == [0, 0, 0]  # precedence, not left to right
    assert ar.step_labels(prompt, "7+5*3=37\n37-4=33\nanswer: 33") == [0, 0, 0]  # wrong value: it and all after
    assert ar.step_labels(prompt, "7+5=12\n12*3-4=33\nanswer: 33") == [1, 0, 0]
    assert ar.step_labels(prompt, "7+5*4=48\n48-4=44\nanswer: 44") == [0, 0, 0]  # wrong operand
    assert ar.step_labels(prompt, "7+5*3-4=32\nanswer: 32") == [0, 0]  # three operations are not a step
    assert ar.step_labels("Compute left to right: 7+5\n", "7+5*3=36\nanswer: 36") == [0, 0]  # past the last operation
    assert ar.is_shortcut("7+5*3=36") and not ar.is_shortcut("7+5=12") and not ar.is_shortcut("answer: 3")


def test_shortcut_frac_merges_that_share_of_steps_and_zero_changes_nothing():
    plain = ar.generate(1000, seed=5, cfg=ar.ArithmeticConfig(min_ops=4, max_ops=6))
    merged = ar.generate(1000, seed=5, cfg=ar.ArithmeticConfig(min_ops=4, max_ops=6, shortcut_frac=0.3))
    assert [p.prompt for p in merged] == [p.prompt for p in plain]
    assert ar.generate(200, seed=5) == ar.generate(200, seed=5, cfg=ar.ArithmeticConfig(shortcut_frac=0.0))
    lines = [s for p in merged for s in p.steps[:-1]]
    share = sum(map(ar.is_shortcut, lines)) / len(lines)
    assert 0.15 < share < 0.35
    for p in merged:
        assert ar.step_labels(p.prompt, p.solution) == [1] * len(p.steps)
        assert ar.verify(p.solution, p.answer) == 1.0
    with pytest.raises(ConfigError, match="shortcut_frac=-0.1 must be in"):
        ar.ArithmeticConfig(shortcut_frac=-0.1)


def test_dataset_loader_jsonl_messages_and_gsm8k(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "answer": "4", "response": "2+2=4\nanswer: 4"},
        {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "answer: 2"}], "answer": 2},
        {"question": "Tom has 3 apples and buys 4.", "answer": "3+4=7\n#### 7", "id": "gsm-1"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    recs = tasks.load(str(f))
    assert [r.answer for r in recs] == ["4", "2"]
    assert recs[1].prompt == "1+1?" and recs[1].response == "answer: 2"
    from prmflow.tasks.datasets import load_records

    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps(rows[2]))
    (r,) = load_records(g, prompt_field="question")
    assert (r.prompt_id, r.answer, r.response) == ("gsm-1", "7", "3+4=7\nanswer: 7")
    assert tasks.verify(r, "so the answer: 7") == 1.0 and tasks.verify(r, "it is 8") == 0.0


def test_dataset_loader_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "answer": ["1", "2"]}), f)
    assert [r.prompt for r in tasks.load(str(f))] == ["a?", "b?"]


@pytest.mark.parametrize("content,needle", [
    ("", "is empty"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer"\n', "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: no 'prompt' field. Each row needs a 'prompt' string or a 'messages' "
                                         "list: rename a prompt column of another name, or name a public format"),
    ('{"prompt": 5, "answer": "3"}\n', "line 1: field 'prompt' must be a non-empty string, got int."),
    ('{"prompt": " ", "answer": "3"}\n', "line 1: field 'prompt' must be a non-empty string, got an empty one."),
    ('[1, 2]\n', "line 1: expected a JSON object"),
    ('{"messages": [{"role": "user"}]}\n', "line 1: 'messages' must be a list"),
])
def test_bad_datasets_name_file_and_line(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as e:
        tasks.load(str(f))
    assert str(f) in str(e.value) and needle in str(e.value)
    assert "prompt_field" not in str(e.value)  # said "set prompt_field", a key no stage has


def test_a_bad_jsonl_line_says_where_on_the_line(tmp_path):
    """json's own message stops before its position ("Invalid control character at"): the error completes
    it with the column, the one a user opens the file at (here the raw tab inside the string, column 14)."""
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b\tc", "answer": "2"}\n')
    with pytest.raises(DataError) as e:
        tasks.load(str(f))
    assert "line 2: not valid JSON (Invalid control character at column 14)" in str(e.value)
    assert "at)" not in str(e.value)


def test_missing_and_unknown_dataset_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        tasks.load(str(tmp_path / "none.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format '.csv'"):
        tasks.load(str(tmp_path / "d.csv"))


def test_asking_for_more_problems_than_the_ranges_hold_is_a_config_error_with_a_number_that_works():
    """1-2 operations on single digits hold a few hundred distinct test problems: asking for 400 names the
    keys and how many there are, and that many can be had."""
    with pytest.raises(ConfigError, match=r"ask for at most (\d+), or widen arithmetic.max_ops") as e:
        tasks.load("arithmetic", "test", 400, 0, min_ops=1, max_ops=2)
    most = int(re.search(r"at most (\d+)", str(e.value)).group(1))
    assert 200 < most < 400
    assert len(tasks.load("arithmetic", "test", most, 0, min_ops=1, max_ops=2)) == most


@pytest.mark.parametrize("kind", ["rollouts", "advantages"])
def test_a_handoff_directory_given_as_a_dataset_is_named_as_one(tmp_path, kind):
    """`prmflow sft --task outputs/rollouts` read the hand-off's manifest.json as a JSONL file and said
    "manifest.json, line 1: not valid JSON"; the prm stage said "'DIR/labels.jsonl' does not exist"."""
    from prmflow.components.data import schema
    from prmflow.components.prm import step_examples as prm_data

    with schema.DatasetWriter(tmp_path / kind, kind) as w:
        w.write(pa.Table.from_pylist([{"prompt_id": "p0", "sample_idx": 0, "iteration": 0, "response_ids": [1]}]))
    with pytest.raises(DataError, match=rf"Dataset '.*{kind}' is a prmflow '{kind}' hand-off \(its manifest.json says so\)"):
        tasks.load(str(tmp_path / kind))
    with pytest.raises(DataError, match=rf"holds a '{kind}' hand-off; the prm stage reads step-labelled data"):
        prm_data.load_stepwise(tmp_path / kind)
