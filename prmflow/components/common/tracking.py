"""MLflow tracking: one parent run per pipeline run, one child run per stage invocation.

    tracker = start_stage_run(cfg.tracking, stage="sft", params=config.flat_dict(cfg))
    tracker.log_metrics({"train/loss": 0.3}, step=10)
    tracker.finish()            # or tracker.finish("FAILED")

A child run points at its parent through the `mlflow.parentRunId` tag (set from
`TrackingConfig.parent_run_id`, never by exporting MLFLOW_RUN_ID), and carries `prmflow.stage` and
`prmflow.iteration` tags. With tracking disabled, `NullTracker` accepts the same calls and does
nothing, so stage code has no `if tracking:` branches. With no URI configured and no
MLFLOW_TRACKING_URI set, runs go to an embedded SQLite store `./mlflow.db`, which `mlflow ui
--backend-store-uri sqlite:///mlflow.db` shows.

Outages: tracking never stops or fails a stage. A call the server does not take (down, restarting,
unreachable, timing out) goes to an in-memory queue and, at once, to an append-only JSONL fallback
file (`TrackingConfig.fallback_path`, by default beside the stage output, so it survives a pod
restart). Queued calls are retried, in order and with their original timestamps, on later calls
(with backoff) and at `finish()` for up to `finish_wait_s`; each delivered call gets a `done` line
in the file. A server that is down when the stage starts only delays the creation of its run. What
is still undelivered when the process ends, or when it is killed, stays in the file:
`sync_fallback(path)` (CLI: `prmflow tracking-sync FILE`) uploads it later, and the next run of the
same stage does so by itself at its end. Replays are idempotent: MLflow drops a metric point it
already holds (same key, step, timestamp and value), and a deferred run is found again by its
`prmflow.run_key` tag instead of being created twice. MLflow's own HTTP retries are turned off
and its timeout shortened (MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT, unless set), so a dead
server costs one quick failed request per retry interval instead of minutes of backoff per call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PrmflowError

log = logging.getLogger(__name__)

DEFAULT_STORE = "sqlite:///mlflow.db"
PIPELINE_TAG = "prmflow.pipeline_run_id"
ROLE_TAG = "prmflow.role"
RUN_KEY_TAG = "prmflow.run_key"
#: MLflow error codes that a retry cannot fix: the call is dropped (kept in the fallback file, marked).
PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST", "INVALID_STATE",
                    "RESOURCE_DOES_NOT_EXIST", "MALFORMED_REQUEST"}
#: While the server is down, a queued call is retried at most every FIRST_BACKOFF_S, doubling up to MAX_BACKOFF_S.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass
class TrackingConfig:
    enabled: bool = True
    """Log params, metrics and artifacts to MLflow. Off: a no-op tracker takes the same calls."""
    uri: str = ""
    """MLflow tracking URI. Empty: $MLFLOW_TRACKING_URI, else the embedded store sqlite:///mlflow.db."""
    experiment: str = "prmflow"
    """MLflow experiment name; created if missing."""
    parent_run_id: str = ""
    """Run id of the pipeline's parent run; the stage's run becomes its child. Empty: a top-level run."""
    pipeline_run_id: str = ""
    """KFP run id. With no parent_run_id, the parent is the run tagged prmflow.pipeline_run_id=<this>
    by the pipeline's init_tracking step (how stages inside ParallelFor find it)."""
    run_name: str = ""
    """Name of the stage's run. Empty: '<stage>' or '<stage>-iter<k>'."""
    tags: dict = field(default_factory=dict)
    """Extra tags set on the run (e.g. the KFP run id)."""
    fallback_path: str = ""
    """Append-only JSONL keeping every tracking call the server missed until it is delivered (`prmflow tracking-sync FILE` uploads it later). Empty: `.<output>.tracking.jsonl` beside the stage's output (survives a pod restart), else a file in the temp directory."""
    finish_wait_s: float = 30.0
    """At the end of a run, seconds to keep retrying calls the server missed; what is left stays in fallback_path."""
    http_timeout_s: int = 10
    """Seconds one request to a tracking server may take (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless it is set); a longer one counts as an outage."""


def resolve_uri(cfg: TrackingConfig) -> str:
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI", "") or DEFAULT_STORE
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # make a relative SQLite path absolute now, so a later chdir cannot split the store in two
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


class TrackingUnavailable(PrmflowError):
    """The tracking server could not be reached to upload a fallback file."""


