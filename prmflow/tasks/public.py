"""Public math and PRM datasets in their own formats, mapped onto the project's rows.

A row format is chosen by the dataset's `format` option (sources.py) or detected from the first
row's columns. Prompt formats become the prompt rows datasets.py reads (prompt, answer, response,
id, source); step formats become the stepwise rows the prm stage reads (prm/step_examples.py: prompt,
steps, labels, answer, id, source).

| format | columns | becomes |
|---|---|---|
| `prompts` | `prompt` or `messages`, `answer`, ... | itself (datasets.py) |
| `gsm8k` | `question`, `answer` = rationale + `#### N` | prompt = question, answer = N (commas dropped), response = the rationale without its `<<48/2=24>>` calculator notes + `#### N`; source `gsm8k` |
| `math` (MATH, MATH-500) | `problem`, `solution` with `\\boxed{}` (MATH-500 also `answer`, `unique_id`) | prompt = problem, answer = `answer`, else the solution's last `\\boxed{}`; response = solution; source `math` |
| `stepwise` | `prompt`, `steps` (or `response`), `labels` | itself (prm/step_examples.py) |
| `math_shepherd` | `input` = question + steps, each ending in the tag `ки`; `label` = the same text with `+` / `-` in place of each tag; `task` | prompt = the text before `Step 1:` (without one: up to the last `?` before the first tag, as TRL's converter cuts it; neither: RowSkipped); steps without their `Step k:` prefix; labels 1 / 0; source from `task` (`gsm8k` / `math`) |
| `prm800k` | PRM800K JSONL: `question.problem`, `question.ground_truth_answer`, `label.steps[].completions[].rating` (-1/0/1), `chosen_completion`, `human_completion` | see `prm800k_rows` |
| `trl_stepwise` | `prompt`, `completions`, `labels` (bool) (TRL's stepwise supervision, e.g. trl-lib/math_shepherd) | steps = completions |

Text inside one step that contains the stage's step separator (a newline in a LaTeX display, say)
is joined with a space: the public datasets were not cut at our separator, and a step must read
as one step. Grading follows each source's convention (grader.py: `gsm8k`, `math`).
"""  # noqa: E501  (a markdown table's rows are one line each)

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..errors import DataError
from .grader import last_boxed

PROMPT_FORMATS = ("prompts", "gsm8k", "math")
STEP_FORMATS = ("stepwise", "math_shepherd", "prm800k", "trl_stepwise")
ALIASES = {"math500": "math", "math-500": "math", "math-shepherd": "math_shepherd", "mathshepherd": "math_shepherd"}
SHEPHERD_TAG = "ки"
NEUTRAL_DEFAULT = 1.0
"""PRM800K: label of a neutral (0) step; 1.0 = neutral counts as correct (see prm800k_rows)."""


class RowSkipped(Exception):
    """A row that holds no labelled solution, by the dataset's own conventions; the message names the kind,
    and the loader counts them (prm/step_examples.py `load_stepwise` logs how many, and the first one)."""


_CALCULATOR = re.compile(r"<<[^<>]*>>")
_STEP_PREFIX = re.compile(r"^\s*step\s*\d+\s*[:.]\s*", re.IGNORECASE)


def canonical(fmt: str, where: str) -> str:
    name = ALIASES.get(fmt.strip().lower(), fmt.strip().lower())
    if name not in PROMPT_FORMATS + STEP_FORMATS:
        raise DataError(f"{where}: unknown format '{fmt}'; known: {', '.join(PROMPT_FORMATS + STEP_FORMATS)}.")
    return name


def detect(row: dict, where: str) -> str:
    """The format of a row, from its columns; a DataError listing them when none fits."""
    keys = set(row)
    if isinstance(row.get("question"), dict) and isinstance(row.get("label"), dict):
        return "prm800k"
    if {"input", "label"} <= keys:
        return "math_shepherd"
    if {"prompt", "completions", "labels"} <= keys:
        return "trl_stepwise"
    if "labels" in keys and ("steps" in keys or "response" in keys):
        return "stepwise"
    if {"problem", "solution"} <= keys:
        return "math"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if "prompt" in keys or "messages" in keys:
        return "prompts"
    raise DataError(f"{where}: cannot tell the dataset's format from its columns {sorted(keys)}. Expected one of: "
                    f"question+answer (gsm8k), problem+solution (math), input+label (math_shepherd), PRM800K's "
                    f"question+label objects, prompt+steps+labels (stepwise), prompt/messages (+answer); or name it "
                    f"with ?format=NAME after the dataset.")


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column '{key}' is missing or not a non-empty string ({type(value).__name__}).")
    return value


def _row_id(row: dict, *parts: str) -> str:
    pid = row.get("id") or row.get("unique_id")
    if isinstance(pid, (str, int)) and not isinstance(pid, bool):
        return str(pid)
    return "row-" + hashlib.sha1("\x00".join(parts).encode()).hexdigest()[:12]


