"""Run lifecycle: a stage's child run, the pipeline's parent run, and ending the parent from the exit handler."""

from __future__ import annotations

import getpass
import logging
import os
import time
from pathlib import Path
from typing import Any

from .config import TrackingConfig, check_store, configured_uri, limit_http_retries, resolve_uri
from .handoffs import record_stage_handoffs
from . import kfp_plugin
from .delivery import CHAIN_TAG, PIPELINE_TAG, ROLE_TAG, chain_run_tag, create_run, find_pipeline_run
from .logged_models import record_stage_models
from .null import NullTracker
from .outbox import default_fallback_path
from .tracker import MlflowTracker

log = logging.getLogger(__name__)

#: What each stage run is, in one line: the run's description (mlflow.note.content) in the UI.
STAGE_ROLES = {
    "sft": "Supervised fine-tuning of the starting policy (policy_0).",
    "prm": "Training of the process reward model that scores every reasoning step.",
    "prm-label": "Step labels for PRM training from policy samples (Math-Shepherd completions).",
    "rollout": "Sampling of responses with the current policy, scored by the rewards and the PRM.",
    "advantage": "Token rewards, KL and advantages of the iteration's rollouts (CPU).",
    "ppo": "PPO update of the policy (and critic) on the iteration's advantages.",
    "evaluate": "Held-out evaluation of the final policy against the SFT policy on the same prompts.",
}


def run_tags(source: str, description: str) -> dict[str, str]:
    """The run's Source, User and Description as MLflow's UI shows them."""
    try:
        user = os.environ.get("PRMFLOW_USER") or getpass.getuser()
    except Exception:  # no passwd entry for the uid (a container run as an arbitrary user)
        user = str(os.getuid())
    return {"mlflow.source.name": source, "mlflow.source.type": "JOB", "mlflow.user": user,
            "mlflow.note.content": description}


def start_system_metrics(tracker, cfg: TrackingConfig) -> None:
    """Sample CPU/memory/disk/network (and GPU, with nvidia-ml-py) into the run's system/* metrics until it ends.

    MLflow's own sampler writes straight to the server, not through the tracker's queue: a sample the
    server misses is dropped (they are a live view, not a record)."""
    if not cfg.system_metrics or not tracker.run_id:  # a deferred run: no samples during an outage
        return
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=cfg.system_metrics_interval_s,
                                       tracking_uri=tracker.uri)
        monitor.start()
    except Exception as e:  # noqa: BLE001 - psutil missing, or any other reason: tracking never fails a stage
        log.warning("no system metrics for this run: %s", e)
        return
    tracker.before_finish.append(lambda status: monitor.finish())


