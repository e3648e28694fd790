"""User datasets: JSONL or Parquet rows with a prompt (or chat messages) and an answer.

Accepted fields per row (names configurable):
- `prompt`: the question text, or `messages`: a chat list [{"role": ..., "content": ...}]; when
  the last message is the assistant's, it is the SFT target (and removed from the prompt);
- `answer` (optional): the reference final answer, used by verifiers;
- `response` (optional): the SFT target when the prompt is plain text;
- `id` (optional): a stable prompt id; otherwise a hash of the prompt;
- `source` (optional): which reward recipe scores the row (mixed datasets);
- `images` (optional): the images of a vision-language prompt: one or a list of image paths
  (relative to the dataset file's directory), encoded bytes (Parquet binary), or
  {"bytes"/"path": ...} dicts (the Hugging Face datasets Image feature); each is checked
  (decodable, size limits) when the dataset is read.
GSM8K-style data ({"question", "answer": "...#### 42"}) drops in with prompt_field=question; the
number after `####` becomes the answer and the text before it the response.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import DataError
from . import PromptRecord


def _rows_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not UTF-8 text ({e.reason} at byte {e.start}). "
                                f"Save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg}). Fix or remove the line.") from None
            except RecursionError:
                raise DataError(f"{path}, line {lineno}: JSON nested too deeply to be a dataset row.") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}.")
            rows.append((lineno, row))
    return rows


def _rows_parquet(path: Path) -> list[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}).") from None
    return [(i, row) for i, row in enumerate(table.to_pylist())]


def load_records(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 response_field: str = "response", require_answer: bool = False,
                 require_response: bool = False) -> list[PromptRecord]:
    """Read a JSONL or Parquet dataset into PromptRecords, failing on the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Dataset '{path}' does not exist. Pass a .jsonl or .parquet file, or task=arithmetic.")
    if path.suffix in (".jsonl", ".json"):
        rows, unit = _rows_jsonl(path), "line"
    elif path.suffix == ".parquet":
        rows, unit = _rows_parquet(path), "row"
    else:
        raise DataError(f"Dataset '{path}': unknown format '{path.suffix}'. Use .jsonl or .parquet.")
    if not rows:
        raise DataError(f"Dataset '{path}' is empty: it has no rows.")
    out = []
    for where_n, row in rows:
        where = f"{path}, {unit} {where_n}"
        rec = _record(row, where, prompt_field, answer_field, response_field, require_answer, require_response)
        if row.get("images") is not None:
            from ..vision import read_image_list

            rec.images = read_image_list(row["images"], path.parent, where) or None
        out.append(rec)
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
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DataError(
            f"{where}: no '{prompt_field}' field (or it is empty). Each row needs a '{prompt_field}' string or a "
            f"'messages' list; set prompt_field if your column has another name."
        )
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