# --- prompt formats -------------------------------------------------------------------------------

def gsm8k_row(row: dict, where: str) -> dict:
    question, answer = _text(row, "question", where), _text(row, "answer", where)
    if "####" not in answer:
        raise DataError(f"{where}: column 'answer' has no '#### N' final answer (GSM8K's format ends the rationale "
                        f"with '#### N'). Fix the row, or set ?format= to the dataset's real format.")
    rationale, final = answer.rsplit("####", 1)
    final = final.strip().replace(",", "")
    if not final:
        raise DataError(f"{where}: column 'answer' has nothing after '####'.")
    lines = [ln.strip() for ln in _CALCULATOR.sub("", rationale).splitlines() if ln.strip()]
    return {"prompt": question, "answer": final, "response": "\n".join(lines + [f"#### {final}"]),
            "id": _row_id(row, question), "source": "gsm8k"}


def math_row(row: dict, where: str) -> dict:
    problem, solution = _text(row, "problem", where), _text(row, "solution", where)
    answer = row.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        answer = last_boxed(solution)
        if answer is None:
            raise DataError(f"{where}: column 'solution' has no \\boxed{{...}} final answer and the row has no 'answer' "
                            f"column; MATH rows need one of the two.")
    elif not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DataError(f"{where}: column 'answer' must be a string or a number, got {type(answer).__name__}.")
    return {"prompt": problem, "answer": str(answer).strip(), "response": solution,
            "id": _row_id(row, problem), "source": "math"}


def prompt_row(fmt: str, row: dict, where: str) -> dict:
    """A row of a prompt format as a `prompts` row."""
    if fmt == "gsm8k":
        return gsm8k_row(row, where)
    if fmt == "math":
        return math_row(row, where)
    return row


# --- step formats ---------------------------------------------------------------------------------

def _step(text: str, separator: str) -> str:
    return re.sub(r"\s+", " ", text.replace(separator, " ")).strip() if separator and separator in text else text.strip()


def math_shepherd_rows(row: dict, where: str, separator: str) -> list[dict]:
    """The one solution of a Math-Shepherd row: labels from `label` at each `ки` of `input`."""
    text, labelled = _text(row, "input", where), _text(row, "label", where)
    parts = text.split(SHEPHERD_TAG)
    if len(parts) < 2:
        raise DataError(f"{where}: column 'input' has no step tag '{SHEPHERD_TAG}'; Math-Shepherd ends every step with it.")
    labels, pos = [], 0
    for k, part in enumerate(parts[:-1]):
        mark = labelled[pos + len(part): pos + len(part) + 1]
        if labelled[pos: pos + len(part)] != part or mark not in ("+", "-"):
            raise DataError(f"{where}: column 'label' does not match column 'input' at step tag {k + 1} (expected the "
                            f"same text with '+' or '-' in place of each '{SHEPHERD_TAG}'); fix or drop the row.")
        labels.append(1.0 if mark == "+" else 0.0)
        pos += len(part) + 1
    if labelled[pos:] != parts[-1]:
        raise DataError(f"{where}: column 'label' does not match column 'input' after the last step tag.")
    first = next((k for k, p in enumerate(parts) if re.search(r"step\s*1\s*:", p, re.IGNORECASE)), None)
    if first is not None:
        head = "".join(parts[:first + 1])  # a tag before 'Step 1:' is an annotation slip inside the question: dropped
        m = list(re.finditer(r"step\s*1\s*:", head, re.IGNORECASE))[-1]
        prompt, steps = head[:m.start()].strip(), [head[m.start():]] + parts[first + 1:-1]
        labels = labels[first:]
    else:  # no 'Step 1:': the question ends at its last '?' and the first step follows (TRL's converter does the same)
        cut = parts[0].rfind("?") + 1
        prompt, steps = parts[0][:cut].strip(), [parts[0][cut:]] + parts[1:-1]
        if not cut or not steps[0].strip():
            raise RowSkipped("Math-Shepherd rows with neither 'Step 1:' nor a '?' ending the question before the first "
                             f"step tag '{SHEPHERD_TAG}'")
    if not prompt:
        raise DataError(f"{where}: column 'input' has no question before 'Step 1:'.")
    task = str(row.get("task") or "").strip().lower()
    return [{"prompt": prompt, "steps": [_step(_STEP_PREFIX.sub("", s), separator) for s in steps], "labels": labels,
             "id": _row_id(row, prompt), "source": task if task in ("gsm8k", "math") else "dataset"}]


def _rating(step: dict, c: Any, where: str, k: int, j: int) -> int | None:
    if not isinstance(c, dict) or not isinstance(c.get("text"), str):
        raise DataError(f"{where}: label.steps[{k}].completions[{j}] is not an object with a 'text' string.")
    r = c.get("rating")
    if r is not None and (isinstance(r, bool) or r not in (-1, 0, 1)):
        raise DataError(f"{where}: label.steps[{k}].completions[{j}].rating is {r!r}; PRM800K ratings are -1, 0 or 1.")
    return r


