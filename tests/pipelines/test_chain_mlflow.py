"""One MLflow parent run for a chain of KFP runs (pipelines/chain.py, tracking/runs.py), on a real SQLite store:
every run's init step finds the chain's parent by its chain id, a stage of any run of the chain files under
it, a run that is not the chain's last leaves it RUNNING, and a task run twice under it (a run started
again after a stop) counts once in the closing table."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from prmflow.pipelines.summary import child_runs
from prmflow.tracking import TrackingConfig, find_pipeline_run, finish_pipeline_run, start_pipeline_run, start_stage_run


def cfg(store: str, kfp_run: str) -> TrackingConfig:
    return TrackingConfig(uri=store, experiment="chain", pipeline_run_id=kfp_run, system_metrics=False, finish_wait_s=1)


def test_the_runs_of_a_chain_share_one_parent_that_their_stages_find(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    first = start_pipeline_run(cfg(store, "kfp-run-1"), chain_id="chain-a", first_iteration=0)
    assert finish_pipeline_run(cfg(store, "kfp-run-1"), None) == first.run_id  # not the chain's last: goes on
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second = start_pipeline_run(cfg(store, "kfp-run-2"), chain_id="chain-a", first_iteration=2)
    other = start_pipeline_run(cfg(store, "kfp-run-3"), chain_id="chain-b")
    assert second.run_id == first.run_id and other.run_id != first.run_id
    assert [find_pipeline_run(client, "chain", r) for r in ("kfp-run-1", "kfp-run-2", "kfp-run-3")] == [
        first.run_id, first.run_id, other.run_id]

    # a stage of the second run files under the chain's parent (found through its own KFP run id)
    stage = start_stage_run(cfg(store, "kfp-run-2"), "rollout", iteration=2, tags={"prmflow.shard": "0/1"})
    stage.log_metrics({"rollout/reward_mean": 0.5}, step=2)
    stage.finish()
    assert client.get_run(stage.run_id).data.tags["mlflow.parentRunId"] == first.run_id

    # the same task again (the run started again after a stop): the table keeps its last finished attempt
    again = start_stage_run(cfg(store, "kfp-run-2"), "rollout", iteration=2, tags={"prmflow.shard": "0/1"})
    again.finish("KILLED")
    assert [r.info.run_id for r in child_runs(client, first.run_id)] == [stage.run_id]
    finish_pipeline_run(cfg(store, "kfp-run-2"), "FINISHED")
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_a_run_finished_again_logs_no_iteration_point_twice(tmp_path):
    """The exit handler of a run started again (all its tasks cache hits) finds its points on the parent already:
    the parent's curve keeps one point per iteration."""
    from types import SimpleNamespace

    from prmflow.pipelines.lineage import finish_tracking

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    parent = start_pipeline_run(cfg(store, "kfp-run-1"), chain_id="chain-a")
    for k in (0, 1):
        stage = start_stage_run(cfg(store, "kfp-run-1"), "rollout", iteration=k, tags={"prmflow.shard": "0/1"})
        stage.log_metrics({"rollout/reward_mean": 0.25 * k, "rollout/samples": 8}, step=k)
        stage.finish()
    ok = SimpleNamespace(state="SUCCEEDED")
    for kfp_run in ("kfp-run-1", "kfp-run-2"):  # the same run of the chain, then started again
        start_pipeline_run(cfg(store, kfp_run), chain_id="chain-a")
        finish_tracking(kfp_run, store, "chain", ok, chain_id="chain-a", first_iteration=0, iterations=2, last=False)
    points = sorted((m.step, m.value) for m in client.get_metric_history(parent.run_id, "pipeline/reward_mean"))
    assert points == [(0, 0.0), (1, 0.25)]
    assert client.get_run(parent.run_id).info.status == "RUNNING"
