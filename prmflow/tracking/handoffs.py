"""Lineage: every input and output hand-off of a stage run, recorded as an MLflow dataset.

    record_stage_handoffs(tracker, "advantage", params)   # inputs now; the output when the run FINISHES

A hand-off is logged with `MlflowClient.log_inputs` (context `training` or `evaluation` for an
input, `output` for what the stage wrote) as an MLflow `MetaDataset`: no data is copied, only

- source: the artifact URI as KFP gives it. Inside a KFP pod the launcher hands a stage local copies
  of its artifacts (`/s3/BUCKET/KEY`, `/gcs/BUCKET/KEY`, `/minio/BUCKET/KEY`); they are recorded
  under their URIs (`s3://`, `gs://`, `minio://`), which is what a laptop can fetch them from.
  Anything else is recorded as the local path it is.
- digest: `io.fingerprint` of the hand-off's manifest (sha256 over every file's sha256; MLflow keeps
  32 hex digits of it), or, for a file or directory no manifest covers (a JSONL task, a base
  model), the same over files hashed here; such a directory over HASH_LIMIT (1 GiB) is fingerprinted
  by file names and sizes instead (kind `directory-by-size`), and a fetch checks it no further.
- schema (Parquet hand-offs: the columns of the first shard) and profile (`num_rows`, `kind`).
- tags `prmflow.key` (the config key it was read through), `prmflow.path` (the part of the
  hand-off the key names: `policy` of a ppo output, `kl_state.json`), `prmflow.shard` (one entry of
  a gathered-shards directory, which is logged shard by shard since it has no manifest of its own).

`prmflow stage-command STAGE --run-id ID` reads these back (`handoffs_of_run`) to fetch, verify and
re-run the stage. Tracking never fails a stage: a hand-off that cannot be described is logged as a
warning and skipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Config keys whose values are paths of a stage's inputs (mounted read-only when it is re-run).
INPUT_KEYS = ("backbone", "task", "eval_task", "ptx_task", "bon.task", "policy", "prm", "ref", "critic",
              "critic_init", "input", "kl_state", "baseline", "optimizer_state", "bon.policy")
OUTPUT_KEY = "output"
#: Where the KFP launcher puts its local copy of an artifact, by URI scheme (kfp.dsl.types.artifact_types).
KFP_MOUNTS = {"/gcs/": "gs://", "/minio/": "minio://", "/s3/": "s3://"}
MANIFEST = "manifest.json"
DIGEST_CHARS = 32  # MLflow's dataset digest column holds 36 characters
#: A directory with no manifest past this size (a base model imported from elsewhere, read again by every
#: rollout pod of every iteration) is fingerprinted by file names and sizes, not read through.
HASH_LIMIT = 1 << 30
SIZED = "directory-by-size"
KEY_TAG, PATH_TAG, SHARD_TAG, CONTEXT_TAG = "prmflow.key", "prmflow.path", "prmflow.shard", "mlflow.data.context"


def handoff_uri(path: str | os.PathLike) -> str:
    """The URI of an artifact from the path a stage sees it at: `/s3/b/k` -> `s3://b/k`; other paths as they are."""
    text = os.path.abspath(os.fspath(path))
    for prefix, scheme in KFP_MOUNTS.items():
        if text.startswith(prefix):
            return scheme + text[len(prefix):]
    return text


@dataclass
class Handoff:
    """One hand-off a stage read or wrote, as recorded (and as `stage-command` reads it back)."""

    key: str
    """Config key it came through (`input`, `policy`, `output`, ...)."""
    uri: str
    """Where the hand-off itself (the directory holding manifest.json, or the lone file) lives."""
    digest: str
    context: str
    path: str = ""
    """The part of it the key names, relative to `uri` ('' = all of it)."""
    shard: str = ""
    """Entry name inside a gathered-shards directory ('' when the key names the hand-off itself)."""
    name: str = ""
    rows: int | None = None
    kind: str = ""
    schema: dict | None = field(default=None, repr=False)

    @property
    def has_manifest(self) -> bool:
        return self.kind not in ("", "file", "directory", SIZED)


def hash_tree(path: Path, by_size: bool = False) -> dict[str, str]:
    """{relative path: sha256} of every file under `path` (or {name: sha256} of the file `path`);
    with `by_size`, {relative path: "size:N"} (nothing is read)."""
    from ..components.data.io import sha256_file

    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    name = (lambda p: p.name) if path.is_file() else (lambda p: p.relative_to(path).as_posix())
    return {name(p): f"size:{p.stat().st_size}" if by_size else sha256_file(p) for p in files}


def manifest_root(path: Path) -> Path | None:
    """`path` or the nearest directory above it holding a manifest.json (`ppo/policy` -> `ppo`)."""
    for candidate in (path, *path.parents):
        if (candidate / MANIFEST).is_file():
            return candidate
    return None


def describe(key: str, path: str | os.PathLike, context: str, shard: str = "") -> Handoff:
    """The Handoff for `path` (an existing local file or directory) read or written through `key`."""
    from ..components.data.io import fingerprint_files

    local = Path(path).resolve()  # a gathered shard is a symlink: record where it really is
    root = manifest_root(local)
    if root is not None and root != local:  # a part of a hand-off (ppo's policy/): only if its manifest lists it
        sub = local.relative_to(root).as_posix()
        if not any(n == sub or n.startswith(sub + "/") for n in json.loads((root / MANIFEST).read_text()).get("files", {})):
            root = None
    if root is None:  # a base model, a task file: no manifest, so hashed here (by size past HASH_LIMIT)
        by_size = local.is_dir() and sum(p.stat().st_size for p in local.rglob("*") if p.is_file()) > HASH_LIMIT
        files = hash_tree(local, by_size)
        kind = SIZED if by_size else "file" if local.is_file() else "directory"
        return Handoff(key, handoff_uri(local), fingerprint_files(files)[:DIGEST_CHARS], context, shard=shard,
                       name=f"{key}/{shard}" if shard else local.name, kind=kind)
    manifest = json.loads((root / MANIFEST).read_text())
    sub = "" if root == local else local.relative_to(root).as_posix()
    kind = str(manifest.get("kind", ""))
    shards = sorted(n for n in manifest.get("files", {}) if n.endswith(".parquet"))
    schema = parquet_schema(root / shards[0]) if shards and not sub else None
    return Handoff(key, handoff_uri(root), fingerprint_files(manifest["files"])[:DIGEST_CHARS], context, path=sub,
                   shard=shard, name="/".join(x for x in (kind or root.name, sub, shard) if x),
                   rows=manifest.get("rows"), kind=kind, schema=schema)


def stage_handoffs(stage: str, params: dict[str, Any], keys=INPUT_KEYS, context: str | None = None) -> list[Handoff]:
    """The hand-offs named by `keys` in a stage's flat config `params` that exist on this machine.

    A directory with no manifest whose entries are hand-offs (the gathered rollout shards) gives one
    Handoff per entry."""
    context = context or ("evaluation" if stage == "evaluate" else "training")
    out = []
    for key in keys:
        value = params.get(key)
        if not isinstance(value, (str, os.PathLike)) or not value or not os.path.exists(value):
            continue  # unset, a preset name (tiny-llama), the built-in task
        local = Path(value)
        if local.is_dir() and manifest_root(local.resolve()) is None:
            entries = sorted(p for p in local.iterdir() if p.is_dir() and (p / MANIFEST).is_file())
            if entries:
                out += [describe(key, p, context, shard=p.name) for p in entries]
                continue
        out.append(describe(key, local, context))
    return out


def parquet_schema(path: Path) -> dict | None:
    """The columns of a Parquet file as MLflow's colspec JSON (the footer only is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow.types.schema import Array, ColSpec, DataType, Map, Schema

    scalars = {pa.string(): DataType.string, pa.large_string(): DataType.string, pa.int32(): DataType.integer,
               pa.int64(): DataType.long, pa.float32(): DataType.float, pa.float64(): DataType.double,
               pa.bool_(): DataType.boolean, pa.binary(): DataType.binary, pa.large_binary(): DataType.binary}

    def convert(t):
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return Array(convert(t.value_type))
        if pa.types.is_map(t):
            return Map(convert(t.item_type))
        return scalars.get(t, DataType.string)

    schema = pq.read_schema(path)
    return json.loads(Schema([ColSpec(convert(f.type), f.name, required=not f.nullable) for f in schema]).to_json())