def mlflow_client(uri: str):
    """The MlflowClient every run here talks through (one place to swap it, e.g. for a test double)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _adopt(cfg: TrackingConfig, uri: str, run_name: str, tags: dict[str, str], params: dict[str, Any] | None,
           fallback: str | Path, pipeline: bool) -> tuple[MlflowTracker | None, kfp_plugin.RuntimeConfig | None]:
    """File this run in the tree KFP 2.17's MLflow integration made on the server we log to (kfp_plugin.py):
    the pipeline's parent is KFP's run of the pipeline; a stage logs into its task's run where KFP names it
    (MLFLOW_RUN_ID, with injectUserEnvVars). Returns (the adopted tracker or None, KFP's runtime config when
    prmflow's own run must go under KFP's parent instead, else None). A KFP run that cannot be read is logged
    and prmflow makes its own runs, as without the integration."""
    kfp = kfp_plugin.target(uri)
    if kfp is None:
        return None, None
    run_id, parent = kfp.parent_run_id, ""
    if not pipeline:
        task_run = os.environ.get(kfp_plugin.RUN_ENV, "") if kfp.inject_user_env_vars else ""
        if not task_run:
            return None, kfp  # prmflow's run, under KFP's parent in KFP's experiment
        run_id, parent = task_run, kfp.parent_run_id
    client = mlflow_client(uri)
    try:
        client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - unreadable: fall back to prmflow's own runs
        log.warning("cannot read the KFP-made MLflow run %s (%s); making prmflow's own", run_id, e)
        return None, None
    tracker = MlflowTracker(client, run_id, uri, parent_run_id=parent, fallback_path=fallback,
                            finish_wait_s=cfg.finish_wait_s)
    # a stage's run gets prmflow's name (rollout-iter1 shard 0/2); the pipeline's keeps the one KFP gave it
    tracker.set_tags({**tags, **({} if pipeline else {"mlflow.runName": run_name}), "prmflow.kfp_mlflow": "adopted"})
    if params:
        tracker.log_params(params)
    return tracker, None


def start_run(cfg: TrackingConfig, run_name: str, tags: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None, fallback_path: str | Path | None = None,
              strict: bool = False) -> NullTracker:
    """Start a run (a child of the configured parent, if any); a NullTracker when tracking is off.

    strict=False: an unreachable server defers the run's creation (see the package docstring).
    strict=True: creation errors are raised (the pipeline's own parent run, whose id is an output).
    """
    if not cfg.enabled:
        return NullTracker()
    check_store(*configured_uri(cfg))  # a directory that does not exist: refused (MLflow would create it)
    uri = resolve_uri(cfg)
    limit_http_retries(cfg, uri)
    all_tags = {**{k: str(v) for k, v in (cfg.tags or {}).items()}, **{k: str(v) for k, v in (tags or {}).items()}}
    if cfg.pipeline_run_id:
        all_tags[PIPELINE_TAG] = cfg.pipeline_run_id
    fallback = cfg.fallback_path or fallback_path or default_fallback_path(None, run_name)
    adopted, kfp = _adopt(cfg, uri, cfg.run_name or run_name, all_tags, params, fallback,
                          pipeline=all_tags.get(ROLE_TAG) == "pipeline")
    if adopted is not None:
        return adopted
    tracker = MlflowTracker(mlflow_client(uri), "", uri, fallback_path=fallback, finish_wait_s=cfg.finish_wait_s)
    create = {"op": "create_run", "experiment": cfg.experiment, "run_name": cfg.run_name or run_name, "tags": all_tags,
              "parent_run_id": cfg.parent_run_id, "pipeline_run_id": cfg.pipeline_run_id}
    if kfp is not None:  # under KFP's run of the pipeline, in KFP's experiment: one tree
        create.update(parent_run_id=kfp.parent_run_id, experiment_id=kfp.experiment_id)
        all_tags["prmflow.kfp_mlflow"] = "nested"
    if strict:
        create.update(key=tracker.key, time=int(time.time() * 1000))
        tracker.run_id, tracker.parent_run_id = create_run(tracker.client, create, dedupe=False)
    else:
        tracker.submit(create)
    if params:
        tracker.log_params(params)
    return tracker


def start_pipeline_run(cfg: TrackingConfig, params: dict[str, Any] | None = None, chain_id: str = "",
                       first_iteration: int = 0) -> NullTracker:
    """The parent run of one pipeline run, tagged so stages (and the exit handler) can find it. With a `chain_id`,
    the parent run tagged with it is reused when there is one (the chain's later runs, or the same command run
    again after a stop): it is tagged with this KFP run id as one of its runs (`chain_run_tag`) and set RUNNING."""
    if chain_id and cfg.enabled:
        reused = _chain_parent(cfg, chain_id, first_iteration)
        if reused is not None:
            return reused
    tags = {ROLE_TAG: "pipeline", **({CHAIN_TAG: chain_id, chain_run_tag(cfg.pipeline_run_id): str(first_iteration)}
                                     if chain_id and cfg.pipeline_run_id else {}), **run_tags(
        f"prmflow pipeline (KFP run {cfg.pipeline_run_id or 'local'})",
        "A prmflow pipeline run: SFT and PRM, then RL iterations of rollout -> advantage -> PPO, then evaluation. "
        "Child runs: one per stage. Charts: pipeline/reward_mean, pipeline/accuracy and pipeline/kl_to_sft per RL "
        "iteration (x axis = step = iteration); final/accuracy is the held-out pass@1 of the final policy, "
        "final/baseline_accuracy the SFT policy's on the same prompts.")}
    return start_run(cfg, cfg.run_name or f"pipeline-{cfg.pipeline_run_id or 'local'}", tags, params, strict=True)


def _chain_parent(cfg: TrackingConfig, chain_id: str, first_iteration: int) -> MlflowTracker | None:
    """The parent run of chain `chain_id` in the experiment, made this KFP run's parent too; None if none yet."""
    check_store(*configured_uri(cfg))
    uri = resolve_uri(cfg)
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    found = client.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time ASC"],
                               filter_string=f"tags.`{CHAIN_TAG}` = '{chain_id}' and tags.`{ROLE_TAG}` = 'pipeline'"
                               ) if exp is not None else []
    if not found:
        return None
    run_id = found[0].info.run_id
    if cfg.pipeline_run_id:
        client.set_tag(run_id, chain_run_tag(cfg.pipeline_run_id), str(first_iteration))
    client.update_run(run_id, status="RUNNING")
    return MlflowTracker(client, run_id, uri, fallback_path=cfg.fallback_path or None, finish_wait_s=cfg.finish_wait_s)