def prm800k_rows(row: dict, where: str, separator: str, neutral: float = NEUTRAL_DEFAULT) -> list[dict]:
    """The labelled solutions of one PRM800K line.

    Following the steps a labeller chose (`chosen_completion`, else the `human_completion` they
    wrote, which counts as correct), every completion not chosen at step k ends a solution of its
    own (the chosen steps before it + that completion); the chosen path is one more unless the rows
    of the step where it stops already extend it (phase 2's found_error: the rated completions of the
    wrong step, none chosen, each end a row; the path alone would repeat their labels). Ratings: 1 ->
    1.0, -1 -> 0.0, 0 (neutral) -> `neutral` (default 1.0: a neutral step is not an error, the binary
    reading OpenR's PRM800K preprocessing uses (openreasoner/openr docs/datasets.md); 0.0 for the
    strict reading, 0.5 for a soft label).
    A completion with no rating is not labelled and dropped; the path stops at a chosen one. Lines
    whose labeller flagged the problem itself (finish_reason bad_problem) give no rows (RowSkipped).
    """
    question, label = row.get("question"), row.get("label")
    problem = question.get("problem") if isinstance(question, dict) else None
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: column 'question' has no 'problem' string.")
    if not isinstance(label, dict) or not isinstance(label.get("steps"), list):
        raise DataError(f"{where}: column 'label' has no 'steps' list.")
    if label.get("finish_reason") == "bad_problem":
        raise RowSkipped("PRM800K lines whose labeller flagged the problem (finish_reason bad_problem)")
    value = {1: 1.0, -1: 0.0, 0: float(neutral)}
    answer = question.get("ground_truth_answer")
    base = {"prompt": problem.strip(), "answer": None if answer is None else str(answer),
            "id": _row_id(row, problem), "source": "math"}
    out, path, labels = [], [], []
    branched = False  # whether rows were emitted that extend the current path by one step
    for k, step in enumerate(label["steps"]):
        if not isinstance(step, dict):
            raise DataError(f"{where}: label.steps[{k}] is not an object.")
        completions = step.get("completions") or []
        chosen = step.get("chosen_completion")
        if chosen is not None and (isinstance(chosen, bool) or not isinstance(chosen, int) or not 0 <= chosen < len(completions)):
            raise DataError(f"{where}: label.steps[{k}].chosen_completion is {chosen!r}, not an index into its "
                            f"{len(completions)} completions.")
        for j, c in enumerate(completions):
            r = _rating(step, c, where, k, j)
            if j != chosen and r is not None and c["text"].strip():
                out.append({**base, "steps": path + [_step(c["text"], separator)], "labels": labels + [value[r]]})
                branched = True
        if chosen is not None:
            text, r = completions[chosen]["text"], completions[chosen].get("rating")
            if r is None:
                break
            path, labels, branched = path + [_step(text, separator)], labels + [value[r]], False
        elif isinstance(step.get("human_completion"), dict) and isinstance(step["human_completion"].get("text"), str):
            path, labels, branched = path + [_step(step["human_completion"]["text"], separator)], labels + [1.0], False
        else:
            break
    if path and not branched:  # else every step of the path, and its labels, is already in the rows that extend it
        out.append({**base, "steps": path, "labels": labels})
    return [r for r in out if all(s for s in r["steps"])]


def trl_rows(row: dict, where: str, separator: str) -> list[dict]:
    steps, labels = row.get("completions"), row.get("labels")
    if not isinstance(steps, list) or not isinstance(labels, list):
        raise DataError(f"{where}: columns 'completions' and 'labels' must be lists.")
    return [{"prompt": row.get("prompt"), "steps": [_step(s, separator) if isinstance(s, str) else s for s in steps],
             "labels": [float(y) if isinstance(y, bool) else y for y in labels],
             "id": _row_id(row, str(row.get("prompt"))), "source": str(row.get("source") or "dataset")}]


def step_rows(fmt: str, row: dict, where: str, separator: str, neutral: float = NEUTRAL_DEFAULT) -> list[dict]:
    """A row of a step format as `stepwise` rows (PRM800K lines give several)."""
    if fmt == "math_shepherd":
        return math_shepherd_rows(row, where, separator)
    if fmt == "prm800k":
        return prm800k_rows(row, where, separator, neutral)
    if fmt == "trl_stepwise":
        return trl_rows(row, where, separator)
    return [row]


def neutral_option(options: dict, where: str) -> float:
    """The `neutral` option as a label in [0, 1]."""
    raw = options.get("neutral")
    if raw is None:
        return NEUTRAL_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise DataError(f"Dataset '{where}': neutral={raw!r}; give the label of a neutral PRM800K step as a number in "
                        f"[0, 1] (1 = counts as correct, 0 = as an error, 0.5 = soft).")
    return value