class NullTracker:
    """Takes every tracking call and does nothing."""

    run_id: str = ""
    uri: str = ""

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...
    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # SystemExit/KeyboardInterrupt: stopped from outside (preemption, Ctrl-C), not a failure of the stage
        stopped = exc_type is not None and issubclass(exc_type, (SystemExit, KeyboardInterrupt))
        self.finish("KILLED" if stopped else "FAILED" if exc_type else "FINISHED")
        return False


# --- the fallback file --------------------------------------------------------------------------------

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
    if output:
        out = Path(output)
        return out.parent / f".{out.name}.tracking.jsonl"
    return Path(tempfile.gettempdir()) / "prmflow-tracking" / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


# --- delivering one call --------------------------------------------------------------------------------

def _permanent(e: BaseException) -> bool:
    return getattr(e, "error_code", None) in PERMANENT_ERRORS or isinstance(e, (FileNotFoundError, TypeError))


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:300]


def _deliver_create(client, op: dict, dedupe: bool) -> tuple[str, str]:
    """Create the run described by a create_run record; returns (run_id, parent_run_id)."""
    exp = experiment_id(client, op["experiment"])
    if dedupe:  # a replay: the run may already exist from an attempt whose answer was lost
        found = client.search_runs([exp], filter_string=f"tags.`{RUN_KEY_TAG}` = '{op['key']}'", max_results=1)
        if found:
            return found[0].info.run_id, found[0].data.tags.get("mlflow.parentRunId", "")
    parent = op.get("parent_run_id") or ""
    if not parent and op.get("pipeline_run_id"):
        parent = find_pipeline_run(client, op["experiment"], op["pipeline_run_id"]) or ""
        if not parent:
            log.warning("no MLflow parent run is tagged %s=%s; logging a top-level run", PIPELINE_TAG, op["pipeline_run_id"])
    tags = {**op.get("tags", {}), RUN_KEY_TAG: op["key"]}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = client.create_run(exp, start_time=op.get("time"), tags=tags, run_name=op.get("run_name") or None)
    return run.info.run_id, parent


