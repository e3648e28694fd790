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

Modules, each with one job:
    config.py    TrackingConfig, the URI it resolves to, MLflow's HTTP retry settings
    null.py      NullTracker: the tracker interface, doing nothing
    outbox.py    FallbackLog: the append-only JSONL fallback file
    delivery.py  one recorded call -> MLflow client calls; permanent refusal vs outage
    tracker.py   MlflowTracker: send now, or queue + file + retry with backoff
    sync.py      sync_fallback and the `prmflow tracking-sync` command
    runs.py      run lifecycle: start_stage_run, start_pipeline_run, finish_pipeline_run
    kfp_plugin.py  KFP 2.17's MLflow plugin: what a task is told, and how prmflow's runs join KFP's tree
    handoffs.py  lineage: a stage's input and output hand-offs as MLflow datasets
    logged_models.py    lineage: the models a stage writes as MLflow LoggedModels (weights stay in the artifact store)

What the MLflow UI shows (docs/mlflow.md): run names unique within a pipeline run
(`rollout-iter1 shard 0/2`), source/user/description tags, system/* metrics, experiments tagged as
model training; `eval/` is the evaluate stage's namespace (a training stage's held-out `eval/x` is
logged as `<stage>/eval_x`), and a stage's copies onto the parent are `final/*` (evaluate) and
`pipeline/*` (ppo, one point per RL iteration).
"""

from .config import DEFAULT_STORE, TrackingConfig, check_store, configured_uri, resolve_uri
from .delivery import PIPELINE_TAG, ROLE_TAG, RUN_KEY_TAG, experiment_id, find_pipeline_run
from .null import NullTracker
from .outbox import FallbackLog, default_fallback_path
from .runs import finish_pipeline_run, start_pipeline_run, start_run, start_stage_run
from .sync import TrackingUnavailable, add_sync_command, sync_fallback
from .tracker import MlflowTracker

__all__ = [
    "DEFAULT_STORE", "PIPELINE_TAG", "ROLE_TAG", "RUN_KEY_TAG", "FallbackLog", "MlflowTracker", "NullTracker",
    "TrackingConfig", "TrackingUnavailable", "add_sync_command", "check_store", "configured_uri",
    "default_fallback_path", "experiment_id",
    "finish_pipeline_run", "find_pipeline_run", "resolve_uri", "start_pipeline_run", "start_run", "start_stage_run",
    "sync_fallback",
]
