"""Uploading a fallback file later: `sync_fallback(path)` and its CLI, `prmflow tracking-sync FILE`.

Replays are idempotent: MLflow drops a metric point it already holds (same key, step, timestamp
and value), a deferred run is found again by its `prmflow.run_key` tag instead of being created
twice, and every delivered call gets a `done` line so a second sync skips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import DataError, PrmflowError
from .config import DEFAULT_STORE, TrackingConfig, check_store, limit_http_retries
from .delivery import create_run, deliver, is_permanent, short_error
from .outbox import FallbackLog


class TrackingUnavailable(PrmflowError):
    """The tracking server could not be reached to upload a fallback file."""


def sync_fallback(path: str | Path, uri: str | None = None, create_store: bool = False) -> dict[str, int]:
    """Upload the calls in fallback file `path` that were never delivered; safe to run again.

    `uri` overrides the tracking URI recorded with each call. A SQLite store that does not exist is refused
    (a mistyped path would silently become a new, empty store) unless `create_store`. Returns counts: delivered, rejected
    (refused by the server, e.g. an artifact file that no longer exists) and skipped (already
    delivered). Raises TrackingUnavailable, naming the file, when the server cannot be reached;
    what was delivered before that is marked and not sent again.
    """
    checked = check_fallback_file(path)
    if checked.stat().st_size == 0:  # a stage killed before it recorded its first call: nothing was missed
        return {"delivered": 0, "rejected": 0, "skipped": 0}
    fb = FallbackLog(checked)
    from mlflow.tracking import MlflowClient  # after the checks: a wrong path is refused without importing MLflow

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
            check_store(target_uri, "--uri" if uri else f"the tracking URI recorded in '{fb.path}',",
                        must_exist=not create_store, hint=", or pass --create-store to upload into a new one")
            limit_http_retries(TrackingConfig(), target_uri)
            clients[target_uri] = MlflowClient(tracking_uri=target_uri)
        client = clients[target_uri]
        try:
            if r["op"] == "create_run":
                if r["key"] not in runs:
                    run_id, parent = create_run(client, r, dedupe=True)
                    runs[r["key"]] = (run_id, parent)
                    fb.append({"op": "run_created", "key": r["key"], "run_id": run_id, "parent_run_id": parent,
                               "uri": target_uri})
            else:
                run_id, parent = runs.get(r["key"], ("", ""))
                target = parent if r.get("run") == "parent" else run_id
                if not target:
                    raise FileNotFoundError(f"no run is recorded for key {r['key']!r}")
                deliver(client, r, target)
        except Exception as e:  # noqa: BLE001
            if not is_permanent(e):
                raise TrackingUnavailable(
                    f"Cannot upload '{fb.path}' to {target_uri}: {short_error(e)}. {counts['delivered']} call(s) were "
                    f"delivered and marked; run the same command again when the server is back.") from None
            fb.append({"op": "done", "id": r.get("id"), "rejected": short_error(e)})
            counts["rejected"] += 1
            continue
        fb.append({"op": "done", "id": r.get("id")})
        counts["delivered"] += 1
    return counts


#: what to pass instead, the end of every refusal
WHAT_IT_TAKES = ("Pass the fallback file a stage writes beside its output when MLflow missed calls, "
                 "'.<output>.tracking.jsonl' (for outputs/quickstart/sft: outputs/quickstart/.sft.tracking.jsonl; "
                 "`ls -a` lists it)")


def _is_fallback_file(path: Path) -> bool:
    """One of its first two lines is a recorded tracking call (a JSON object with an `op`), as FallbackLog writes
    them. Two: a write torn by a kill is finished by the next run's append, so a real file can open with one torn line."""
    try:
        with open(path, "rb") as f:
            lines = [f.readline(1 << 20) for _ in range(2)]  # bounded: a big binary file has no short lines
    except OSError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "op" in record:
            return True
    return False


def _fallback_files_near(path: Path) -> list[Path]:
    """Fallback files a user who named `path` (a stage output, or the directory holding outputs) may have meant."""
    near = [path.parent / f".{path.name}.tracking.jsonl"]
    if path.is_dir():
        near += sorted(p for p in path.iterdir() if p.name.endswith(".jsonl"))
    return [p for p in near if p.is_file() and _is_fallback_file(p)]


def check_fallback_file(path: str | Path) -> Path:
    """`path` as a fallback file to upload, or a DataError in one line naming it and what to pass instead."""
    path = Path(path)
    if path.is_file():
        if path.stat().st_size == 0:  # what a stage killed before its first undelivered call leaves: nothing to do
            return path
        if not _is_fallback_file(path):
            raise DataError(f"'{path}' is not a tracking fallback file (its first lines are not recorded tracking "
                            f"calls). {WHAT_IT_TAKES}.")
        return path
    near = _fallback_files_near(path)
    what = "is a directory" if path.is_dir() else "does not exist"
    if near:
        shown = ", ".join(f"'{p}'" for p in near[:5]) + (f" and {len(near) - 5} more" if len(near) > 5 else "")
        raise DataError(f"'{path}' {what}; tracking-sync takes one fallback file: pass {shown}.")
    if path.is_dir():
        raise DataError(f"'{path}' is a directory with no tracking fallback file in it or beside it, so nothing "
                        f"to upload: a stage writes '.<output>.tracking.jsonl' only when MLflow missed calls.")
    raise DataError(f"'{path}' does not exist. {WHAT_IT_TAKES}.")


def add_sync_command(subparsers) -> None:
    """Register `prmflow tracking-sync FILE [--uri URI]` on the CLI's subparsers."""
    p = subparsers.add_parser("tracking-sync", help="upload tracking calls a stage kept in its fallback file while "
                                                    "MLflow was unreachable (safe to repeat)")
    p.add_argument("file", help="the .<output>.tracking.jsonl fallback file beside a stage output")
    p.add_argument("--uri", default=None, help="tracking URI to upload to (default: the one each call was meant for)")
    p.add_argument("--create-store", action="store_true",
                   help="create a SQLite store that does not exist yet (without it, one is refused as a likely typo)")
    p.set_defaults(stage=None, handler=_sync_command)


def _sync_command(args) -> int:
    counts = sync_fallback(args.file, args.uri, create_store=args.create_store)
    if Path(args.file).stat().st_size == 0:
        print(f"tracking-sync {args.file}: the file is empty (its stage stopped before MLflow missed a call); "
              f"nothing to upload")
        return 0
    print(f"tracking-sync {args.file}: {counts['delivered']} call(s) delivered, {counts['rejected']} refused by the "
          f"server, {counts['skipped']} already delivered before")
    return 0
