"""The whole DAG through kfp.local on this machine: one MLflow parent run, a child per stage and iteration."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from prmflow import cli

TINY_DAG = """
pipeline:
  iterations: 2
  rollout_shards: 2
sft:
  max_steps: 30
  warmup_steps: 2
  train_size: 512
  eval_size: 8
  eval_every: 0
  save_every: 0
  eval_max_new_tokens: 16
  engine: {backend: torch}
prm:
  max_steps: 10
  warmup_steps: 1
  train_size: 64
  eval_size: 16
  eval_every: 0
  save_every: 0
  engine: {backend: torch}
rollout:
  num_prompts: 8
  n_samples: 2
  max_new_tokens: 24
ppo:
  epochs: 1
  minibatch_size: 16
  micro_batch_size: 16
  engine: {backend: torch}
evaluate:
  num_prompts: 8
  n_samples: 2
  max_new_tokens: 24
"""


@pytest.mark.slow
def test_run_local_runs_the_whole_dag_with_lineage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(TINY_DAG)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = cli.main(["pipeline", "run-local", "--config", "p.yaml", "--root", str(tmp_path / "root"),
                     "--param", f"tracking_uri={store}"])
    assert code == 0
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("prmflow")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("prmflow.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = sorted(r.info.run_name for r in children)
    expected = sorted(["sft", "prm", "evaluate"] + [f"{s}-iter{k}" for k in (0, 1) for s in ("rollout", "rollout", "advantage", "ppo")])
    assert names == expected
    assert all(r.info.status == "FINISHED" for r in children)
    assert all(r.data.tags["prmflow.pipeline_run_id"] == parent.data.tags["prmflow.pipeline_run_id"] for r in children)
    assert "eval/accuracy" in parent.data.metrics  # the final evaluation is on the parent, to compare runs
    assert "sft.max_steps" in parent.data.params
