"""The pipeline's exit handler in a real MLflow store: parent summary metrics and the Model Registry.

The stage runs are made through prmflow's own tracking calls (as the stages make them) on outputs
with real manifests, then `lineage.finish_tracking` runs as KFP's exit handler would.
"""

from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from prmflow.components.data import io
from prmflow import tracking
from prmflow.pipelines import lineage

#: Two shards per iteration: (samples, reward_mean); the iteration's reward is the sample-weighted mean.
SHARDS = {0: [(4, 0.5), (12, 0.25)], 1: [(8, 0.75), (8, 0.25)]}


def _output(path, kind: str, models: list[str]):
    with io.atomic_output_dir(path, kind) as tmp:
        for sub in models:
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            (tmp / sub / "config.json").write_text("{}")
    return str(path)


@pytest.fixture
def finished_pipeline(tmp_path, sqlite_store):
    base = dict(uri=sqlite_store, experiment="reg", pipeline_run_id="kfp-1", system_metrics=False)
    parent = tracking.start_pipeline_run(tracking.TrackingConfig(**base))
    cfg = tracking.TrackingConfig(**base)
    with tracking.start_stage_run(cfg, "sft", params={"output": _output(tmp_path / "sft", "policy", [""])}) as t:
        t.log_metrics({"eval/accuracy": 0.3}, step=12)
    with tracking.start_stage_run(cfg, "prm", params={"output": _output(tmp_path / "prm", "prm", [""])}) as t:
        t.log_metrics({"eval/step_auc": 0.8}, step=4)
    for k, shards in SHARDS.items():
        for i, (samples, reward) in enumerate(shards):
            with tracking.start_stage_run(cfg, "rollout", iteration=k, tags={"prmflow.shard": f"{i}/2"}) as t:
                t.log_metrics({"rollout/samples": samples, "rollout/reward_mean": reward, "rollout/accuracy": reward,
                               "rollout/kl_k1": 0.01 * k}, step=k)
        out = _output(tmp_path / f"ppo{k}", "ppo", ["policy"])
        with tracking.start_stage_run(cfg, "ppo", params={"output": out}, iteration=k) as t:
            t.log_parent_metrics({"train/policy_loss": -0.1 * k}, step=k)
    with tracking.start_stage_run(cfg, "evaluate") as t:
        t.log_parent_metrics({"eval/accuracy": 0.6, "eval/baseline_accuracy": 0.3})
    return sqlite_store, parent.run_id


def test_exit_handler_charts_reward_per_iteration_and_registers_the_models(finished_pipeline):
    store, parent_id = finished_pipeline
    for _ in range(2):  # an exit handler retried by KFP registers nothing twice
        lineage.finish_tracking("kfp-1", store, "reg", SimpleNamespace(state="SUCCEEDED"))
    client = MlflowClient(store)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    reward = [(m.step, m.value) for m in client.get_metric_history(parent_id, "pipeline/reward_mean")]
    expected = {k: sum(n * r for n, r in s) / sum(n for n, _ in s) for k, s in SHARDS.items()}  # (2+3)/16, 8/16
    assert sorted(set(reward)) == [(0, pytest.approx(expected[0])), (1, pytest.approx(expected[1]))]
    assert parent.data.metrics["sft/eval_accuracy"] == 0.3 and parent.data.metrics["prm/eval_step_auc"] == 0.8
    assert parent.data.metrics["final/accuracy"] == 0.6 and "eval/accuracy" not in parent.data.metrics

    exp = client.get_experiment_by_name("reg").experiment_id
    models = {m.name: m for m in client.search_logged_models([exp]).to_list()}
    [policy] = client.search_model_versions("name = 'reg-policy'")
    [prm] = client.search_model_versions("name = 'reg-prm'")
    assert policy.source == f"models:/{models['policy-iter1'].model_id}"  # the last iteration's policy
    assert prm.source == f"models:/{models['prm'].model_id}"
    assert policy.run_id == prm.run_id == parent_id  # the UI's Source run: the pipeline's parent run
    assert policy.tags["final/accuracy"] == "0.6000" and prm.tags["prm/eval_step_auc"] == "0.8000"
    assert policy.tags["prmflow.uri"] == models["policy-iter1"].tags["prmflow.uri"]
    assert parent.info.run_name in policy.description
    final = {m.key: m.value for m in client.get_logged_model(models["policy-iter1"].model_id).metrics}
    assert final["final/accuracy"] == 0.6  # the evaluation on the policy's model page


def test_with_prm_updates_the_registered_prm_is_the_last_update(finished_pipeline, tmp_path):
    # pipeline.prm_update: prm-update-k writes PRM_k+1; the PRM the run ends with (the one the final
    # evaluation read) is the last update's, not the prm stage's
    store, parent_id = finished_pipeline
    cfg = tracking.TrackingConfig(uri=store, experiment="reg", pipeline_run_id="kfp-1", system_metrics=False)
    for k in (0, 1):
        out = _output(tmp_path / f"prm-upd{k}", "prm", [""])
        with tracking.start_stage_run(cfg, "prm-update", params={"output": out}, iteration=k) as t:
            t.log_metrics({"eval/step_auc": 0.7 + 0.01 * k}, step=k)
    lineage.finish_tracking("kfp-1", store, "reg", SimpleNamespace(state="SUCCEEDED"))
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("reg").experiment_id
    models = {m.name: m for m in client.search_logged_models([exp]).to_list()}
    [prm] = client.search_model_versions("name = 'reg-prm'")
    assert prm.source == f"models:/{models['prm-iter1'].model_id}"
    assert prm.tags["prmflow.uri"] == models["prm-iter1"].tags["prmflow.uri"]
    assert {k: v for k, v in prm.tags.items() if "eval" in k} == {"prm-update/eval_step_auc": "0.7100"}


def test_a_failed_pipeline_registers_nothing(finished_pipeline):
    store, parent_id = finished_pipeline
    lineage.finish_tracking("kfp-1", store, "reg", SimpleNamespace(state="FAILED"))
    client = MlflowClient(store)
    assert client.get_run(parent_id).info.status == "FAILED"
    assert client.search_registered_models() == []
