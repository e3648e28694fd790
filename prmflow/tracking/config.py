"""Tracking settings: the `tracking` section every stage config carries, and where its URI points."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

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
    fallback_path: str = ""
    """Append-only JSONL keeping every tracking call the server missed until it is delivered (`prmflow tracking-sync FILE` uploads it later). Empty: `.<output>.tracking.jsonl` beside the stage's output (survives a pod restart), else a file in the temp directory."""
    finish_wait_s: float = 30.0
    """At the end of a run, seconds to keep retrying calls the server missed; what is left stays in fallback_path."""
    http_timeout_s: int = 10
    """Seconds one request to a tracking server may take (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless it is set); a longer one counts as an outage."""
    log_model_weights: bool = False
    """Copy the weights of every model a stage writes into MLflow's artifact store (its LoggedModel). Off: the LoggedModel only records where the pipeline wrote them (tag prmflow.uri); copies cost as much storage as the checkpoints."""
    system_metrics: bool = True
    """Log CPU, memory, disk, network and (with nvidia-ml-py installed) GPU utilisation of a stage as system/* metrics."""
    system_metrics_interval_s: float = 10.0
    """Seconds between two system metrics samples."""


def resolve_uri(cfg: TrackingConfig) -> str:
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI", "") or DEFAULT_STORE
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # make a relative SQLite path absolute now, so a later chdir cannot split the store in two
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


def limit_http_retries(cfg: TrackingConfig, uri: str) -> None:
    """No MLflow-side retry storms against a remote server: prmflow queues and retries itself.

    Sets MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 and MLFLOW_HTTP_REQUEST_TIMEOUT=cfg.http_timeout_s for an
    http(s) URI, unless the environment already sets them; a local store is left alone.
    """
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.http_timeout_s)))
