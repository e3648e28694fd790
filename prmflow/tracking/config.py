"""Tracking settings: the `tracking` section every stage config carries, and where its URI points."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

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
    """Append-only JSONL keeping every tracking call the server missed until it is delivered (`prmflow tracking-sync
    FILE` uploads it later). Empty: `.<output>.tracking.jsonl` beside the stage's output (survives a pod restart), else
    a file in the temp directory."""
    finish_wait_s: float = 30.0
    """At the end of a run, seconds to keep retrying calls the server missed; what is left stays in fallback_path."""
    http_timeout_s: int = 10
    """Seconds one request to a tracking server may take (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless it is set); a longer
    one counts as an outage."""
    log_model_weights: bool = False
    """Copy the weights of every model a stage writes into MLflow's artifact store (its LoggedModel). Off: the
    LoggedModel only records where the pipeline wrote them (tag prmflow.uri); copies cost as much storage as the
    checkpoints."""
    system_metrics: bool = True
    """Log CPU, memory, disk, network and (with nvidia-ml-py installed) GPU utilisation of a stage as system/* metrics."""
    system_metrics_interval_s: float = 10.0
    """Seconds between two system metrics samples."""


def configured_uri(cfg: TrackingConfig, key: str = "tracking.uri") -> tuple[str, str]:
    """The tracking URI as the user wrote it, and where it was written (`key`, the environment or the default),
    for messages that must name what to fix."""
    if cfg.uri:
        return cfg.uri, key
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI"
    return DEFAULT_STORE, "the default tracking URI"


def resolve_uri(cfg: TrackingConfig) -> str:
    uri = configured_uri(cfg)[0]
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # make a relative SQLite path absolute now, so a later chdir cannot split the store in two
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file a `sqlite:///` URI names (relative to the working directory when not absolute); None for
    any other store, and for an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]  # SQLAlchemy's query options (?timeout=30) are not the path
    return Path(path) if path and path != ":memory:" else None


def check_store(uri: str, where: str = "tracking URI", must_exist: bool = False, hint: str = "") -> str:
    """`uri`, unless it is a SQLite store a user almost surely mistyped; then a ConfigError naming it.

    MLflow opens a missing SQLite store by creating it: its directories (mlflow 3.17,
    mlflow/store/db/utils.py, _make_parent_dirs_if_sqlite) and an empty database, so `sqlite:///outputs/mlrun.db`
    for mlruns.db silently starts a second, empty store. A directory that does not exist is refused everywhere
    (a stage's first run creates the file, not the directories above it); `must_exist` (commands that read runs
    already logged: stage-command, tracking-sync) refuses a missing file too, `hint` saying how to ask for one
    anyway. Other stores pass unchanged.
    """
    path = sqlite_file(uri)
    if path is None:
        return uri
    path = path.absolute()
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{where} '{uri}': the directory '{folder}' does not exist, so there is no MLflow store "
                          f"there (MLflow would create it and an empty store). Fix the path, or run `mkdir -p {folder}` "
                          f"first if a new store there is what you want.")
    if path.is_dir():
        raise ConfigError(f"{where} '{uri}': '{path}' is a directory, not a SQLite file; name the .db file in it.")
    if must_exist and not path.is_file():
        stores = sorted(p.name for p in folder.glob("*.db") if p.is_file())
        seen = (f"the SQLite files there: {', '.join(stores[:5])}" if stores
                else f"'{folder}' holds no .db file")
        raise ConfigError(f"{where} '{uri}': no MLflow store at '{path}' ({seen}); this command works on runs "
                          f"already logged and creates no store: give the URI the stages logged to{hint}.")
    return uri


def limit_http_retries(cfg: TrackingConfig, uri: str) -> None:
    """No MLflow-side retry storms against a remote server: prmflow queues and retries itself.

    Sets MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 and MLFLOW_HTTP_REQUEST_TIMEOUT=cfg.http_timeout_s for an
    http(s) URI, unless the environment already sets them; a local store is left alone.
    """
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.http_timeout_s)))
