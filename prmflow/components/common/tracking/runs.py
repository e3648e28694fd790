"""Run lifecycle: a stage's child run, the pipeline's parent run, and ending the parent from the exit handler."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from .config import TrackingConfig, limit_http_retries, resolve_uri
from .datasets import record_stage_handoffs
from .delivery import PIPELINE_TAG, ROLE_TAG, create_run, find_pipeline_run
from .null import NullTracker
from .outbox import default_fallback_path
from .tracker import MlflowTracker

log = logging.getLogger(__name__)


def mlflow_client(uri: str):
    """The MlflowClient every run here talks through (one place to swap it, e.g. for a test double)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def start_run(cfg: TrackingConfig, run_name: str, tags: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None, fallback_path: str | Path | None = None,
              strict: bool = False) -> NullTracker:
    """Start a run (a child of the configured parent, if any); a NullTracker when tracking is off.

    strict=False: an unreachable server defers the run's creation (see the package docstring).
    strict=True: creation errors are raised (the pipeline's own parent run, whose id is an output).
    """
    if not cfg.enabled:
        return NullTracker()
    uri = resolve_uri(cfg)
    limit_http_retries(cfg, uri)
    all_tags = {**{k: str(v) for k, v in (cfg.tags or {}).items()}, **{k: str(v) for k, v in (tags or {}).items()}}
    if cfg.pipeline_run_id:
        all_tags[PIPELINE_TAG] = cfg.pipeline_run_id
    fallback = cfg.fallback_path or fallback_path or default_fallback_path(None, run_name)
    tracker = MlflowTracker(mlflow_client(uri), "", uri, fallback_path=fallback, finish_wait_s=cfg.finish_wait_s)
    create = {"op": "create_run", "experiment": cfg.experiment, "run_name": cfg.run_name or run_name, "tags": all_tags,
              "parent_run_id": cfg.parent_run_id, "pipeline_run_id": cfg.pipeline_run_id}
    if strict:
        create.update(key=tracker.key, time=int(time.time() * 1000))
        tracker.run_id, tracker.parent_run_id = create_run(tracker.client, create, dedupe=False)
    else:
        tracker.submit(create)
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
    client = mlflow_client(uri)
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
    tracker = start_run(cfg, name, stage_tags, params, fallback_path=default_fallback_path(output, name))
    record_stage_handoffs(tracker, stage, params or {})  # lineage: inputs now, the output at a FINISHED end
    return tracker
