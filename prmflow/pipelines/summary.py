"""The end of a pipeline run in MLflow: the table it prints, the parent's summary metrics, the registered models.

    stage        held-out pass@1   train reward   train accuracy   KL to SFT
    sft                    0.310              -                -           -
    iter 0                     -          0.402            0.402       0.000
    iter 1                     -          0.455            0.455       0.004
    final                  0.420              -                -           -

"held-out pass@1" is greedy accuracy on held-out prompts (sft: the SFT stage's own eval set; final:
the evaluate stage, which also scores the SFT policy on the same prompts as `sft (same prompts)`).
"train reward/accuracy" are the rollout stage's means over the prompts sampled at that iteration,
before its PPO update; "KL to SFT" is the rollout stage's k1 estimate of KL(policy_k || SFT policy).

The same per-iteration numbers go onto the parent run as `pipeline/reward_mean`, `pipeline/accuracy`
and `pipeline/kl_to_sft` at step = iteration (`parent_summary`), so the parent's chart view draws
reward per RL iteration; `register_models` puts the final policy and the PRM into the Model Registry.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Row:
    stage: str
    values: dict[str, float] = field(default_factory=dict)


COLUMNS = [("held-out pass@1", "pass1"), ("train reward", "reward"), ("train accuracy", "accuracy"),
           ("KL to SFT", "kl")]


def pipeline_rows(client, parent_run_id: str) -> list[Row]:
    """One row for SFT, one per RL iteration, and the final evaluation, from the parent's child runs."""
    rows: list[Row] = []
    by_stage: dict[str, list] = defaultdict(list)
    for run in child_runs(client, parent_run_id):
        by_stage[run.data.tags.get("prmflow.stage", "")].append(run)
    for run in by_stage.get("sft", [])[:1]:  # eval/accuracy: runs logged before the sft/ namespace
        m = run.data.metrics
        rows.append(Row("sft", {"pass1": m.get("sft/eval_accuracy", m.get("eval/accuracy", math.nan))}))
    iterations: dict[int, list] = defaultdict(list)
    for run in by_stage.get("rollout", []):
        iterations[int(run.data.tags.get("prmflow.iteration", 0))].append(run)
    for k in sorted(iterations):
        shards = iterations[k]
        # shard means weighted by their sample counts, so the row is the mean over the whole batch
        weights = [r.data.metrics.get("rollout/samples", 1.0) for r in shards]
        total = sum(weights) or 1.0

        def mean(key: str) -> float:
            vals = [(r.data.metrics.get(key), w) for r, w in zip(shards, weights)]
            if any(v is None for v, _ in vals):
                return math.nan
            return sum(v * w for v, w in vals) / total

        rows.append(Row(f"iter {k}", {"reward": mean("rollout/reward_mean"), "accuracy": mean("rollout/accuracy"),
                                      "kl": mean("rollout/kl_k1")}))
    for run in by_stage.get("evaluate", [])[:1]:
        m = run.data.metrics
        if "eval/baseline_accuracy" in m:
            rows.append(Row("sft (same prompts)", {"pass1": m["eval/baseline_accuracy"]}))
        rows.append(Row("final", {"pass1": m.get("eval/accuracy", math.nan)}))
    return rows


def child_runs(client, parent_run_id: str) -> list:
    """The stage runs filed under a pipeline's parent run, one per task: where a task ran more than once under
    it (a run stopped and started again, whose chain reuses its parent: pipelines/chain.py), its last
    finished attempt, else its last."""
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], max_results=5000,
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    latest: dict[tuple, object] = {}
    for run in sorted(runs, key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0)):
        tags = run.data.tags
        latest[(tags.get("prmflow.stage", run.info.run_name), tags.get("prmflow.iteration"), tags.get("prmflow.shard"))] = run
    return sorted(latest.values(), key=lambda r: r.info.start_time or 0, reverse=True)


def format_table(rows: list[Row]) -> str:
    width = max([len("stage")] + [len(r.stage) for r in rows])
    head = "stage".ljust(width) + "".join(f"  {name:>15}" for name, _ in COLUMNS)
    lines = [head]
    for r in rows:
        cells = []
        for _, key in COLUMNS:
            v = r.values.get(key)
            # + 0.0 after rounding: a value that rounds to zero from below (the KL of a policy to itself, float
            # noise of -1e-6) prints 0.000, not -0.000
            cells.append(f"  {'-' if v is None or math.isnan(v) else f'{round(v, 3) + 0.0:.3f}':>15}")
        lines.append(r.stage.ljust(width) + "".join(cells))
    return "\n".join(lines)


