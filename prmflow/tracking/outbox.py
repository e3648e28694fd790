"""The fallback file: an append-only JSONL outbox of tracking calls the server has not taken yet.

Each call is one line (`op` names it); a later `{"op": "done", "id": ...}` line marks it delivered
(or refused), and `{"op": "run_created", ...}` records which MLflow run a tracker's calls belong to
once that run exists. The file outlives the process, so `sync.sync_fallback` can replay it later.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    for attr in ("item", "tolist"):  # numpy scalars and arrays in tables
        if hasattr(value, attr):
            return getattr(value, attr)()
    return str(value)


class FallbackLog:
    """Append-only JSONL of tracking calls: one line per call, a `done` line once it is delivered.

    Lines are written whole with O_APPEND and fsync'd, so a kill loses at most the line being
    written; a torn last line is skipped when read.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, record: dict) -> None:
        line = (json.dumps(record, default=_jsonable, sort_keys=True) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        records = []
        for n, line in enumerate(self.path.read_bytes().split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                log.warning("%s, line %d: not a complete record (torn by a kill?); skipped", self.path, n)
                continue
            if isinstance(record, dict) and "op" in record:
                records.append(record)
        return records


def default_fallback_path(output: str | None, stage: str) -> Path:
    """`.<output>.tracking.jsonl` beside a stage's output (it survives a pod restart), else a file
    named for the stage, the time and the pid in the temp directory."""
    if output:
        out = Path(output)
        return out.parent / f".{out.name}.tracking.jsonl"
    return Path(tempfile.gettempdir()) / "prmflow-tracking" / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