def finish_pipeline_run(cfg: TrackingConfig, status: str | None, metrics: dict[str, float] | None = None,
                        series: list[tuple[str, float, int]] | None = None) -> str | None:
    """Mark the pipeline's parent run FINISHED or FAILED (from the KFP exit handler). Returns its id.

    `metrics` are logged at step 0, `series` as (key, value, step) points (per RL iteration). status None: the run
    stays RUNNING (a chain's run that is not its last)."""
    if not cfg.enabled or not cfg.pipeline_run_id:
        return None
    uri = resolve_uri(cfg)
    kfp_plugin.target(uri)  # on another server than KFP's: without the auth KFP set for its own
    client = mlflow_client(uri)
    run_id = find_pipeline_run(client, cfg.experiment, cfg.pipeline_run_id)
    if run_id is None:
        log.warning("no MLflow parent run for pipeline run %s", cfg.pipeline_run_id)
        return None
    tracker = MlflowTracker(client, run_id, uri, fallback_path=cfg.fallback_path or None,
                            finish_wait_s=cfg.finish_wait_s)
    if metrics:
        tracker.log_metrics(metrics)
    for key, value, step in series or []:
        tracker.log_metrics({key: value}, step=step)
    if status is None:  # what the server did not take is in the fallback file (tracking-sync)
        return run_id
    tracker.finish(status)
    return run_id


def start_stage_run(cfg: TrackingConfig, stage: str, params: dict[str, Any] | None = None,
                    iteration: int | None = None, tags: dict[str, Any] | None = None) -> NullTracker:
    """A child run for one stage invocation, tagged with the stage and the RL iteration.

    Named `<stage>`, `<stage>-iter<k>`, and `rollout-iter<k> shard <i>/<n>` for one of n > 1 shards
    (tag `prmflow.shard` = "i/n"), so every run of a pipeline has its own name. A training stage's
    held-out metrics (`eval/...` in its code) are logged as `<stage>/eval_...` (sft/eval_accuracy),
    so `eval/` means the evaluate stage only; metrics a stage copies onto the parent run are filed
    there as `final/...` (evaluate's eval/...) and `pipeline/...` (ppo's train/..., per iteration).
    The fallback file defaults to `.<output>.tracking.jsonl` beside the stage's `output` param.
    """
    tags = dict(tags or {})
    name = stage if iteration is None else f"{stage}-iter{iteration}"
    shard = str(tags.get("prmflow.shard", ""))
    if shard and not shard.endswith("/1"):
        name += f" shard {shard}"
    role = STAGE_ROLES.get(stage, f"prmflow {stage} stage.")
    where = f" RL iteration {iteration}." if iteration is not None else ""
    where += f" Shard {shard}." if shard else ""
    stage_tags = {"prmflow.stage": stage, **run_tags(f"prmflow {stage}", role + where), **tags}
    if iteration is not None:
        stage_tags["prmflow.iteration"] = iteration
    output = (params or {}).get("output") or None
    tracker = start_run(cfg, name, stage_tags, params, fallback_path=default_fallback_path(output, name))
    if isinstance(tracker, MlflowTracker):
        if stage != "evaluate":
            tracker.renames = {"eval/": f"{stage}/eval_"}
        tracker.parent_renames = {"eval/": "final/", "train/": "pipeline/"}
        start_system_metrics(tracker, cfg)
    record_stage_handoffs(tracker, stage, params or {})  # lineage: inputs now, the output at a FINISHED end
    record_stage_models(tracker, stage, params or {}, iteration, cfg.log_model_weights)  # models, at that end
    return tracker