#: Parent-run metric (logged at step = RL iteration) <- summary table column.
ITERATION_METRICS = {"pipeline/reward_mean": "reward", "pipeline/accuracy": "accuracy", "pipeline/kl_to_sft": "kl"}


def parent_summary(client, parent_run_id: str) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """What the exit handler logs on the parent: (stage summaries, [(key, value, step)] per RL iteration).

    Summaries: the training stages' held-out metrics as they logged them (sft/eval_accuracy,
    prm/eval_step_auc; runs from before that namespace: eval/x filed as <stage>/x). The evaluate
    stage has already copied its own onto the parent, as final/*. Per iteration: the table's
    train reward, accuracy and KL to SFT (batch means over the rollout shards)."""
    summaries: dict[str, float] = {}
    for child in sorted(child_runs(client, parent_run_id), key=lambda r: r.info.start_time):  # later runs win
        stage = child.data.tags.get("prmflow.stage", "")
        if stage in ("evaluate", "rollout", "advantage", "ppo"):
            continue
        for key, value in child.data.metrics.items():
            if key.startswith(f"{stage}/eval_"):
                summaries[key] = value
            elif key.startswith("eval/"):
                summaries[f"{stage}/{key[len('eval/'):]}"] = value
    series = []
    for row in pipeline_rows(client, parent_run_id):
        if row.stage.startswith("iter "):
            step = int(row.stage.split()[1])
            series += [(key, row.values[col], step) for key, col in ITERATION_METRICS.items()
                       if not math.isnan(row.values.get(col, math.nan))]
    return summaries, series