def dataset_record(h: Handoff) -> dict:
    """The JSON-able record of one hand-off (what the tracker queues and its fallback file keeps)."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.schema import Schema

    try:
        with warnings.catch_warnings():  # a local path matches two registered local sources alike
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(h.uri)
    except Exception:  # minio:// has no MLflow source class
        source = None
    schema = Schema.from_json(json.dumps(h.schema)) if h.schema else None
    if source is not None:
        entity = MetaDataset(source, name=h.name, digest=h.digest, schema=schema).to_dict()
    else:
        entity = {"name": h.name, "digest": h.digest, "source_type": h.uri.split("://", 1)[0],
                  "source": json.dumps({"uri": h.uri}),
                  "schema": json.dumps({"mlflow_colspec": h.schema}) if h.schema else None}
    profile = {"num_rows": h.rows, "kind": h.kind} if h.rows is not None else {"kind": h.kind}
    tags = {CONTEXT_TAG: h.context, KEY_TAG: h.key}
    if h.path:
        tags[PATH_TAG] = h.path
    if h.shard:
        tags[SHARD_TAG] = h.shard
    return {"name": entity["name"], "digest": entity["digest"], "source_type": entity["source_type"],
            "source": entity["source"], "schema": entity.get("schema"), "profile": json.dumps(profile), "tags": tags}


def deliver_datasets(client, op: dict, run_id: str) -> None:
    """Send a `log_inputs` record (see `record`) to run `run_id`."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    client.log_inputs(run_id, datasets=[
        DatasetInput(Dataset(d["name"], d["digest"], d["source_type"], d["source"], d.get("schema"), d.get("profile")),
                     [InputTag(k, v) for k, v in d["tags"].items()]) for d in op["datasets"]])


