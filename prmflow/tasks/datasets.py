"""User datasets: rows with a prompt (or chat messages) and an answer, in the project's own format or
a public dataset's (GSM8K, MATH / MATH-500: public.py), from a file, a directory, an object store or
the Hub (sources.py: `task: s3://bucket/gsm8k/test.parquet?format=gsm8k`).

Accepted fields of a `prompts` row (names configurable):
- `prompt`: the question text, or `messages`: a chat list [{"role": ..., "content": ...}]; when
  the last message is the assistant's, it is the SFT target (and removed from the prompt);
- `answer` (optional): the reference final answer, used by verifiers;
- `response` (optional): the SFT target when the prompt is plain text;
- `id` (optional): a stable prompt id; otherwise a hash of the prompt;
- `source` (optional): which reward recipe scores the row (mixed datasets) and which grading
  convention applies (grader.py);
- `images` (optional): the images of a vision-language prompt: one or a list of image paths
  (relative to the dataset file's directory), encoded bytes (Parquet binary), or
  {"bytes"/"path": ...} dicts (the Hugging Face datasets Image feature); each is checked
  (decodable, size limits) when the dataset is read.
A `prompts` row whose answer holds GSM8K's `rationale #### N` takes N as the answer and the
rationale + `answer: N` as the response (the format the built-in task writes); a dataset in
GSM8K's own columns (question, answer) is read by the `gsm8k` format instead (public.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import DataError
from . import PromptRecord, public, sources


def load_records(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 response_field: str = "response", require_answer: bool = False,
                 require_response: bool = False, n: int | None = None, held_out: bool = False) -> list[PromptRecord]:
    """Read a dataset (sources.py) into PromptRecords, at most `n`, failing on the first bad row;
    `held_out`: a dataset with splits and no ?split= gives its test split (sources.iter_rows).

    The row format is the dataset's `format` option, else detected from each file's first row (a
    directory may mix GSM8K and MATH files); renamed fields (prompt_field, ...) mean the project's
    own `prompts` format.
    """
    spec = sources.parse(str(path))
    given = spec.options.get("format") or (None if prompt_field == "prompt" else "prompts")
    given = public.canonical(given, str(spec)) if given else None
    fmt, last_file = given, None
    local = Path(spec.location)
    base = (local if local.is_dir() else local.parent) if "://" not in spec.location else Path.cwd()
    out: list[PromptRecord] = []
    for where, row in sources.iter_rows(spec, held_out):
        if n is not None and len(out) >= n:
            break
        if given is None and sources.file_of(where) != last_file:  # each file of a directory in its own format
            fmt, last_file = public.detect(row, where), sources.file_of(where)
        if fmt in public.STEP_FORMATS:
            raise DataError(f"{where}: a step-labelled ({fmt}) dataset, but prompts are needed here (prompt/messages + "
                            f"answer, gsm8k or math rows). Use it as the prm stage's task.")
        fields = (prompt_field, answer_field, response_field) if fmt == "prompts" else ("prompt", "answer", "response")
        row = public.prompt_row(fmt, row, where)
        rec = _record(row, where, *fields, require_answer, require_response)
        if row.get("images") is not None:
            from ..components.models.vision import read_image_list

            rec.images = read_image_list(row["images"], base, where) or None
        out.append(rec)
    if not out:
        raise DataError(f"Dataset '{spec}' is empty: it has no rows.")
    return out


def _record(row: dict[str, Any], where: str, prompt_field: str, answer_field: str, response_field: str,
            require_answer: bool, require_response: bool) -> PromptRecord:
    messages = row.get("messages")
    prompt = row.get(prompt_field)
    response = row.get(response_field)
    if response is not None and not isinstance(response, str):
        raise DataError(f"{where}: field '{response_field}' must be a string, got {type(response).__name__}.")
    if messages is not None:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}} objects.")
        if messages and messages[-1]["role"] == "assistant":
            response = response if response is not None else messages[-1]["content"]
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{where}: 'messages' holds no user turn.")
        prompt = messages[-1]["content"]
        if not prompt.strip():
            raise DataError(f"{where}: 'messages' ends with an empty turn; the prompt needs text.")
    elif prompt is None:  # no stage has a key to rename the column: the row itself must change
        raise DataError(
            f"{where}: no '{prompt_field}' field. Each row needs a '{prompt_field}' string or a 'messages' list: "
            f"rename a prompt column of another name, or name a public format with ?format=NAME (docs/data.md)."
        )
    elif not isinstance(prompt, str) or not prompt.strip():
        got = "an empty one" if isinstance(prompt, str) else type(prompt).__name__
        raise DataError(f"{where}: field '{prompt_field}' must be a non-empty string, got {got}.")
    answer = row.get(answer_field)
    if answer is not None:
        if isinstance(answer, (dict, list, bool)):
            raise DataError(f"{where}: field '{answer_field}' must be a string or a number, got {type(answer).__name__}.")
        answer = str(answer)
        if "####" in answer:  # GSM8K: rationale #### final answer
            rationale, answer = answer.rsplit("####", 1)
            response = response if response is not None else rationale.strip() + f"\nanswer: {answer.strip()}"
            answer = answer.strip().replace(",", "")
    if require_answer and answer is None:
        raise DataError(f"{where}: no '{answer_field}' field; this stage needs a reference answer per row.")
    if require_response and not response:
        raise DataError(f"{where}: no '{response_field}' field or assistant message; SFT needs a target response.")
    pid = row.get("id") or row.get("prompt_id")
    if isinstance(pid, (dict, list, float, bool)):
        raise DataError(f"{where}: field 'id' must be a string or an integer, got {pid!r}.")
    if pid is None:
        pid = "row-" + hashlib.sha1(json.dumps([messages, prompt], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return PromptRecord(prompt_id=str(pid), prompt=prompt, answer=answer, response=response,
                        messages=messages, source=str(row.get("source") or "dataset"))
