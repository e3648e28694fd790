"""The MLflow tracker: calls go to the server at once, or to a queue and the fallback file while it is down.

Tracking never stops or fails a stage. A call the server does not take (down, restarting,
unreachable, timing out) goes to an in-memory queue and, at once, to the append-only fallback file
(outbox.py). Queued calls are retried in order, with their original timestamps, on later calls (at
most every FIRST_BACKOFF_S, doubling up to MAX_BACKOFF_S) and at `finish()` for up to
`finish_wait_s`; each delivered call gets a `done` line in the file. What is still undelivered at
the end stays in the file for `sync.sync_fallback`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from .delivery import create_run, deliver, is_permanent, short_error
from .null import NullTracker
from .outbox import FallbackLog
from .sync import sync_fallback

log = logging.getLogger(__name__)

#: While the server is down, a queued call is retried at most every FIRST_BACKOFF_S, doubling up to MAX_BACKOFF_S.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def renamed(key: str, renames: dict[str, str]) -> str:
    """`key` with its prefix replaced when `renames` names one: renamed("eval/loss", {"eval/": "sft/eval_"})."""
    for prefix, new in renames.items():
        if key.startswith(prefix):
            return new + key[len(prefix):]
    return key


class MlflowTracker(NullTracker):
    """An MLflow run driven through `MlflowClient` (no global active-run state), outage-tolerant.

    `run_id` is "" while the run's creation waits for the server.
    """

    def __init__(self, client, run_id: str, uri: str, parent_run_id: str = "", fallback_path: str | Path | None = None,
                 finish_wait_s: float = 30.0):
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.parent_run_id = parent_run_id
        self.key = run_id or uuid.uuid4().hex
        self.finish_wait_s = finish_wait_s
        self.fallback = FallbackLog(fallback_path) if fallback_path else None
        self.delivered_late = 0
        """Calls that failed at first and were delivered from the queue later."""
        self._queue: deque[dict] = deque()
        self._in_file = False
        self._file_failed = False
        self._retry_at = 0.0
        self._backoff = FIRST_BACKOFF_S
        self._outage_since: float | None = None
        self._lock = threading.RLock()
        self._finished = False
        self.before_finish: list = []
        """Callables given the end status before the run is marked ended (the output's lineage record)."""
        self.renames: dict[str, str] = {}
        """Metric key prefixes logged under another name on this run: {"eval/": "sft/eval_"} (see runs.py)."""
        self.parent_renames: dict[str, str] = {}
        """The same for metrics copied onto the pipeline's parent run: {"train/": "pipeline/"}."""
        self.latest: dict[str, tuple[float, int, int]] = {}
        """The last (value, timestamp, step) logged on this run per metric key (the logged models' metrics)."""

    @property
    def pending(self) -> int:
        """Calls not delivered yet."""
        return len(self._queue)

    # the calls stages make

    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.submit({"op": "log_batch", "params": dict(items[i:i + 100])})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, run: str = "self") -> None:
        now = int(time.time() * 1000)
        renames = self.parent_renames if run == "parent" else self.renames
        items = [[renamed(k, renames), float(v), now, int(step or 0)] for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        if run == "self":
            self.latest.update({k: (v, ts, s) for k, v, ts, s in items})
        if items:
            self.submit({"op": "log_batch", "metrics": items, "run": run})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.submit({"op": "log_batch", "tags": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.submit({"op": "log_artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_text(self, text: str, artifact_file: str) -> None:
        self.submit({"op": "log_text", "text": text, "artifact_file": artifact_file})

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        self.submit({"op": "log_table", "data": data, "artifact_file": artifact_file})

    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Copy metrics onto the pipeline's parent run, so runs compare side by side in the UI."""
        if self.parent_run_id or not self.run_id:  # a deferred run learns its parent when it is created
            self.log_metrics(metrics, step, run="parent")

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run ended, and wait up to finish_wait_s for queued calls; never raises."""
        if self._finished:
            return
        self._finished = True
        for hook in self.before_finish:
            hook(status)
        self.submit({"op": "set_terminated", "status": status})
        deadline = time.monotonic() + self.finish_wait_s
        while self._queue and time.monotonic() < deadline:
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            with self._lock:
                self._drain(force=True)
        if self._queue:
            log.warning("%d tracking call(s) could not be delivered to %s within %.0f s; they are kept in %s. "
                        "Upload them later with `prmflow tracking-sync %s`.", len(self._queue), self.uri,
                        self.finish_wait_s, self.fallback.path if self.fallback else "(no fallback file)",
                        self.fallback.path if self.fallback else "FILE")
        elif self.fallback is not None and self.fallback.path.is_file() and self.fallback.path.stat().st_size:
            try:  # what an earlier, killed run of this stage left undelivered (an empty file: a kill before any write)
                sync_fallback(self.fallback.path)
            except Exception as e:  # noqa: BLE001 - tracking must never fail the stage
                log.warning("could not upload older tracking calls in %s: %s", self.fallback.path, short_error(e))

    # queueing and delivery

    def submit(self, op: dict) -> None:
        """Send one tracking record (see delivery.py) now, or queue it and append it to the fallback
        file while the server is unreachable; stamps it with an id, this tracker's key and the time."""
        op.update(id=uuid.uuid4().hex, key=self.key, uri=self.uri)
        op.setdefault("time", int(time.time() * 1000))
        with self._lock:
            if self._queue:
                self._drain()
            if self._queue or time.monotonic() < self._retry_at:
                self._buffer(op)
                return
            try:
                self._send(op)
            except Exception as e:  # noqa: BLE001 - any failure of tracking is handled here
                if is_permanent(e):
                    self._reject(op, e)
                else:
                    self._outage(e)
                    self._buffer(op)

    def _send(self, op: dict) -> None:
        if op["op"] == "create_run":
            self.run_id, self.parent_run_id = create_run(self.client, op, dedupe=op.get("retried", False))
            log.info("MLflow run %s in %s", self.run_id, self.uri)
            if self._in_file:
                self._record_run()
            return
        target = self.parent_run_id if op.get("run") == "parent" else self.run_id
        if target:
            deliver(self.client, op, target)

    def _drain(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._retry_at:
            return
        while self._queue:
            op = self._queue[0]
            op["retried"] = True
            try:
                self._send(op)
            except Exception as e:  # noqa: BLE001
                if not is_permanent(e):
                    self._outage(e)
                    return
                self._reject(op, e)
            else:
                if self.fallback is not None:
                    self.fallback.append({"op": "done", "id": op["id"]})
                self.delivered_late += 1
            self._queue.popleft()
        if self._outage_since is not None:
            log.warning("MLflow at %s is reachable again after %.0f s; the buffered tracking calls are delivered.",
                        self.uri, time.monotonic() - self._outage_since)
        self._outage_since, self._backoff, self._retry_at = None, FIRST_BACKOFF_S, 0.0

    def _buffer(self, op: dict) -> None:
        self._queue.append(op)
        if self.fallback is None:
            return
        try:
            if not self._in_file:
                self._in_file = True
                self._record_run()
            self.fallback.append(op)
        except OSError as e:
            if not self._file_failed:
                log.warning("cannot write the tracking fallback file %s (%s); calls are kept in memory only",
                            self.fallback.path, e)
            self._file_failed = True

    def _record_run(self) -> None:
        """Tell the fallback file which MLflow run this tracker's records belong to (once known)."""
        if self.run_id and self.fallback is not None:
            self.fallback.append({"op": "run_created", "key": self.key, "run_id": self.run_id,
                                  "parent_run_id": self.parent_run_id, "uri": self.uri})

    def _outage(self, e: BaseException) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            log.warning("MLflow at %s is unreachable (%s). Training continues; tracking calls are kept in memory "
                        "and in %s and retried.", self.uri, short_error(e), self.fallback.path if self.fallback else "memory")
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _reject(self, op: dict, e: BaseException) -> None:
        log.warning("MLflow refused a %s call (%s); it is dropped.", op["op"], short_error(e))
        if self.fallback is not None and self._in_file:
            self.fallback.append({"op": "done", "id": op["id"], "rejected": short_error(e)})