def record(tracker, handoffs: list[Handoff]) -> None:
    """Log `handoffs` on the tracker's run (queued and kept like every other call while MLflow is down)."""
    submit = getattr(tracker, "submit", None)
    if submit is None or not handoffs:  # NullTracker: tracking is off
        return
    submit({"op": "log_inputs", "datasets": [dataset_record(h) for h in handoffs]})


def record_stage_handoffs(tracker, stage: str, params: dict[str, Any]) -> None:
    """Log the inputs of a stage run now and register its output to be logged when the run FINISHES.

    Called by `start_stage_run`; never raises (a failure is a warning: tracking does not stop a stage)."""
    if getattr(tracker, "submit", None) is None:
        return
    try:
        record(tracker, stage_handoffs(stage, params))
    except Exception as e:  # noqa: BLE001 - a lineage record is never worth failing the stage for
        log.warning("could not record the inputs of this %s run as MLflow datasets: %s", stage, e)

    def output_hook(status: str) -> None:
        if status != "FINISHED":
            return
        try:
            record(tracker, stage_handoffs(stage, params, keys=(OUTPUT_KEY,), context="output"))
        except Exception as e:  # noqa: BLE001
            log.warning("could not record the output of this %s run as an MLflow dataset: %s", stage, e)

    tracker.before_finish.append(output_hook)


def handoffs_of_run(run) -> list[Handoff]:
    """The hand-offs an MLflow run recorded (`run.inputs.dataset_inputs`), in the order logged."""
    out = []
    for di in getattr(run.inputs, "dataset_inputs", None) or []:
        tags = {t.key: t.value for t in di.tags}
        if KEY_TAG not in tags:
            continue  # not one of ours
        ds = di.dataset
        uri = json.loads(ds.source).get("uri", "") if ds.source else ""
        profile = json.loads(ds.profile) if ds.profile else {}
        out.append(Handoff(tags[KEY_TAG], uri, ds.digest, tags.get(CONTEXT_TAG, ""), path=tags.get(PATH_TAG, ""),
                           shard=tags.get(SHARD_TAG, ""), name=ds.name, rows=profile.get("num_rows"),
                           kind=profile.get("kind", "")))
    return out
