"""What every KFP component does inside its container: build the stage's Config and call run().

The components (prmflow/pipelines/components.py) are thin: they name their artifacts and
call `run_stage` with their stage module, which layers, lowest to highest: the stage section of the
pipeline config (a dict pipeline parameter), the tracking settings of this pipeline run, and the
artifact paths KFP chose. Nothing here imports KFP: the components pass plain paths and values.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from ..components.common import config as config_lib
from ..components.common import shutdown
from . import trainjob


def run_stage(name: str, stage: ModuleType, config: dict, paths: dict[str, Any], kfp_run_id: str = "",
              tracking_uri: str = "", experiment: str = "prmflow", iteration: int | None = None) -> dict:
    """Run `stage` (a module with `Config` and `run`), called `name` in errors, with `config` (its
    Config keys) plus artifact `paths`; returns its metrics."""
    where = f"pipeline step '{name}'"
    shutdown.freeze_objects_at_exit()  # this task's process ends when the stage does
    values = config_lib.flatten(dict(config or {}))
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
