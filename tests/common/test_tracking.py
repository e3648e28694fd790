from mlflow.tracking import MlflowClient

from prmflow.components.common import tracking


def test_child_run_under_parent_in_a_real_store(sqlite_store):
    cfg = tracking.TrackingConfig(uri=sqlite_store, experiment="exp")
    parent = tracking.start_run(cfg, "pipeline")
    child_cfg = tracking.TrackingConfig(uri=sqlite_store, experiment="exp", parent_run_id=parent.run_id)
    with tracking.start_stage_run(child_cfg, "ppo", params={"lr": 0.1}, iteration=2) as child:
        child.log_metrics({"train/loss": 0.5, "train/bad": float("nan")}, step=3)
        child.log_table({"prompt": ["a"], "score": [0.5]}, "samples.json")
    parent.finish()
    client = MlflowClient(sqlite_store)
    run = client.get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.data.tags["prmflow.stage"] == "ppo" and run.data.tags["prmflow.iteration"] == "2"
    assert run.info.run_name == "ppo-iter2" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"}
    assert run.data.metrics == {"train/loss": 0.5}  # non-finite values are not logged
    assert [a.path for a in client.list_artifacts(child.run_id)] == ["samples.json"]


def test_failed_block_marks_run_failed(sqlite_store):
    cfg = tracking.TrackingConfig(uri=sqlite_store)
    try:
        with tracking.start_stage_run(cfg, "sft") as t:
            raise ValueError("boom")
    except ValueError:
        pass
    assert MlflowClient(sqlite_store).get_run(t.run_id).info.status == "FAILED"


def test_disabled_tracking_is_a_null_tracker():
    t = tracking.start_stage_run(tracking.TrackingConfig(enabled=False), "sft")
    assert isinstance(t, tracking.NullTracker) and not isinstance(t, tracking.MlflowTracker)
    t.log_metrics({"a": 1.0})
    t.finish()


def test_default_store_is_embedded_sqlite(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.resolve_uri(tracking.TrackingConfig()) == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_stages_find_the_pipeline_parent_by_kfp_run_id(sqlite_store):
    base = dict(uri=sqlite_store, experiment="exp", pipeline_run_id="kfp-123")
    parent = tracking.start_pipeline_run(tracking.TrackingConfig(**base), params={"iterations": 2})
    other = tracking.start_pipeline_run(tracking.TrackingConfig(**{**base, "pipeline_run_id": "kfp-999"}))
    with tracking.start_stage_run(tracking.TrackingConfig(**base), "rollout", iteration=0) as child:
        pass
    assert tracking.finish_pipeline_run(tracking.TrackingConfig(**base), "FAILED", {"eval/accuracy": 0.5}) == parent.run_id
    client = MlflowClient(sqlite_store)
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    p = client.get_run(parent.run_id)
    assert p.info.status == "FAILED" and p.data.metrics == {"eval/accuracy": 0.5}
    assert client.get_run(other.run_id).info.status == "RUNNING"
