"""The table a pipeline run ends with, read back from MLflow (what the UI shows, in a terminal).

    stage        held-out pass@1   train reward   train accuracy   KL to SFT
    sft                    0.310              -                -           -
    iter 0                     -          0.402            0.402       0.000
    iter 1                     -          0.455            0.455       0.004
    final                  0.420              -                -           -

"held-out pass@1" is greedy accuracy on held-out prompts (sft: the SFT stage's own eval set; final:
the evaluate stage, which also scores the SFT policy on the same prompts as `sft (same prompts)`).
"train reward/accuracy" are the rollout stage's means over the prompts sampled at that iteration,
before its PPO update; "KL to SFT" is the rollout stage's k1 estimate of KL(policy_k || SFT policy).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field


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
    for run in by_stage.get("sft", [])[:1]:
        rows.append(Row("sft", {"pass1": run.data.metrics.get("eval/accuracy", math.nan)}))
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
    """The stage runs filed under a pipeline's parent run."""
    parent = client.get_run(parent_run_id)
    return client.search_runs([parent.info.experiment_id], max_results=5000,
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def format_table(rows: list[Row]) -> str:
    width = max([len("stage")] + [len(r.stage) for r in rows])
    head = "stage".ljust(width) + "".join(f"  {name:>15}" for name, _ in COLUMNS)
    lines = [head]
    for r in rows:
        cells = []
        for _, key in COLUMNS:
            v = r.values.get(key)
            cells.append(f"  {'-' if v is None or math.isnan(v) else f'{v:.3f}':>15}")
        lines.append(r.stage.ljust(width) + "".join(cells))
    return "\n".join(lines)


def latest_pipeline_run(client, experiment: str) -> str | None:
    """Id of the newest pipeline (parent) run in `experiment`."""
    from ..components.common.tracking import ROLE_TAG

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                              filter_string=f"tags.`{ROLE_TAG}` = 'pipeline'")
    return runs[0].info.run_id if runs else None
