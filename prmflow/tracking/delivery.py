"""One recorded tracking call turned into MLflow client calls, and how its failures are classified.

A record is a dict with an `op` (create_run, log_batch, log_text, log_table, log_artifact,
log_inputs, log_model, set_terminated) as the tracker queues it and the fallback file keeps it. A failure is either
permanent (the server refused the call: retrying cannot help) or an outage (retried later).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

PIPELINE_TAG = "prmflow.pipeline_run_id"
ROLE_TAG = "prmflow.role"
RUN_KEY_TAG = "prmflow.run_key"
#: A pipeline parent run's chain (pipelines/chain.py): the runs of one chain, and the same command run again, share it.
CHAIN_TAG = "prmflow.chain_id"


def chain_run_tag(pipeline_run_id: str) -> str:
    """The tag on a chain's parent run that makes it the parent of KFP run `pipeline_run_id` too (value: the run's
    first iteration)."""
    return f"prmflow.chain_run.{pipeline_run_id}"
#: MLflow error codes that a retry cannot fix: the call is dropped (kept in the fallback file, marked).
PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST", "INVALID_STATE",
                    "RESOURCE_DOES_NOT_EXIST", "MALFORMED_REQUEST"}


def is_permanent(e: BaseException) -> bool:
    """True when the server refused the call (a retry would be refused too); False for an outage."""
    return getattr(e, "error_code", None) in PERMANENT_ERRORS or isinstance(e, (FileNotFoundError, TypeError))


def short_error(e: BaseException, limit: int = 300) -> str:
    """The first line of an error, at most about `limit` characters (MLflow errors carry whole responses). A longer
    one keeps its start and its end, marked ' ... ' where it was cut: the cause (`[Errno 111] Connection refused`)
    is at the end of urllib3's message, after the URL."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if len(text) <= limit:
        return text
    tail = limit // 3
    return f"{text[:limit - tail - 5]} ... {text[-tail:]}"


#: Marks an experiment as model training for MLflow (3.x) clients; one prmflow sets unless it is set already.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def experiment_id(client, name: str) -> str:
    """Id of experiment `name`, created if missing and marked as model training (EXPERIMENT_KIND_TAG)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except Exception:  # created concurrently by another stage
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if EXPERIMENT_KIND_TAG not in (exp.tags or {}):  # made by an older prmflow, or by hand
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


def find_pipeline_run(client, experiment: str, pipeline_run_id: str) -> str | None:
    """Id of the parent run that init_tracking created (or adopted: KFP >= 2.17's own run of the pipeline
    run, in the backend's experiment) for KFP run `pipeline_run_id`, if any."""
    from .kfp_plugin import runtime_config

    kfp = runtime_config()  # KFP 2.17's MLflow integration: its run of the pipeline, when on this server
    if kfp is not None:
        try:
            if client.get_run(kfp.parent_run_id).data.tags.get(PIPELINE_TAG) == pipeline_run_id:
                return kfp.parent_run_id
        except Exception:  # noqa: BLE001 - another server, or gone: search by tag below
            pass
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], max_results=1,
                              filter_string=f"tags.`{PIPELINE_TAG}` = '{pipeline_run_id}' and tags.`{ROLE_TAG}` = 'pipeline'")
    if not runs:  # a later run of a chain, or a run started again: the chain's parent names it (runs.start_pipeline_run)
        runs = client.search_runs([exp.experiment_id], max_results=1, filter_string=(
            f"tags.`{chain_run_tag(pipeline_run_id)}` LIKE '%' and tags.`{ROLE_TAG}` = 'pipeline'"))
    return runs[0].info.run_id if runs else None


def create_run(client, op: dict, dedupe: bool) -> tuple[str, str]:
    """Create the run described by a create_run record; returns (run_id, parent_run_id)."""
    exp = op.get("experiment_id") or experiment_id(client, op["experiment"])  # an id: KFP's experiment
    if dedupe:  # a replay: the run may already exist from an attempt whose answer was lost
        found = client.search_runs([exp], filter_string=f"tags.`{RUN_KEY_TAG}` = '{op['key']}'", max_results=1)
        if found:
            return found[0].info.run_id, found[0].data.tags.get("mlflow.parentRunId", "")
    parent = op.get("parent_run_id") or ""
    if not parent and op.get("pipeline_run_id") and op.get("tags", {}).get(ROLE_TAG) != "pipeline":  # not the parent itself
        parent = find_pipeline_run(client, op["experiment"], op["pipeline_run_id"]) or ""
        if not parent:
            log.warning("no MLflow parent run is tagged %s=%s; logging a top-level run", PIPELINE_TAG, op["pipeline_run_id"])
    tags = {**op.get("tags", {}), RUN_KEY_TAG: op["key"]}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = client.create_run(exp, start_time=op.get("time"), tags=tags, run_name=op.get("run_name") or None)
    return run.info.run_id, parent


def deliver(client, op: dict, run_id: str) -> None:
    """Send one logged call (not create_run) to run `run_id`."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "log_batch":
        client.log_batch(run_id, metrics=[Metric(k, float(v), int(ts), int(s)) for k, v, ts, s in op.get("metrics", [])],
                         params=[Param(k, v) for k, v in op.get("params", {}).items()],
                         tags=[RunTag(k, v) for k, v in op.get("tags", {}).items()])
    elif kind == "log_text":
        client.log_text(run_id, op["text"], op["artifact_file"])
    elif kind == "log_table":
        client.log_table(run_id, data=op["data"], artifact_file=op["artifact_file"])
    elif kind == "log_artifact":
        path = Path(op["path"])
        if not path.exists():
            raise FileNotFoundError(f"artifact '{path}' no longer exists")
        if path.is_dir():
            client.log_artifacts(run_id, str(path), op.get("artifact_path"))
        else:
            client.log_artifact(run_id, str(path), op.get("artifact_path"))
    elif kind == "log_inputs":  # lineage datasets (handoffs.py)
        from .handoffs import deliver_datasets

        deliver_datasets(client, op, run_id)
    elif kind == "log_model":  # a LoggedModel of a model the stage wrote (logged_models.py)
        from .logged_models import deliver_model

        deliver_model(client, op, run_id)
    elif kind == "set_terminated":
        client.set_terminated(run_id, status=op["status"], end_time=op.get("time"))
    else:
        raise TypeError(f"unknown tracking record {kind!r}")
