"""What every KFP component does inside its container: build the stage's Config and call run().

The components (prmflow/pipelines/kfp_components.py) are thin: they name their artifacts and
call `run_stage` with their stage module, which layers, lowest to highest: the stage section of the
pipeline config (a dict pipeline parameter), the tracking settings of this pipeline run, and the
artifact paths KFP chose. Nothing here imports KFP: the components pass plain paths and values.

Heavy state (weights, optimizer moments, resume checkpoints) goes to the pipeline's workspace, a
ReadWriteMany volume every step mounts (a local directory under run-local), at a path decided by
what the step computes (stage, iteration, shard, config, input fingerprints), never by the run id:
a retried pod or a re-submitted run finds its own earlier work there (`workspace_output`). The KFP
artifact of such an output is a *location*: a small directory holding `location.json` (where, the
fingerprint, every file's sha256 and size), so the launcher, which downloads every input artifact
whole (kubeflow/pipelines backend/src/v2/component/launcher_v2.go, downloadArtifacts), moves
kilobytes; the reader opens the state in place (`located`).

The KFP run id (for the MLflow parent run) reaches a step through the environment
($PRMFLOW_KFP_RUN_ID: the pod's `pipeline/runid` label on a cluster, set by run-local here), not as a
parameter: parameters are cache-key inputs (backend/src/v2/cacheutils/cache.go, GenerateCacheKey),
environment variables are not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from ..components import config as config_lib
from ..components.data.io import fingerprint_files, sha256_file as io_sha256
from ..components.runtime import shutdown
from ..errors import DataError
from . import trainjob

#: Environment variable holding the KFP run id inside a step (not a cache-key input).
RUN_ID_ENV = "PRMFLOW_KFP_RUN_ID"
#: The file that makes an artifact directory a location of state kept on the workspace.
LOCATION_FILE = "location.json"


def run_stage(name: str, stage: ModuleType, config: dict, paths: dict[str, Any], kfp_run_id: str | None = None,
              tracking_uri: str = "", experiment: str = "prmflow", iteration: int | None = None) -> dict:
    """Run `stage` (a module with `Config` and `run`), called `name` in errors, with `config` (its
    Config keys) plus artifact `paths`; returns its metrics."""
    where = f"pipeline step '{name}'"
    shutdown.freeze_objects_at_exit()  # this task's process ends when the stage does
    values = config_lib.flatten(dict(config or {}))
    if kfp_run_id is None:
        kfp_run_id = os.environ.get(RUN_ID_ENV, "")
    values.update({"tracking.pipeline_run_id": kfp_run_id, "tracking.experiment": experiment})
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        values["tracking.uri"] = uri
    if iteration is not None:
        values["iteration"] = iteration
    values.update(paths)
    spec = trainjob.spec_from_env()
    if spec is not None:  # the pipeline runs this stage on several nodes: submit a TrainJob and wait
        return trainjob.run(name, stage.Config, values, paths, spec, kfp_run_id, iteration)
    cfg = config_lib.build(stage.Config, values, where=where)
    return stage.run(cfg) or {}


def artifact_metadata(metrics: dict) -> dict:
    """Metrics as KFP artifact metadata (finite numbers and short strings only)."""
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k.replace("/", "_")] = float(v)
    return out


def dataset_metadata(path: str) -> dict:
    """Rows and schema version of a committed hand-off directory (for the Dataset artifact)."""
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    return {"rows": manifest.get("rows", 0), "schema_version": manifest.get("schema_version", 0),
            "kind": manifest.get("kind", "")}


def gather_shards(paths: list[str], into: str) -> str:
    """A directory whose subdirectories link to each collected shard, readable as one dataset."""
    root = Path(into)
    root.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(paths):
        link = root / f"shard-{i:05d}"
        if not link.exists():
            link.symlink_to(Path(p).resolve(), target_is_directory=True)
    return str(root)


def output_key(stage: str, config: dict, inputs: dict[str, Any]) -> str:
    """The workspace name of what a step computes: its stage, config and inputs (their fingerprints),
    never the run id, so a retry or a re-submission with the same inputs lands on the same path."""
    blob = json.dumps({"stage": stage, "config": config or {}, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def workspace_output(workspace: str, name: str, stage: str, config: dict, inputs: dict[str, Any]) -> str:
    """Where a step writes its heavy output on the workspace: WORKSPACE/NAME-KEY (see `output_key`)."""
    if not workspace:
        raise DataError(f"pipeline step '{stage}': no workspace. Heavy state (weights, optimizer moments) lives on "
                        "the pipeline's workspace: set pipeline.cluster.workspace_pvc or workspace_size.")
    return os.path.join(workspace, f"{name}-{output_key(stage, config, inputs)}")


def write_location(artifact_dir: str, where: str, sub: str = "") -> dict:
    """Make `artifact_dir` the location of the committed output at `where` (its `sub` directory, if
    given): location.json with the fingerprint, sha256 and size of each file. Returns its metadata."""
    root = Path(where)
    prefix = f"{sub}/" if sub else ""
    if (root / "manifest.json").is_file():  # a prmflow output: its manifest already holds every sha256
        manifest = json.loads((root / "manifest.json").read_text())
        files = {k[len(prefix):]: v for k, v in manifest.get("files", {}).items() if k.startswith(prefix)}
    else:  # a model from elsewhere (e.g. downloaded to the volume): hashed once here
        files = {p.relative_to(root).as_posix(): io_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}
    sizes = {k: (root / prefix / k).stat().st_size for k in files}
    target = str(root / sub) if sub else str(root)
    record = {"where": target, "fingerprint": fingerprint_files(files), "files": files, "sizes": sizes,
              "bytes": sum(sizes.values())}
    Path(artifact_dir).mkdir(parents=True, exist_ok=True)
    (Path(artifact_dir) / LOCATION_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    return {"where": target, "fingerprint": record["fingerprint"], "bytes": record["bytes"]}


def read_location(artifact_dir: str) -> dict | None:
    """The location record of an artifact directory, or None when the artifact holds the data itself."""
    p = Path(artifact_dir) / LOCATION_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def located(artifact_dir: str, verify: bool = False) -> str:
    """The directory an input artifact stands for: the workspace path its location names (checked to be
    there with every file at its recorded size; with verify, sha256 too), or the artifact itself."""
    record = read_location(artifact_dir)
    if record is None:
        return artifact_dir
    where = Path(record["where"])
    for name, size in record["sizes"].items():
        f = where / name
        if not f.is_file() or f.stat().st_size != size:
            raise DataError(f"'{f}' (named by the artifact '{artifact_dir}') is missing or not {size} bytes: the "
                            f"workspace no longer holds the state this step needs. Re-run the step that wrote it "
                            f"(with caching off), or restore the workspace volume.")
        if verify and io_sha256(f) != record["files"][name]:
            raise DataError(f"'{f}' does not match the sha256 its artifact '{artifact_dir}' recorded.")
    return str(where)


def location_fingerprint(artifact_dir: str) -> str:
    """What identifies an input artifact's content: its location's fingerprint, or its own manifest's."""
    record = read_location(artifact_dir)
    if record is not None:
        return record["fingerprint"]
    manifest = Path(artifact_dir) / "manifest.json"
    if manifest.is_file():
        return fingerprint_files(json.loads(manifest.read_text()).get("files", {}))
    return str(Path(artifact_dir).resolve())