def _deliver(client, op: dict, run_id: str) -> None:
    """Send one logged call (not create_run) to run `run_id`."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "log_batch":
        client.log_batch(run_id, metrics=[Metric(k, float(v), int(ts), int(s)) for k, v, ts, s in op.get("metrics", [])],
                         params=[Param(k, v) for k, v in op.get("params", {}).items()],
                         tags=[RunTag(k, v) for k, v in op.get("tags", {}).items()])
    elif kind == "log_text":
        client.log_text(run_id, op["text"], op["artifact_file"])
    elif kind == "log_table":
        client.log_table(run_id, data=op["data"], artifact_file=op["artifact_file"])
    elif kind == "log_artifact":
        path = Path(op["path"])
        if not path.exists():
            raise FileNotFoundError(f"artifact '{path}' no longer exists")
        if path.is_dir():
            client.log_artifacts(run_id, str(path), op.get("artifact_path"))
        else:
            client.log_artifact(run_id, str(path), op.get("artifact_path"))
    elif kind == "set_terminated":
        client.set_terminated(run_id, status=op["status"], end_time=op.get("time"))
    else:
        raise TypeError(f"unknown tracking record {kind!r}")


# --- the tracker ----------------------------------------------------------------------------------------

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

    @property
    def pending(self) -> int:
        """Calls not delivered yet."""
        return len(self._queue)

    # the calls stages make

    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._submit({"op": "log_batch", "params": dict(items[i:i + 100])})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, run: str = "self") -> None:
        now = int(time.time() * 1000)
        items = [[k, float(v), now, int(step or 0)] for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        if items:
            self._submit({"op": "log_batch", "metrics": items, "run": run})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._submit({"op": "log_batch", "tags": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._submit({"op": "log_artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._submit({"op": "log_text", "text": text, "artifact_file": artifact_file})

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        self._submit({"op": "log_table", "data": data, "artifact_file": artifact_file})

    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Copy metrics onto the pipeline's parent run, so runs compare side by side in the UI."""
        if self.parent_run_id or not self.run_id:  # a deferred run learns its parent when it is created
            self.log_metrics(metrics, step, run="parent")

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run ended, and wait up to finish_wait_s for queued calls; never raises."""
        if self._finished:
            return
        self._finished = True
        self._submit({"op": "set_terminated", "status": status})
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
        elif self.fallback is not None and self.fallback.path.is_file():
            try:  # what an earlier, killed run of this stage left undelivered
                sync_fallback(self.fallback.path)
            except Exception as e:  # noqa: BLE001 - tracking must never fail the stage
                log.warning("could not upload older tracking calls in %s: %s", self.fallback.path, _short(e))

    # queueing and delivery

    def _submit(self, op: dict) -> None:
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
                if _permanent(e):
                    self._reject(op, e)
                else:
                    self._outage(e)
                    self._buffer(op)

    def _send(self, op: dict) -> None:
        if op["op"] == "create_run":
            self.run_id, self.parent_run_id = _deliver_create(self.client, op, dedupe=op.get("retried", False))
            log.info("MLflow run %s in %s", self.run_id, self.uri)
            if self._in_file:
                self._record_run()
            return
        target = self.parent_run_id if op.get("run") == "parent" else self.run_id
        if target:
            _deliver(self.client, op, target)

    def _drain(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._retry_at:
            return
        while self._queue:
            op = self._queue[0]
            op["retried"] = True
            try:
                self._send(op)
            except Exception as e:  # noqa: BLE001
                if not _permanent(e):
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
                        "and in %s and retried.", self.uri, _short(e), self.fallback.path if self.fallback else "memory")
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _reject(self, op: dict, e: BaseException) -> None:
        log.warning("MLflow refused a %s call (%s); it is dropped.", op["op"], _short(e))
        if self.fallback is not None and self._in_file:
            self.fallback.append({"op": "done", "id": op["id"], "rejected": _short(e)})


# --- uploading a fallback file later ------------------------------------------------------------------

def sync_fallback(path: str | Path, uri: str | None = None) -> dict[str, int]:
    """Upload the calls in fallback file `path` that were never delivered; safe to run again.

    `uri` overrides the tracking URI recorded with each call. Returns counts: delivered, rejected
    (refused by the server, e.g. an artifact file that no longer exists) and skipped (already
    delivered). Raises TrackingUnavailable, naming the file, when the server cannot be reached;
    what was delivered before that is marked and not sent again.
    """
    from mlflow.tracking import MlflowClient

    fb = FallbackLog(path)
    if not fb.path.is_file():
        raise TrackingUnavailable(f"Tracking fallback file '{fb.path}' does not exist.")
    records = fb.read()
    done = {r.get("id") for r in records if r["op"] == "done"}
    runs = {r["key"]: (r["run_id"], r.get("parent_run_id", "")) for r in records if r["op"] == "run_created"}
    clients: dict[str, Any] = {}
    counts = {"delivered": 0, "rejected": 0, "skipped": 0}
    for r in records:
        if r["op"] in ("done", "run_created"):
            continue
        if r.get("id") in done:
            counts["skipped"] += 1
            continue
        target_uri = uri or r.get("uri") or DEFAULT_STORE
        if target_uri not in clients:  # a server still down: one refused connection, not minutes of MLflow retries
            _short_http_settings(TrackingConfig(), target_uri)
            clients[target_uri] = MlflowClient(tracking_uri=target_uri)
        client = clients[target_uri]
        try:
            if r["op"] == "create_run":
                if r["key"] not in runs:
                    run_id, parent = _deliver_create(client, r, dedupe=True)
                    runs[r["key"]] = (run_id, parent)
                    fb.append({"op": "run_created", "key": r["key"], "run_id": run_id, "parent_run_id": parent,
                               "uri": target_uri})
            else:
                run_id, parent = runs.get(r["key"], ("", ""))
                target = parent if r.get("run") == "parent" else run_id
                if not target:
                    raise FileNotFoundError(f"no run is recorded for key {r['key']!r}")
                _deliver(client, r, target)
        except Exception as e:  # noqa: BLE001
            if not _permanent(e):
                raise TrackingUnavailable(
                    f"Cannot upload '{fb.path}' to {target_uri}: {_short(e)}. {counts['delivered']} call(s) were "
                    f"delivered and marked; run the same command again when the server is back.") from None
            fb.append({"op": "done", "id": r.get("id"), "rejected": _short(e)})
            counts["rejected"] += 1
            continue
        fb.append({"op": "done", "id": r.get("id")})
        counts["delivered"] += 1
    return counts


def add_sync_command(subparsers) -> None:
    """Register `prmflow tracking-sync FILE [--uri URI]` on the CLI's subparsers."""
    p = subparsers.add_parser("tracking-sync", help="upload tracking calls a stage kept in its fallback file while "
                                                    "MLflow was unreachable (safe to repeat)")
    p.add_argument("file", help="the .<output>.tracking.jsonl fallback file beside a stage output")
    p.add_argument("--uri", default=None, help="tracking URI to upload to (default: the one each call was meant for)")
    p.set_defaults(stage=None, handler=_sync_command)


