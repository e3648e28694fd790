import json
import time

from mlflow.tracking import MlflowClient

from prmflow import tracking


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


def _fake_output(path, kind: str, models: list[str]):
    """A finished stage output as io writes it (real manifest), holding HF-like model directories."""
    from prmflow.components.data import io

    with io.atomic_output_dir(path, kind, manifest={"metrics": {"train/loss": 0.25}}) as tmp:
        for sub in models:
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            (tmp / sub / "config.json").write_text('{"model_type": "llama"}')
    return path


def test_stage_run_as_the_mlflow_ui_shows_it(sqlite_store, tmp_path):
    """Unique shard names, source/user/description, model-training experiment, namespaced metrics."""
    base = dict(uri=sqlite_store, experiment="exp")
    parent = tracking.start_run(tracking.TrackingConfig(**base), "pipeline")
    cfg = tracking.TrackingConfig(**base, parent_run_id=parent.run_id, system_metrics_interval_s=0.2)
    runs = {}
    for shard in (0, 1):
        with tracking.start_stage_run(cfg, "rollout", iteration=1, tags={"prmflow.shard": f"{shard}/2"}) as t:
            runs[shard] = t.run_id
    with tracking.start_stage_run(cfg, "sft") as sft:
        sft.log_metrics({"eval/accuracy": 0.4, "train/loss": 1.0}, step=12)
        client = MlflowClient(sqlite_store)
        for _ in range(100):  # the sampler publishes its first sample after one interval
            if any(k.startswith("system/") for k in client.get_run(sft.run_id).data.metrics):
                break
            time.sleep(0.1)
    with tracking.start_stage_run(cfg, "evaluate") as ev:
        ev.log_metrics({"eval/accuracy": 0.7})
        ev.log_parent_metrics({"eval/accuracy": 0.7})
    with tracking.start_stage_run(cfg, "ppo", iteration=1) as ppo:
        ppo.log_parent_metrics({"train/policy_loss": -0.1}, step=1)
    parent.finish()
    names = [client.get_run(runs[s]).info.run_name for s in (0, 1)]
    assert names == ["rollout-iter1 shard 0/2", "rollout-iter1 shard 1/2"]
    run = client.get_run(sft.run_id)
    assert run.data.tags["mlflow.source.name"] == "prmflow sft" and run.data.tags["mlflow.user"]
    assert "Supervised fine-tuning" in run.data.tags["mlflow.note.content"]
    assert client.get_experiment_by_name("exp").tags["mlflow.experimentKind"] == "custom_model_development"
    # eval/ is the evaluate stage's; a training stage's held-out eval is filed under the stage
    assert {"sft/eval_accuracy", "train/loss"} <= set(run.data.metrics) and "eval/accuracy" not in run.data.metrics
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert client.get_run(ev.run_id).data.metrics["eval/accuracy"] == 0.7
    assert client.get_run(parent.run_id).data.metrics == {"final/accuracy": 0.7, "pipeline/policy_loss": -0.1}


def test_models_a_stage_writes_are_logged_models_of_its_run(sqlite_store, tmp_path):
    cfg = tracking.TrackingConfig(uri=sqlite_store, experiment="exp", system_metrics=False)
    out = _fake_output(tmp_path / "ppo-out", "ppo", ["policy", "critic"])
    with tracking.start_stage_run(cfg, "ppo", params={"output": str(out)}, iteration=1) as t:
        t.log_metrics({"train/policy_loss": 0.5}, step=7)
        t.log_metrics({"train/policy_loss": 0.3}, step=8)
    client = MlflowClient(sqlite_store)
    run = client.get_run(t.run_id)
    models = {m.name: m for m in client.search_logged_models([run.info.experiment_id]).to_list()}
    assert set(models) == {"policy-iter1", "critic-iter1"}
    policy = models["policy-iter1"]
    assert policy.source_run_id == t.run_id and str(policy.status) == "READY"
    assert policy.tags["prmflow.uri"] == str((out / "policy").resolve()) and policy.tags["prmflow.role"] == "policy"
    assert [(m.key, m.value, m.step) for m in policy.metrics] == [("train/policy_loss", 0.3, 8)]  # the final value
    assert {o.model_id for o in run.outputs.model_outputs} == {m.model_id for m in models.values()}
    assert client.list_logged_model_artifacts(policy.model_id) == []  # weights stay where the pipeline wrote them
    # the run's own curve is unchanged: one point per step
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "train/policy_loss")] == [(7, 0.5), (8, 0.3)]


def test_model_weights_copied_only_when_asked(sqlite_store, tmp_path):
    cfg = tracking.TrackingConfig(uri=sqlite_store, experiment="exp", system_metrics=False, log_model_weights=True)
    out = _fake_output(tmp_path / "sft-out", "policy", [""])
    with tracking.start_stage_run(cfg, "sft", params={"output": str(out)}) as t:
        pass
    client = MlflowClient(sqlite_store)
    [model] = client.search_logged_models([client.get_run(t.run_id).info.experiment_id]).to_list()
    assert model.name == "policy" and model.params["weights_in_mlflow"] == "true"
    assert {a.path for a in client.list_logged_model_artifacts(model.model_id)} >= {"config.json", "manifest.json"}


def test_logged_model_survives_an_outage_once(sqlite_store, tmp_path):
    """Server down for the whole run: the model record waits in the fallback file; two syncs, one model."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    out = _fake_output(tmp_path / "prm-out", "prm", [""])
    cfg = tracking.TrackingConfig(uri=dead, experiment="exp", finish_wait_s=0, system_metrics=False,
                                  fallback_path=str(tmp_path / "fallback.jsonl"))
    with tracking.start_stage_run(cfg, "prm", params={"output": str(out)}) as t:
        t.log_metrics({"eval/step_auc": 0.8}, step=4)
    assert t.run_id == ""  # never reached the server
    fallback = tmp_path / "fallback.jsonl"
    tracking.sync_fallback(fallback, uri=sqlite_store, create_store=True)  # a new store, asked for
    # a sync killed after delivering the model but before its `done` line: the next sync sends it again
    ids = {json.loads(line)["id"] for line in fallback.read_text().splitlines() if '"log_model"' in line}
    fallback.write_text("".join(line + "\n" for line in fallback.read_text().splitlines()
                                if not (json.loads(line)["op"] == "done" and json.loads(line)["id"] in ids)))
    assert tracking.sync_fallback(fallback, uri=sqlite_store)["delivered"] == 1
    client = MlflowClient(sqlite_store)
    exp = client.get_experiment_by_name("exp").experiment_id
    [model] = client.search_logged_models([exp]).to_list()
    assert model.name == "prm" and [(m.key, m.value) for m in model.metrics] == [("prm/eval_step_auc", 0.8)]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stage_ends_quietly_beside_an_empty_fallback_file(sqlite_store, tmp_path, caplog):
    """A run killed before it wrote its first undelivered call leaves an empty fallback file: the next run of the
    stage, with the server up, has nothing to upload from it and says nothing about it."""
    fallback = tmp_path / "fallback.jsonl"
    fallback.touch()
    cfg = tracking.TrackingConfig(uri=sqlite_store, experiment="exp", system_metrics=False, fallback_path=str(fallback))
    with caplog.at_level("WARNING"):
        with tracking.start_stage_run(cfg, "sft") as t:
            t.log_metrics({"train/loss": 0.5}, step=1)
    assert MlflowClient(sqlite_store).get_run(t.run_id).info.status == "FINISHED"
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
