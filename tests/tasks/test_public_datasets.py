"""Public datasets in their own formats (GSM8K, MATH / MATH-500, Math-Shepherd, PRM800K), from every
kind of source (local files, a `datasets` save_to_disk directory, S3 through fsspec, the Hub offline).

Rows are hand-written in each dataset's published format (nothing is downloaded); the expected
records are written out by hand from the dataset cards, not computed by the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prmflow import tasks
from prmflow.errors import DataError
from prmflow.tasks import grader
from prmflow.components.prm import step_examples as prm_data

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "A shop sold 1,000 pens on Monday and 234 on Tuesday. How many pens in all?",
     "answer": "1,000 + 234 = <<1000+234=1234>>1,234\n#### 1,234"},
]
MATH500 = [{"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
            "solution": "Adding, $\\frac{1}{4}+\\frac{1}{4} = \\frac{2}{4} = \\boxed{\\frac{1}{2}}$.",
            "answer": "\\frac{1}{2}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}]
MATH = [{"problem": "Simplify $\\sqrt{16}$.", "level": "Level 1", "type": "Algebra",
         "solution": "We have $\\sqrt{16} = \\boxed{4}$."},
        {"problem": "Find $x$ if $2x = 1$.", "level": "Level 1", "type": "Algebra",
         "solution": "Dividing by 2, $x = \\boxed{\\dfrac{1}{2}}$."}]
SHEPHERD_Q = "Tom has 3 apples and buys 4 more, then eats 2. How many apples does he have?"
SHEPHERD_STEPS = ["Step 1: Tom has 3 + 4 = <<3+4=7>>7 apples. ", "Step 2: He eats 2, so 7 - 2 = <<7-2=5>>5. ",
                  "Step 3: The answer is: 6 "]


def shepherd_row(marks="++-", task="GSM8K"):
    """A Math-Shepherd row: `input` ends every step with ки, `label` has + / - in its place."""
    return {"input": SHEPHERD_Q + " " + "ки\n".join(SHEPHERD_STEPS) + "ки",
            "label": SHEPHERD_Q + " " + "".join(s + m + ("\n" if i < 2 else "") for i, (s, m) in
                                                 enumerate(zip(SHEPHERD_STEPS, marks))),
            "task": task}


def prm800k_line(finish="found_error"):
    """A PRM800K line (the openai/prm800k README's layout): step 0 has two rated alternatives (1 chosen),
    step 1 a neutral one, step 2 none acceptable but a human-written step, step 3 a wrong one."""
    return {
        "labeler": "340d89bc", "timestamp": "2023-01-22T04:34:27", "generation": 9,
        "is_quality_control_question": False, "is_initial_screening_question": False,
        "question": {"problem": "What is $2+3\\cdot 4$?", "ground_truth_answer": "14",
                     "ground_truth_solution": "...", "pre_generated_steps": None},
        "label": {"steps": [
            {"completions": [{"text": "First multiply: $3\\cdot 4 = 12$.", "rating": 1, "flagged": False},
                             {"text": "First add: $2+3=5$.", "rating": -1, "flagged": False}],
             "human_completion": None, "chosen_completion": 0},
            {"completions": [{"text": "Let me write it down.", "rating": 0, "flagged": False}],
             "human_completion": None, "chosen_completion": 0},
            {"completions": [{"text": "Then $2+12=13$.", "rating": -1, "flagged": False}],
             "human_completion": {"text": "Then $2+12$\n$=14$.", "rating": None}, "chosen_completion": None},
            {"completions": [{"text": "# Answer\n\n15", "rating": -1, "flagged": False}],
             "human_completion": None, "chosen_completion": None},
        ], "total_time": 1000, "finish_reason": finish}}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- prompt formats -------------------------------------------------------------------------------

def test_gsm8k_rows_in_gsm8k_format(tmp_path):
    recs = tasks.load(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
    assert [r.answer for r in recs] == ["72", "1234"]
    assert recs[0].prompt == GSM8K[0]["question"] and recs[0].source == "gsm8k"
    assert recs[0].response == ("Natalia sold 48/2 = 24 clips in May.\n"
                                "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")
    # the reference solution is right by the grader, in GSM8K's convention
    assert all(tasks.verify(r, r.response) == 1.0 for r in recs)
    assert tasks.verify(recs[1], "The total is #### 1,234") == 1.0
    assert tasks.verify(recs[1], "#### 1,234\nChecking: 1000 + 233 would be 1,233.") == 1.0  # after ####: ignored
    assert tasks.verify(recs[1], "#### 1,233") == 0.0


def test_math_row_with_a_brace_less_boxed_answer(tmp_path):
    """MATH writes some answers as `\\boxed 5` (lm-eval's minerva_math last_boxed_only_string reads them); such a
    row has an answer, not a DataError."""
    row = {"problem": "What is $2+3$?", "solution": "Adding, $2+3=\\boxed 5$.", "level": "Level 1", "type": "Algebra"}
    (rec,) = tasks.load(write_jsonl(tmp_path / "m.jsonl", [row]))
    assert (rec.answer, rec.source) == ("5", "math")
    assert tasks.verify(rec, "so $\\boxed 5$") == 1.0 and tasks.verify(rec, "so $\\boxed{6}$") == 0.0


def test_math_and_math500_rows(tmp_path):
    recs = tasks.load(write_jsonl(tmp_path / "math.jsonl", MATH)) + tasks.load(write_jsonl(tmp_path / "m5.jsonl", MATH500))
    assert [r.answer for r in recs] == ["4", "\\dfrac{1}{2}", "\\frac{1}{2}"]  # the last \boxed{}, or MATH-500's answer
    assert [r.source for r in recs] == ["math"] * 3 and recs[2].prompt_id == "test/prealgebra/1.json"
    assert recs[0].response == MATH[0]["solution"]
    half = recs[2]
    assert tasks.verify(half, "so $x = \\boxed{0.5}$") == 1.0
    assert tasks.verify(half, "\\boxed{\\frac{1}{2}}") == 1.0
    assert tasks.verify(half, "The final answer is $\\frac{2}{4}$. I hope it is correct.") == 1.0
    assert tasks.verify(half, "x = 0.5") == 0.0  # MATH's convention: no boxed / final answer, no answer
    assert tasks.verify(half, "\\boxed{\\frac{1}{3}}") == 0.0
    assert grader.grade("math", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0


@pytest.mark.parametrize("rows,fmt,needle", [
    ([{"question": "q?", "answer": "no marker"}], "", r"line 1: column 'answer' has no '#### N'"),
    ([GSM8K[0], {"question": "q?"}], "", r"line 2: column 'answer' is missing"),
    ([{"problem": "p?", "solution": "no box"}], "", r"line 1: column 'solution' has no \\boxed"),
    ([{"text": "q", "label": 1}], "", r"line 1: cannot tell the dataset's format from its columns \['label', 'text'\]"),
    ([shepherd_row()], "", r"line 1: a step-labelled \(math_shepherd\) dataset, but prompts are needed"),
    ([GSM8K[0]], "?format=nope", r"unknown format 'nope'"),
    ([GSM8K[0]], "?fromat=gsm8k", r"'fromat=gsm8k' is not an option"),
])
def test_bad_prompt_rows_name_file_row_and_column(tmp_path, rows, fmt, needle):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=needle) as e:
        tasks.load(path + fmt)
    assert "d.jsonl" in str(e.value)


def test_format_option_overrides_detection(tmp_path):
    """A MATH file given as gsm8k is read as GSM8K, and says what it lacks."""
    with pytest.raises(DataError, match="line 1: column 'question' is missing"):
        tasks.load(write_jsonl(tmp_path / "m.jsonl", MATH) + "?format=gsm8k")
    assert tasks.load(write_jsonl(tmp_path / "g.jsonl", GSM8K) + "?format=gsm8k")[0].answer == "72"


# --- step formats ---------------------------------------------------------------------------------

def test_math_shepherd_row_becomes_stepwise(tmp_path):
    (ex,) = prm_data.load_stepwise(write_jsonl(tmp_path / "ms.jsonl", [shepherd_row()]))
    assert ex.prompt == SHEPHERD_Q
    assert ex.steps == ["Tom has 3 + 4 = <<3+4=7>>7 apples.", "He eats 2, so 7 - 2 = <<7-2=5>>5.", "The answer is: 6"]
    assert ex.labels == [1.0, 1.0, 0.0] and ex.source == "gsm8k"


def test_math_shepherd_tag_inside_the_question_is_dropped_with_its_label(tmp_path):
    row = shepherd_row("+++")
    row["input"] = "Tom ки has apples. " + row["input"][4:]
    row["label"] = "Tom - has apples. " + row["label"][4:]
    (ex,) = prm_data.load_stepwise(write_jsonl(tmp_path / "ms.jsonl", [row]))
    assert ex.prompt.startswith("Tom  has apples.") and ex.labels == [1.0, 1.0, 1.0] and len(ex.steps) == 3


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r.update(label=r["label"].replace("+", "?", 1)),
     "line 1: column 'label' does not match column 'input' at step tag 1"),
    (lambda r: r.update(label=r["label"].replace("He eats 2", "He eats 3")), "at step tag 2"),
    (lambda r: r.update(input=r["input"].replace("ки", "")), "line 1: column 'input' has no step tag"),
])
def test_bad_math_shepherd_rows_name_the_row(tmp_path, edit, needle):
    row = shepherd_row()
    edit(row)
    with pytest.raises(DataError, match=needle):
        prm_data.load_stepwise(write_jsonl(tmp_path / "ms.jsonl", [row]))


def test_math_shepherd_row_without_step_1_splits_at_the_question_mark_or_is_skipped_and_counted(tmp_path, caplog):
    """TRL's converter (huggingface/trl examples/datasets/math_shepherd.py, process_example) splits a row with
    no 'Step 1:' at the '?' that ends the question; a row with neither cannot be cut, and is skipped, counted
    in the log, instead of stopping the load of a 445k-row dataset."""
    plain = shepherd_row("+-+")
    for key in ("input", "label"):
        plain[key] = plain[key].replace("Step 1: ", "").replace("Step 2: ", "").replace("Step 3: ", "")
    no_question = {k: v.replace("?", ".") for k, v in plain.items()}
    rows = [shepherd_row(), no_question, plain, no_question]
    with caplog.at_level("WARNING"):
        got = prm_data.load_stepwise(write_jsonl(tmp_path / "ms.jsonl", rows))
    assert [(ex.prompt, ex.steps, ex.labels) for ex in got[1:]] == [
        (SHEPHERD_Q, ["Tom has 3 + 4 = <<3+4=7>>7 apples.", "He eats 2, so 7 - 2 = <<7-2=5>>5.", "The answer is: 6"],
         [1.0, 0.0, 1.0])]
    assert len(got) == 2
    assert "skipped 2 Math-Shepherd rows with neither 'Step 1:' nor a '?'" in caplog.text and "(first: " in caplog.text
    assert "ms.jsonl, line 2)" in caplog.text
    with pytest.raises(DataError, match=r"is empty: it has no rows; 1 Math-Shepherd rows .* were skipped \(first: .*line 1\)"):
        prm_data.load_stepwise(write_jsonl(tmp_path / "bad.jsonl", [no_question]))


# The openai/prm800k README's annotated line (README.md, "Here is one annotated line"; texts shortened where
# marked): a phase-2 found_error line. Two steps rated 0 and chosen, then the first wrong step: five rated
# completions, none chosen.
README_LINE = {
    "labeler": "340d89bc-f5b7-45e9-b272-909ba68ee363", "timestamp": "2023-01-22T04:34:27.052924", "generation": 9,
    "is_quality_control_question": False, "is_initial_screening_question": False,
    "question": {"problem": "What is the greatest common factor of $20 !$ and $200,\\!000$?", "ground_truth_answer": "40,\\!000",
                 "ground_truth_solution": "...", "pre_generated_steps": ["..."], "pre_generated_answer": "320,000",
                 "pre_generated_verifier_score": 0.010779580529581414},
    "label": {"steps": [
        {"completions": [{"text": "I want to find the largest positive integer that divides both $20 !$ and $200,\\!000$ "
                                  "evenly.", "rating": 0, "flagged": None}],
         "human_completion": None, "chosen_completion": 0},
        {"completions": [{"text": "One way to do this is to factor both numbers into prime factors and look for the "
                                  "common ones.", "rating": 0, "flagged": None}],
         "human_completion": None, "chosen_completion": 0},
        {"completions": [
            {"text": "I know that $200,\\!000 = 2^5\\cdot 10^4 = 2^9\\cdot 5^4$.", "rating": -1, "flagged": None},
            {"text": "To factor $20 !$, I can use the fact that every factorial is a multiple of every number less than or "
                     "equal to it.", "rating": 0, "flagged": False},
            {"text": "I can use a factor tree to find the prime factors of $200,\\!000$: $200,\\!000 = 2^5\\cdot 10^4 = "
                     "2^5\\cdot 2^4\\cdot 5^4 = 2^9\\cdot 5^4$.", "rating": -1, "flagged": False},
            {"text": "I can use a factor tree to find the prime factors of $200,\\!000$.", "rating": 0, "flagged": False},
            {"text": "To factor $20 !$, I can use the fact that any factorial is divisible by all the primes less than or "
                     "equal to the input.", "rating": 0, "flagged": False}],
         "human_completion": None, "chosen_completion": None}],
    "total_time": 278270, "finish_reason": "found_error"}}


def test_prm800k_readme_line_gives_one_row_per_rated_completion_of_the_wrong_step(tmp_path):
    """Every label of the line once per completion of the step where labelling stopped: 5 rows, the two
    chosen steps in each (neutral = 1.0), the rated alternative last; no sixth row of the chosen prefix
    alone, which repeated labels every row already holds (and over-weighted the positives)."""
    got = prm_data.load_stepwise(write_jsonl(tmp_path / "prm800k.jsonl", [README_LINE]))
    steps = README_LINE["label"]["steps"]
    prefix = [steps[0]["completions"][0]["text"], steps[1]["completions"][0]["text"]]
    want = [(prefix + [c["text"]], [1.0, 1.0, {-1: 0.0, 0: 1.0}[c["rating"]]]) for c in steps[2]["completions"]]
    assert [(ex.steps, ex.labels) for ex in got] == want
    assert sum(ex.labels.count(1.0) for ex in got) == 2 * 5 + 3  # the prefix's two positives, once per row


def test_prm800k_line_gives_the_chosen_path_and_every_rejected_alternative(tmp_path):
    got = prm_data.load_stepwise(write_jsonl(tmp_path / "prm800k.jsonl", [prm800k_line()]))
    by_steps = {tuple(ex.steps): ex.labels for ex in got}
    multiply, note = "First multiply: $3\\cdot 4 = 12$.", "Let me write it down."
    assert by_steps == {
        ("First add: $2+3=5$.",): [0.0],                                  # rejected alternative at step 0
        (multiply, note, "Then $2+12=13$."): [1.0, 1.0, 0.0],             # neutral counts as correct
        (multiply, note, "Then $2+12$ $=14$.", "# Answer 15"): [1.0, 1.0, 1.0, 0.0],  # human step; newlines joined
    }  # no row of the chosen path alone: the last row holds its every step and label (found_error)
    assert len(got) == 3
    assert {ex.answer for ex in got} == {"14"} and {ex.source for ex in got} == {"math"}
    assert len({ex.prompt_id for ex in got}) == 1  # one problem: one group


@pytest.mark.parametrize("neutral,want", [("0", 0.0), ("0.5", 0.5), ("1", 1.0)])
def test_prm800k_neutral_label_is_configurable(tmp_path, neutral, want):
    got = prm_data.load_stepwise(write_jsonl(tmp_path / "p.jsonl", [prm800k_line()]) + f"?neutral={neutral}")
    assert {ex.labels[1] for ex in got if len(ex.steps) > 1} == {want}


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r["label"]["steps"][1]["completions"][0].update(rating=2),
     r"line 1: label.steps\[1\].completions\[0\].rating is 2"),
    (lambda r: r["label"]["steps"][0].update(chosen_completion=5), r"label.steps\[0\].chosen_completion is 5"),
    (lambda r: r["question"].pop("problem"), "column 'question' has no 'problem'"),
])
def test_bad_prm800k_lines_name_line_step_and_field(tmp_path, edit, needle):
    row = prm800k_line()
    edit(row)
    with pytest.raises(DataError, match=needle):
        prm_data.load_stepwise(write_jsonl(tmp_path / "p.jsonl", [row]))
    with pytest.raises(DataError, match="neutral='2'"):
        prm_data.load_stepwise(write_jsonl(tmp_path / "q.jsonl", [prm800k_line()]) + "?neutral=2")


def test_prm800k_bad_problem_lines_are_skipped_and_prompt_data_is_refused(tmp_path):
    got = prm_data.load_stepwise(write_jsonl(tmp_path / "p.jsonl", [prm800k_line("bad_problem"), prm800k_line()]))
    assert len(got) == 3 and {ex.where.rsplit(', ', 1)[1] for ex in got} == {'line 2'}
    with pytest.raises(DataError, match="line 1: a gsm8k dataset has no step labels"):
        prm_data.load_stepwise(write_jsonl(tmp_path / "g.jsonl", GSM8K))


# --- sources --------------------------------------------------------------------------------------

def test_datasets_save_to_disk_directory_with_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K[:1]),
                               "test": datasets.Dataset.from_list(GSM8K[1:])})
    dd.save_to_disk(str(tmp_path / "gsm8k"))
    assert [r.answer for r in tasks.load(str(tmp_path / "gsm8k"))] == ["72"]  # train by default
    assert [r.answer for r in tasks.load(str(tmp_path / "gsm8k") + "?split=test")] == ["1234"]
    with pytest.raises(DataError, match=r"has splits \['train', 'test'\], not 'dev'"):
        tasks.load(str(tmp_path / "gsm8k") + "?split=dev")
    datasets.Dataset.from_list([shepherd_row()]).save_to_disk(str(tmp_path / "ms"))
    assert prm_data.load_stepwise(str(tmp_path / "ms"))[0].labels == [1.0, 1.0, 0.0]


def test_parquet_directory_reads_every_file_in_order(tmp_path):
    (tmp_path / "d").mkdir()
    for i, row in enumerate(GSM8K):
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d" / f"part-{i}.parquet")
    assert [r.answer for r in tasks.load(str(tmp_path / "d"))] == ["72", "1234"]


def test_a_directory_mixing_gsm8k_and_math_files_reads_each_in_its_format(tmp_path):
    (tmp_path / "mix").mkdir()
    write_jsonl(tmp_path / "mix" / "gsm8k-train.jsonl", GSM8K)
    pq.write_table(pa.Table.from_pylist(MATH), tmp_path / "mix" / "math-train.parquet")
    recs = tasks.load(str(tmp_path / "mix"))
    assert [(r.source, r.answer) for r in recs] == [("gsm8k", "72"), ("gsm8k", "1234"), ("math", "4"), ("math", "\\dfrac{1}{2}")]


def test_hub_id_offline_fails_with_what_to_do(tmp_path):
    """No hub here: the hub path runs datasets.load_dataset and, offline, says how to get the data in."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hfd")}
    code = ("from prmflow import tasks\n"
            "from prmflow.errors import DataError\n"
            "try:\n    tasks.load('hub:openai/gsm8k?config=main&split=test')\n"
            "except DataError as e:\n    print('DataError:', e); raise SystemExit(2)\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "'hub:openai/gsm8k' could not be loaded from the Hugging Face Hub (HF_HUB_OFFLINE is set)" in p.stdout
    assert "save_to_disk" in p.stdout and "load_dataset('openai/gsm8k', 'main')" in p.stdout


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on a free loopback port with a bucket, and the credentials a user would set."""
    from moto.server import ThreadedMotoServer
    import s3fs

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("data")
    yield fs, endpoint
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_s3_parquet_and_jsonl_through_fsspec(tmp_path, s3, monkeypatch):
    fs, endpoint = s3
    local = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), local)
    fs.put(str(local), "data/gsm8k/test.parquet")
    fs.put(write_jsonl(tmp_path / "ms.jsonl", [shepherd_row(), shepherd_row("+--")]), "data/ms/part-0.jsonl")
    # the endpoint from AWS_ENDPOINT_URL, as boto and the AWS CLI read it
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert [r.answer for r in tasks.load("s3://data/gsm8k/test.parquet")] == ["72", "1234"]
    assert [ex.labels for ex in prm_data.load_stepwise("s3://data/ms")] == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    # or from fsspec's own configuration (FSSPEC_S3_ENDPOINT_URL sets this at import)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
    fs.clear_instance_cache()
    assert [r.answer for r in tasks.load("s3://data/gsm8k/?format=gsm8k")] == ["72", "1234"]
    # or the pipeline's object-store secret (MLFLOW_S3_ENDPOINT_URL) when nothing else names one
    monkeypatch.setitem(fsspec.config.conf, "s3", {})
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", endpoint)
    fs.clear_instance_cache()
    assert len(tasks.load("s3://data/gsm8k/test.parquet")) == 2


def test_s3_errors_name_the_object_and_row(tmp_path, s3, monkeypatch):
    fs, endpoint = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    fs.put(write_jsonl(tmp_path / "bad.jsonl", [GSM8K[0], {"question": "q", "answer": "7"}]), "data/bad.jsonl")
    with pytest.raises(DataError, match=r"s3://data/bad.jsonl, line 2: column 'answer' has no '#### N'"):
        tasks.load("s3://data/bad.jsonl")
    with pytest.raises(DataError, match=r"'s3://data/missing.parquet' does not exist"):
        tasks.load("s3://data/missing.parquet")
