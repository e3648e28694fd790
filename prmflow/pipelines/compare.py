"""`prmflow pipeline compare`: one pipeline run per RL variant, on one shared warm-up, then a table.

    prmflow pipeline compare --config configs/compare.yaml

The config is a pipeline config plus a `variants:` mapping, each variant a partial config (stage
sections and/or a pipeline section) laid over the base:

    variants:
      outcome-only: {advantage: {estimator: grpo}}
      prm+outcome:  {advantage: {estimator: reinforce_baseline, step_rewards: true}}
      grpo_process: {advantage: {estimator: grpo_process}}

The first variant runs the whole DAG; the others import its SFT policy and PRM (pipeline.sft_model
and pipeline.prm_model) so every variant starts from the same weights and spends the same rollout
budget. Each variant is its own MLflow parent run named after it, so the MLflow UI compares them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from ..components import config as config_lib
from ..errors import ConfigError

#: Columns of the comparison table.
COLUMNS = ["pass@1", "SFT pass@1", "majority", "PRM best-of-k", "pass@k", "last train reward"]


def load_variants(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(base config data, {variant name: merged config data}) from a comparison YAML."""
    p = Path(path)
    data = config_lib.read_yaml(p, "Comparison config")
    variants = data.pop("variants", None)
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(f"{p}: 'variants' must map at least one variant name to its settings, e.g. "
                          f"variants: {{outcome-only: {{advantage: {{estimator: grpo}}}}}}.")
    merged = {}
    for name, over in variants.items():
        if not isinstance(over, dict):
            raise ConfigError(f"{p}: variant '{name}' must be a mapping of config sections, not {over!r}.")
        merged[str(name)] = _deep_merge(copy.deepcopy(data), over)
    return data, merged


def _deep_merge(base: dict, over: dict) -> dict:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def shared_inputs(client, parent_run_id: str) -> dict[str, str]:
    """The SFT policy and PRM directories a finished pipeline run produced (from its child runs' params)."""
    from .summary import child_runs

    found = {}
    for run in child_runs(client, parent_run_id):
        stage = run.data.tags.get("prmflow.stage")
        if stage in ("sft", "prm") and run.data.params.get("output"):
            found[f"{stage}_model"] = run.data.params["output"]
    return found


def comparison_rows(client, runs: dict[str, str]) -> list[tuple[str, list[float]]]:
    """[(variant, values in COLUMNS order)] from each variant's parent run."""
    from .summary import pipeline_rows

    rows = []
    for name, run_id in runs.items():
        metrics = client.get_run(run_id).data.metrics
        # the evaluate stage's metrics on the parent: final/* (eval/* in runs logged before that name)
        final = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("eval/")}
        final.update({k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("final/")})
        pass_k = next((v for k, v in final.items() if k.startswith("pass_at_")), math.nan)
        iters = [r for r in pipeline_rows(client, run_id) if r.stage.startswith("iter ")]
        last_reward = iters[-1].values.get("reward", math.nan) if iters else math.nan
        rows.append((name, [final.get("accuracy", math.nan), final.get("baseline_accuracy", math.nan),
                            final.get("majority", math.nan), final.get("bon_min", math.nan), pass_k, last_reward]))
    return rows


def format_rows(rows: list[tuple[str, list[float]]]) -> str:
    width = max([len("variant")] + [len(n) for n, _ in rows])
    lines = ["variant".ljust(width) + "".join(f"  {h:>17}" for h in COLUMNS)]
    for name, values in rows:
        lines.append(name.ljust(width) + "".join(f"  {'-' if math.isnan(v) else f'{v:.3f}':>17}" for v in values))
    return "\n".join(lines)


def compare_hint(uri: str, runs: dict[str, str], port: int = 5000) -> str:
    """How to see the variants' pipeline runs side by side in the MLflow UI: the command and the compare page."""
    from mlflow.tracking import MlflowClient

    from .summary import compare_url

    client = MlflowClient(uri)
    experiments = [client.get_run(run_id).info.experiment_id for run_id in runs.values()]
    return (f"compare the runs with: mlflow ui --backend-store-uri {uri} --port {port}\n"
            f"then open {compare_url(f'http://127.0.0.1:{port}', experiments, list(runs.values()))}")
