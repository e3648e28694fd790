"""Every model a stage writes, recorded as an MLflow 3 LoggedModel linked to the stage's run.

    record_stage_models(tracker, "ppo", params)   # at a FINISHED end: policy (and critic) of the output

A stage's output manifest says what it holds (`kind`): `policy` (sft) is one policy, `prm` one PRM,
`ppo` a directory with `policy/`, `critic/` and `policy_ema/` where they were trained. Each model
becomes a LoggedModel (MlflowClient.create_logged_model, `source_run_id` = the stage run) named
`<role>` plus `-iter<k>` in an RL iteration, with

- tags `prmflow.uri` (where the weights are: the artifact URI as KFP gives it, `s3://...`, or the
  local path), `prmflow.role` (policy, prm, critic, policy_ema), `prmflow.stage`, `prmflow.iteration`,
  `prmflow.digest` (the output manifest's fingerprint, as the output dataset records it);
- the run's final metrics (the last point of each key the stage logged, system metrics left out),
  sent again with `model_id`: the model's page lists them, and since key, value, step and timestamp
  are the point's own, the run keeps one point (its curves do not change). The run lists the model as its
  output (`log_outputs`), which the runs table shows in its Models column;
- the weights themselves only with `tracking.log_model_weights` (MlflowClient.log_model_artifacts:
  a copy of the whole directory into MLflow's artifact store). By default they stay where the
  pipeline wrote them, which `prmflow.uri` names.

The record goes through the tracker's queue and fallback file like every other call; a replay
finds a model already created by its `prmflow.model_key` tag instead of creating it twice.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: What each output kind holds: (role, subdirectory; '' = the output itself).
MODELS_BY_KIND = {"policy": [("policy", "")], "prm": [("prm", "")],
                  "ppo": [("policy", "policy"), ("critic", "critic"), ("policy_ema", "policy_ema")]}
URI_TAG, ROLE_TAG, MODEL_KEY_TAG, DIGEST_TAG = "prmflow.uri", "prmflow.role", "prmflow.model_key", "prmflow.digest"


def output_models(stage: str, output: str | os.PathLike, iteration: int | None = None,
                  log_weights: bool = False) -> list[dict]:
    """The log_model records for the models in a finished output directory ([] if it holds none)."""
    from ..components.data.io import fingerprint_files
    from .handoffs import DIGEST_CHARS, handoff_uri

    root = Path(output)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        return []
    manifest = json.loads(manifest_path.read_text())
    digest = fingerprint_files(manifest.get("files", {}))[:DIGEST_CHARS]
    records = []
    for role, sub in MODELS_BY_KIND.get(str(manifest.get("kind", "")), []):
        path = root / sub if sub else root
        if not (path / "config.json").is_file():
            continue  # not trained in this run (no critic with a critic-free estimator)
        tags = {URI_TAG: handoff_uri(path), ROLE_TAG: role, "prmflow.stage": stage, DIGEST_TAG: digest}
        if iteration is not None:
            tags["prmflow.iteration"] = str(iteration)
        records.append({"op": "log_model", "name": role if iteration is None else f"{role}-iter{iteration}",
                        "model_type": role, "tags": tags,
                        "params": {"uri": tags[URI_TAG], "weights_in_mlflow": str(bool(log_weights)).lower()},
                        "weights": str(path.resolve()) if log_weights else ""})
    return records


def record_stage_models(tracker, stage: str, params: dict[str, Any], iteration: int | None = None,
                        log_weights: bool = False) -> None:
    """Have the tracker log the models in the stage's output when its run ends FINISHED.

    Called by `start_stage_run`; never raises (a failure is a warning: tracking does not stop a stage)."""
    output = params.get("output")
    if getattr(tracker, "submit", None) is None or not output:
        return

    def hook(status: str) -> None:
        if status != "FINISHED":
            return
        try:
            final = [[k, v, ts, step] for k, (v, ts, step) in tracker.latest.items() if not k.startswith("system/")]
            for record in output_models(stage, output, iteration, log_weights):
                tracker.submit({**record, "metrics": final})
        except Exception as e:  # noqa: BLE001 - a lineage record is never worth failing the stage for
            log.warning("could not record the models of this %s run in MLflow: %s", stage, e)

    tracker.before_finish.append(hook)


def deliver_model(client, op: dict, run_id: str) -> str:
    """Create (or, on a replay, find) the LoggedModel of a log_model record; returns its model id."""
    from mlflow.entities import LoggedModelOutput, Metric

    run = client.get_run(run_id)
    experiment = run.info.experiment_id
    key = op["id"]
    found = client.search_logged_models([experiment], filter_string=f"tags.`{MODEL_KEY_TAG}` = '{key}'",
                                        max_results=1).to_list()
    if found:
        model = found[0]
    else:
        model = client.create_logged_model(experiment, name=op["name"], source_run_id=run_id,
                                           tags={**op["tags"], MODEL_KEY_TAG: key}, params=op.get("params"),
                                           model_type=op.get("model_type"))
    # the run's own points again (same timestamp: MLflow keeps one), now linked to the model
    metrics = [Metric(k, float(v), int(ts), int(step), model_id=model.model_id) for k, v, ts, step in op.get("metrics", [])]
    for i in range(0, len(metrics), 1000):  # MLflow's log_batch limit
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    if model.model_id not in {o.model_id for o in getattr(run.outputs, "model_outputs", None) or []}:  # twice: refused
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, max((m.step for m in metrics), default=0))])
    if op.get("weights") and model.status != "READY":
        path = Path(op["weights"])
        if not path.is_dir():
            raise FileNotFoundError(f"model directory '{path}' no longer exists")
        client.log_model_artifacts(model.model_id, str(path))
    if str(model.status) != "READY":
        client.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def models_of_run(client, run) -> list:
    """The LoggedModels a stage run produced (its source_run_id), oldest first."""
    return sorted(client.search_logged_models([run.info.experiment_id],
                                              filter_string=f"source_run_id = '{run.info.run_id}'").to_list(),
                  key=lambda m: m.creation_timestamp)
