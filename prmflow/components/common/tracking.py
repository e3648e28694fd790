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
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_STORE = "sqlite:///mlflow.db"


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


def resolve_uri(cfg: TrackingConfig) -> str:
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI", "") or DEFAULT_STORE
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # make a relative SQLite path absolute now, so a later chdir cannot split the store in two
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


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
    def finish(self, status: str = "FINISHED") -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.finish("FAILED" if exc_type else "FINISHED")
        return False


class MlflowTracker(NullTracker):
    """An MLflow run driven through `MlflowClient` (no global active-run state)."""

    def __init__(self, client, run_id: str, uri: str):
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self._finished = False

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step or 0)) for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        if not self._finished:
            self.client.set_terminated(self.run_id, status=status)
            self._finished = True


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


PIPELINE_TAG = "prmflow.pipeline_run_id"
ROLE_TAG = "prmflow.role"


def find_pipeline_run(client, experiment: str, pipeline_run_id: str) -> str | None:
    """Id of the parent run that init_tracking created for KFP run `pipeline_run_id`, if any."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], max_results=1,
                              filter_string=f"tags.`{PIPELINE_TAG}` = '{pipeline_run_id}' and tags.`{ROLE_TAG}` = 'pipeline'")
    return runs[0].info.run_id if runs else None


def start_run(cfg: TrackingConfig, run_name: str, tags: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None) -> NullTracker:
    """Start a run (a child of the configured parent, if any); a NullTracker when tracking is off."""
    if not cfg.enabled:
        return NullTracker()
    uri = resolve_uri(cfg)
    client = _client(uri)
    all_tags = {**{k: str(v) for k, v in (cfg.tags or {}).items()}, **{k: str(v) for k, v in (tags or {}).items()}}
    parent = cfg.parent_run_id
    if not parent and cfg.pipeline_run_id:
        parent = find_pipeline_run(client, cfg.experiment, cfg.pipeline_run_id) or ""
        if not parent:
            log.warning("no MLflow parent run is tagged %s=%s; logging a top-level run", PIPELINE_TAG, cfg.pipeline_run_id)
    if cfg.pipeline_run_id:
        all_tags[PIPELINE_TAG] = cfg.pipeline_run_id
    if parent:
        all_tags["mlflow.parentRunId"] = parent
    run = client.create_run(experiment_id(client, cfg.experiment), run_name=cfg.run_name or run_name, tags=all_tags)
    tracker = MlflowTracker(client, run.info.run_id, uri)
    if params:
        tracker.log_params(params)
    log.info("MLflow run %s in %s", run.info.run_id, uri)
    return tracker


def start_pipeline_run(cfg: TrackingConfig, params: dict[str, Any] | None = None) -> NullTracker:
    """The parent run of one pipeline run, tagged so stages (and the exit handler) can find it."""
    return start_run(cfg, cfg.run_name or f"pipeline-{cfg.pipeline_run_id or 'local'}", {ROLE_TAG: "pipeline"}, params)


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
    tracker = MlflowTracker(client, run_id, uri)
    if metrics:
        tracker.log_metrics(metrics)
    tracker.finish(status)
    return run_id


def start_stage_run(cfg: TrackingConfig, stage: str, params: dict[str, Any] | None = None,
                    iteration: int | None = None, tags: dict[str, Any] | None = None) -> NullTracker:
    """A child run for one stage invocation, tagged with the stage and the RL iteration."""
    name = stage if iteration is None else f"{stage}-iter{iteration}"
    stage_tags = {"prmflow.stage": stage, **(tags or {})}
    if iteration is not None:
        stage_tags["prmflow.iteration"] = iteration
    return start_run(cfg, name, stage_tags, params)
