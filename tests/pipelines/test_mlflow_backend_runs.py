"""KFP >= 2.17 with its MLflow integration makes runs itself: one for the pipeline run and, under it, one per
task, whose id it injects as MLFLOW_RUN_ID with MLFLOW_TRACKING_URI (kubeflow/pipelines@2.17.0
backend/src/v2/common/plugins/mlflow/handler.go:141-144; the nesting is the mlflow.parentRunId tag,
backend/src/common/plugins/mlflow/client.go:67). prmflow then logs into those runs: one tree per pipeline
run, not two. Without them, prmflow makes its own parent and children as before."""

from __future__ import annotations

import pytest

from prmflow import tracking


def backend_runs(client, experiment: str) -> tuple[str, str]:
    """What the KFP backend makes before a task starts: its pipeline run and the task's nested run."""
    exp = client.create_experiment(experiment)
    parent = client.create_run(exp, run_name="prmflow-run-7").info.run_id
    task = client.create_run(exp, run_name="rollout", tags={"mlflow.parentRunId": parent}).info.run_id
    return parent, task


@pytest.mark.parametrize("injected", [True, pytest.param(False, marks=pytest.mark.slow)],  # False: as every run-local test
                         ids=["kfp-2.17-mlflow", "no-backend-runs"])
def test_stages_log_into_the_runs_the_kfp_backend_made(tmp_path, monkeypatch, injected):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    cfg = tracking.TrackingConfig(uri=uri, experiment="kfp", pipeline_run_id="run-7")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    if injected:
        kfp_parent, kfp_task = backend_runs(client, "kfp")
        monkeypatch.setenv("MLFLOW_RUN_ID", kfp_task)  # as the driver sets them in the task's container
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parent = tracking.start_pipeline_run(cfg, params={"ppo.optim.lr": 1e-6})  # init_tracking
    stage = tracking.start_stage_run(cfg, "rollout", params={"n_samples": 8}, iteration=0)
    stage.log_metrics({"rollout/reward_mean": 0.5}, step=0)
    stage.finish()
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("kfp").experiment_id])}
    if injected:
        assert set(runs) == {kfp_parent, kfp_task}  # one tree: KFP's, with prmflow's params, tags and metrics in it
        assert parent.run_id == kfp_parent and stage.run_id == kfp_task
        assert runs[kfp_parent].data.params["ppo.optim.lr"] == "1e-06"
        assert runs[kfp_task].data.metrics["rollout/reward_mean"] == 0.5
        assert runs[kfp_task].data.tags["prmflow.stage"] == "rollout"
        assert runs[kfp_task].info.run_name == "rollout-iter0"
        assert tracking.find_pipeline_run(client, "kfp", "run-7") == kfp_parent  # the exit handler finds it
    else:
        assert len(runs) == 2 and runs[stage.run_id].data.tags["mlflow.parentRunId"] == parent.run_id
        assert runs[stage.run_id].data.metrics["rollout/reward_mean"] == 0.5


def test_the_parent_run_leaves_out_the_keys_of_ppo_parts_that_are_off_as_the_ppo_run_does(tmp_path):
    """The pipeline's parent run logs every stage's resolved config, but not the keys of ppo's parts that
    are off (the ptx loss and its arithmetic task, the critic): nothing reads them, and whoever compares
    two pipeline runs in MLflow would see a prompt prefix no prompt of the run was built with."""
    from mlflow.tracking import MlflowClient

    from prmflow.components.ppo import stage as ppo_stage
    from prmflow.components import config as config_lib
    from prmflow.pipelines.lineage import init_tracking

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {}
    for name, ppo in (("off", {}), ("on", {"ptx_coef": 0.1, "train_critic": True})):
        run_id = init_tracking(f"kfp-{name}", store, "parent-params", {}, {}, {}, {}, ppo, {})
        params[name] = MlflowClient(store).get_run(run_id).data.params
    assert not [k for k in params["off"] if k.startswith(("ppo.arithmetic.", "ppo.ptx_task", "ppo.critic_lr"))]
    assert {"ppo.arithmetic.prompt_prefix", "ppo.ptx_task", "ppo.critic_lr"} <= set(params["on"])
    # the same keys as the ppo stage's own run logs, and every other section as it was
    ppo_off = ppo_stage.used_params(config_lib.build(ppo_stage.Config, {}))
    assert {k for k in params["off"] if k.startswith("ppo.")} == {f"ppo.{k}" for k in ppo_off if not k.startswith("tracking.")}
    assert "sft.max_steps" in params["off"] and "rollout.sampling.max_new_tokens" in params["off"]