def _sync_command(args) -> int:
    counts = sync_fallback(args.file, args.uri)
    print(f"tracking-sync {args.file}: {counts['delivered']} call(s) delivered, {counts['rejected']} refused by the "
          f"server, {counts['skipped']} already delivered before")
    return 0


# --- starting runs --------------------------------------------------------------------------------------

def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # created concurrently by another stage
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_pipeline_run(client, experiment: str, pipeline_run_id: str) -> str | None:
    """Id of the parent run that init_tracking created for KFP run `pipeline_run_id`, if any."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], max_results=1,
                              filter_string=f"tags.`{PIPELINE_TAG}` = '{pipeline_run_id}' and tags.`{ROLE_TAG}` = 'pipeline'")
    return runs[0].info.run_id if runs else None


def _short_http_settings(cfg: TrackingConfig, uri: str) -> None:
    """No MLflow-side retry storms against a remote server: prmflow queues and retries itself."""
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.http_timeout_s)))


def start_run(cfg: TrackingConfig, run_name: str, tags: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None, fallback_path: str | Path | None = None,
              strict: bool = False) -> NullTracker:
    """Start a run (a child of the configured parent, if any); a NullTracker when tracking is off.

    strict=False: an unreachable server defers the run's creation (see the module docstring).
    strict=True: creation errors are raised (the pipeline's own parent run, whose id is an output).
    """
    if not cfg.enabled:
        return NullTracker()
    uri = resolve_uri(cfg)
    _short_http_settings(cfg, uri)
    all_tags = {**{k: str(v) for k, v in (cfg.tags or {}).items()}, **{k: str(v) for k, v in (tags or {}).items()}}
    if cfg.pipeline_run_id:
        all_tags[PIPELINE_TAG] = cfg.pipeline_run_id
    fallback = cfg.fallback_path or fallback_path or default_fallback_path(None, run_name)
    tracker = MlflowTracker(_client(uri), "", uri, fallback_path=fallback, finish_wait_s=cfg.finish_wait_s)
    create = {"op": "create_run", "experiment": cfg.experiment, "run_name": cfg.run_name or run_name, "tags": all_tags,
              "parent_run_id": cfg.parent_run_id, "pipeline_run_id": cfg.pipeline_run_id}
    if strict:
        create.update(key=tracker.key, time=int(time.time() * 1000))
        tracker.run_id, tracker.parent_run_id = _deliver_create(tracker.client, create, dedupe=False)
    else:
        tracker._submit(create)
    if params:
        tracker.log_params(params)
    return tracker


def start_pipeline_run(cfg: TrackingConfig, params: dict[str, Any] | None = None) -> NullTracker:
    """The parent run of one pipeline run, tagged so stages (and the exit handler) can find it."""
    return start_run(cfg, cfg.run_name or f"pipeline-{cfg.pipeline_run_id or 'local'}", {ROLE_TAG: "pipeline"}, params,
                     strict=True)


def finish_pipeline_run(cfg: TrackingConfig, status: str, metrics: dict[str, float] | None = None) -> str | None:
    """Mark the pipeline's parent run FINISHED or FAILED (from the KFP exit handler). Returns its id."""
    if not cfg.enabled or not cfg.pipeline_run_id:
        return None
    uri = resolve_uri(cfg)
    client = _client(uri)
    run_id = find_pipeline_run(client, cfg.experiment, cfg.pipeline_run_id)
    if run_id is None:
        log.warning("no MLflow parent run for pipeline run %s", cfg.pipeline_run_id)
        return None
    tracker = MlflowTracker(client, run_id, uri, fallback_path=cfg.fallback_path or None,
                            finish_wait_s=cfg.finish_wait_s)
    if metrics:
        tracker.log_metrics(metrics)
    tracker.finish(status)
    return run_id


def start_stage_run(cfg: TrackingConfig, stage: str, params: dict[str, Any] | None = None,
                    iteration: int | None = None, tags: dict[str, Any] | None = None) -> NullTracker:
    """A child run for one stage invocation, tagged with the stage and the RL iteration.

    The fallback file defaults to `.<output>.tracking.jsonl` beside the stage's `output` param.
    """
    name = stage if iteration is None else f"{stage}-iter{iteration}"
    stage_tags = {"prmflow.stage": stage, **(tags or {})}
    if iteration is not None:
        stage_tags["prmflow.iteration"] = iteration
    output = (params or {}).get("output") or None
    return start_run(cfg, name, stage_tags, params, fallback_path=default_fallback_path(output, name))