def register_models(uri: str, experiment: str, parent_run_id: str) -> dict[str, int]:
    """Register the final policy and the PRM of a finished pipeline run; returns {name: version}.

    `<experiment>-policy` gets the policy of the last PPO iteration (the SFT policy with no RL
    iteration), `<experiment>-prm` the PRM the run ends with (the last prm-update's with
    pipeline.prm_update, else the prm stage's): each a new version whose source is the stage run's
    LoggedModel (`models:/<model id>`), whose run is the pipeline's parent run (the UI links it),
    with the evaluation metrics (final/* for the policy, prm/eval_* for the PRM) as tags and in the
    description, and the weights' URI (`prmflow.uri`). The policy's LoggedModel also gets the
    final/* metrics, and both models are listed as the parent run's outputs (run.outputs; the UI's
    Models column lists a run's own LoggedModels, so the parent's stays empty). Registering the same parent run again
    adds no version. Never raises: a model that cannot be registered is a warning."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.tracking import MlflowClient

    from ..tracking.logged_models import ROLE_TAG, URI_TAG, models_of_run

    client = MlflowClient(uri)
    children = [r for r in child_runs(client, parent_run_id) if r.info.status == "FINISHED"]

    def last(stage: str):
        runs = [r for r in children if r.data.tags.get("prmflow.stage") == stage]
        return max(runs, key=lambda r: int(r.data.tags.get("prmflow.iteration", 0)), default=None)

    parent = client.get_run(parent_run_id)
    final = {k: client.get_metric_history(parent_run_id, k)[-1] for k in parent.data.metrics if k.startswith("final/")}
    versions = {}
    # the PRM the pipeline ends with: the last on-policy update's (pipeline.prm_update), else the prm stage's
    for suffix, run in (("policy", last("ppo") or last("sft")), ("prm", last("prm-update") or last("prm"))):
        model = next((m for m in models_of_run(client, run) if m.tags.get(ROLE_TAG) == suffix), None) if run else None
        if model is None:
            log.warning("pipeline run %s has no %s LoggedModel to register", parent_run_id, suffix)
            continue
        name = f"{experiment}-{suffix}"
        scores = ({k: m.value for k, m in final.items()} if suffix == "policy" else
                  {k: v for k, v in run.data.metrics.items() if k.startswith(("prm/eval_", "prm-update/eval_"))})
        try:
            versions[name] = _register(client, uri, name, model, run, parent, scores, model.tags.get(URI_TAG, ""))
            if model.model_id not in {o.model_id for o in parent.outputs.model_outputs or []}:  # twice: refused
                client.log_outputs(parent_run_id, [LoggedModelOutput(model.model_id, 0)])  # the pipeline's outputs
            if suffix == "policy" and final:  # the final evaluation on the policy's model page
                from mlflow.entities import Metric

                client.log_batch(parent_run_id, metrics=[Metric(k, m.value, m.timestamp, m.step, model_id=model.model_id)
                                                         for k, m in final.items()])
        except Exception as e:  # noqa: BLE001 - the pipeline's result does not depend on its registration
            log.warning("could not register %s from pipeline run %s: %s", name, parent_run_id, e)
    return versions


def _register(client, tracking_uri: str, name: str, model, run, parent, scores: dict[str, float], uri: str) -> int:
    import mlflow
    from mlflow.exceptions import MlflowException

    parent_id = parent.info.run_id
    found = client.search_model_versions(f"name = '{name}' and tags.`prmflow.parent_run_id` = '{parent_id}'")
    if found:
        return int(found[0].version)
    try:
        client.create_registered_model(name, description=(
            f"{'Policy after the last RL iteration' if name.endswith('-policy') else 'Process reward model'} of "
            f"prmflow pipeline runs in experiment '{name.rsplit('-', 1)[0]}'. Each version: one pipeline run (its "
            f"Source run), the weights' URI (tag prmflow.uri), the evaluation metrics as tags."))
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(scores.items()))
    description = (f"From pipeline run '{parent.info.run_name}' (MLflow run {parent_id}, experiment "
                   f"{parent.info.experiment_id}), stage run '{run.info.run_name}' ({run.info.run_id}). "
                   f"Weights: {uri}." + (f" Evaluation: {shown}." if shown else ""))
    tags = {"prmflow.parent_run_id": parent_id, "prmflow.stage_run_id": run.info.run_id, "prmflow.uri": uri,
            **{k: f"{v:.4f}" for k, v in scores.items()}}
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)  # a local store resolves the models:/ source through the global URI
    try:
        version = client.create_model_version(name, source=f"models:/{model.model_id}", run_id=parent_id, tags=tags,
                                              description=description, model_id=model.model_id)
    finally:
        mlflow.set_tracking_uri(previous)
    return int(version.version)


#: The MLflow UI's query that opens a page in its "Model training" view. MLflow 3.17's UI takes the
#: workflow type from the URL's `workflowType` (genai | machine_learning), else from the browser's
#: localStorage key `mlflow.workflowType`, whose default is genai; in the open-source build the
#: experiment's kind follows it (the `mlflow.experimentKind` tag is not read). Read in mlflow 3.17.0's
#: bundle, mlflow/server/js/build/static/js/main.c2f5f8d4.js (the WorkflowType provider).
TRAINING_VIEW = "workflowType=machine_learning"


def compare_url(base: str, experiment_ids, run_ids) -> str:
    """The MLflow UI's page comparing `run_ids` side by side (their params, metrics and plots), in its
    training view. The route is the UI's own, `#/compare-runs?runs=[...]&experiments=[...]`
    (Routes.getCompareRunPageRoute, mlflow/server/js/src/experiment-tracking/routes.tsx, mlflow 3.17)."""
    from urllib.parse import quote

    def as_json(ids) -> str:
        return quote(json.dumps(list(ids), separators=(",", ":")), safe="")

    return (f"{base}/#/compare-runs?runs={as_json(run_ids)}&experiments={as_json(sorted(set(experiment_ids)))}"
            f"&{TRAINING_VIEW}")


def iteration_runs(client, parent_run_id: str) -> list:
    """The ppo runs of a pipeline run, one per RL iteration, in iteration order: the iterations to compare."""
    runs = [r for r in child_runs(client, parent_run_id) if r.data.tags.get("prmflow.stage") == "ppo"]
    return sorted(runs, key=lambda r: int(r.data.tags.get("prmflow.iteration", 0)))


def ui_hint(uri: str, experiment: str, parent_run_id: str, port: int = 5000) -> str:
    """How to open the runs of `experiment` in the MLflow UI: the command, the page to open, and the page
    comparing the RL iterations of the pipeline run `parent_run_id` (the caller's own run: the experiment's
    newest pipeline run may be another pipeline's logging to the same store).

    MLflow 3.17's UI opens every experiment in its GenAI view (traces, "Eval" runs) until the
    workflow switch at the top left is set to "Model training" (remembered by the browser); the
    links set it (TRAINING_VIEW), so the page opens on the runs table."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    base = f"http://127.0.0.1:{port}"
    page = f"{base}/#/experiments/{exp.experiment_id if exp else ''}?{TRAINING_VIEW}"
    lines = [f"see the runs with: mlflow ui --backend-store-uri {uri} --port {port}", f"then open {page}"]
    iterations = iteration_runs(client, parent_run_id)
    if len(iterations) > 1:
        lines.append(f"compare the {len(iterations)} RL iterations (their ppo runs) side by side: "
                     f"{compare_url(base, [r.info.experiment_id for r in iterations], [r.info.run_id for r in iterations])}")
    return "\n".join(lines)
