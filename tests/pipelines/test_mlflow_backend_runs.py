"""KFP 2.17 with its MLflow integration makes runs itself: one for the pipeline run and, under it, one per task,
in its own experiment (KFP-Default). What a task learns of them depends on the server's settings
(prmflow/tracking/kfp_plugin.py, each rule beside its kubeflow/pipelines@2.17.0 line): always the runtime
config (KFP_MLFLOW_CONFIG: server, experiment, KFP's run of the pipeline); its own run and KFP's auth only
with plugins.mlflow.settings.injectUserEnvVars. Whatever the settings, prmflow's runs land in one tree:
KFP's run of the pipeline is the root, every stage run (a TrainJob's too) is its child, nothing is left
at the top level or in prmflow's own experiment. Logging to another server, prmflow keeps its own tree
there and does not send KFP's service-account auth to it."""

from __future__ import annotations

import pytest

from prmflow import tracking
from prmflow.pipelines import trainjob
from prmflow.pipelines.lineage import init_tracking
from prmflow.pipelines.settings import MLFLOW_SECRET_KEYS
from prmflow.tracking import kfp_plugin

from .fake_kfp_mlflow import FakeKfpMlflow

MLFLOW_SECRET = "mlflow-creds"


def secret_env() -> list[dict]:
    """pipeline.cluster.mlflow_secret as every step gets it (kubernetes.use_secret_as_env, optional keys)."""
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": MLFLOW_SECRET, "key": k, "optional": True}}}
            for k in MLFLOW_SECRET_KEYS]


def in_pod(monkeypatch, env: dict[str, str]) -> None:
    """This process's environment as a container with `env` has it (MLflow's and KFP's variables only)."""
    import os

    for name in list(os.environ):
        if name.startswith(("MLFLOW_", "KFP_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def run_pipeline(monkeypatch, kfp: FakeKfpMlflow, tracking_uri: str = "") -> dict:
    """init-tracking, a rollout pod step, a ppo step that runs its stage as a TrainJob, and the exit handler,
    each in the env its container gets; returns what each produced."""
    kfp.start_run("prmflow-run-7", "run-7")
    in_pod(monkeypatch, kfp.task_env("init-tracking", secret_env=secret_env()))
    parent = init_tracking("run-7", tracking_uri, "prmflow", {}, {}, {}, {}, {}, {})
    in_pod(monkeypatch, kfp.task_env("rollout-0", secret_env=secret_env()))
    uri = tracking_uri or __import__("os").environ["MLFLOW_TRACKING_URI"]  # as kfp_shim.run_stage takes it
    cfg = tracking.TrackingConfig(uri=uri, experiment="prmflow", pipeline_run_id="run-7", system_metrics=False)
    rollout = tracking.start_stage_run(cfg, "rollout", params={"n_samples": 8}, iteration=0)
    rollout.log_metrics({"rollout/reward_mean": 0.5}, step=0)
    rollout.finish()
    auth_in_rollout = kfp_plugin.AUTH_ENV in __import__("os").environ
    # the ppo step: it submits a TrainJob whose node pods run the stage (trainjob.run builds their env)
    step_env = kfp.task_env("ppo-0 (trainjob)", secret_env=secret_env())
    in_pod(monkeypatch, step_env)
    uri = tracking_uri or step_env["MLFLOW_TRACKING_URI"]
    spec = trainjob.TrainJobSpec(image="gpu", num_nodes=2, secret_env={MLFLOW_SECRET: list(MLFLOW_SECRET_KEYS)})
    pod_env_list = trainjob.trainer_env(spec, kfp_plugin.forward_env(uri))
    in_pod(monkeypatch, kfp.resolve(pod_env_list))  # a TrainJob pod is no KFP task: only what the step gave it
    ppo = tracking.start_stage_run(tracking.TrackingConfig(uri=uri, experiment="prmflow", pipeline_run_id="run-7",
                                                           system_metrics=False), "ppo", iteration=0)
    ppo.log_metrics({"train/loss": 0.25}, step=0)
    ppo.finish()
    in_pod(monkeypatch, kfp.task_env("finish-tracking", secret_env=secret_env()))
    finished = tracking.finish_pipeline_run(tracking.TrackingConfig(uri=uri, experiment="prmflow",
                                                                    pipeline_run_id="run-7"), "FINISHED")
    return {"parent": parent, "rollout": rollout.run_id, "ppo": ppo.run_id, "finished": finished,
            "pod_env": pod_env_list, "auth_in_rollout": auth_in_rollout}


def tree(uri: str) -> tuple[list, dict]:
    """(the top-level runs, {run id: run}) of every experiment of the store at `uri`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = {r.info.run_id: r for exp in client.search_experiments() for r in client.search_runs([exp.experiment_id])}
    return [r for r in runs.values() if "mlflow.parentRunId" not in r.data.tags], runs


@pytest.mark.parametrize("auth", [kfp_plugin.AUTH_KUBERNETES, kfp_plugin.AUTH_BASIC])
@pytest.mark.parametrize("inject", [True, False], ids=["injectUserEnvVars", "no-injectUserEnvVars"])
def test_with_kfps_mlflow_integration_every_run_lands_in_kfps_tree(tmp_path, monkeypatch, inject, auth):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kfp = FakeKfpMlflow(uri, inject=inject, auth=auth,
                        secrets={MLFLOW_SECRET: {"MLFLOW_TRACKING_URI": uri, "MLFLOW_TRACKING_USERNAME": "ours",
                                                 "MLFLOW_TRACKING_PASSWORD": "ours-pass"}})
    got = run_pipeline(monkeypatch, kfp)
    roots, runs = tree(uri)
    root = kfp.cfg.parent_run_id
    assert [r.info.run_id for r in roots] == [root]  # one tree: KFP's run of the pipeline
    assert got["parent"] == got["finished"] == root and runs[root].info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for rid, r in runs.items() if rid != root} == {root}  # no orphan
    assert {r.info.experiment_id for r in runs.values()} == {kfp.cfg.experiment_id}  # none in 'prmflow'
    stages = {r.data.tags["prmflow.stage"]: rid for rid, r in runs.items() if "prmflow.stage" in r.data.tags}
    assert stages == {"rollout": got["rollout"], "ppo": got["ppo"]}
    assert runs[got["rollout"]].data.metrics["rollout/reward_mean"] == 0.5
    assert runs[got["ppo"]].data.metrics["train/loss"] == 0.25
    names = [e["name"] for e in got["pod_env"]]
    assert len(names) == len(set(names))  # the TrainJob's env: each name once (Trainer's CRD refuses a repeat)
    if inject:  # the stages log into KFP's task runs (the TrainJob's into its step's): nothing beside them
        assert got["rollout"] == kfp.task_runs["rollout-0"] and got["ppo"] == kfp.task_runs["ppo-0 (trainjob)"]
        assert len(runs) == 1 + len(kfp.task_runs)
        assert got["auth_in_rollout"] == (auth == kfp_plugin.AUTH_KUBERNETES)
        pod = {e["name"]: e for e in got["pod_env"]}
        if auth == kfp_plugin.AUTH_KUBERNETES:  # the pods authenticate to KFP's server as the step does
            assert pod[kfp_plugin.AUTH_ENV]["value"] == "kubernetes-namespaced"
        else:  # KFP's credentials, by reference, in place of the pipeline secret's keys of the same name
            assert pod["MLFLOW_TRACKING_USERNAME"]["valueFrom"]["secretKeyRef"]["name"] == kfp_plugin.CREDENTIAL_SECRET
    else:  # prmflow's runs under KFP's; KFP's own task runs stay empty beside them
        assert set(kfp.task_runs.values()).isdisjoint({got["rollout"], got["ppo"]})
        assert all(not runs[r].data.metrics for r in kfp.task_runs.values())


def test_logging_to_another_server_keeps_one_tree_there_and_does_not_send_kfps_auth(tmp_path, monkeypatch):
    """pipeline.tracking_uri names a server that is not KFP's: prmflow's tree there (the TrainJob's run under
    the parent too), and MLflow's client no longer has KFP's MLFLOW_TRACKING_AUTH, which would send the
    pod's service-account token instead of the pipeline's credentials (mlflow utils/rest_utils.py:258)."""
    from mlflow.utils.credentials import get_default_host_creds

    kfp_uri, ours = f"sqlite:///{tmp_path / 'kfp.db'}", f"sqlite:///{tmp_path / 'ours.db'}"
    kfp = FakeKfpMlflow(kfp_uri, inject=True, secrets={MLFLOW_SECRET: {"MLFLOW_TRACKING_USERNAME": "ours"}})
    got = run_pipeline(monkeypatch, kfp, tracking_uri=ours)
    roots, runs = tree(ours)
    assert [r.info.run_id for r in roots] == [got["parent"]] == [got["finished"]]
    assert {r.data.tags.get("prmflow.stage") for r in runs.values()} == {None, "rollout", "ppo"}
    assert {r.data.tags["mlflow.parentRunId"] for rid, r in runs.items() if rid != got["parent"]} == {got["parent"]}
    assert not got["auth_in_rollout"]
    assert get_default_host_creds(ours).auth is None and get_default_host_creds(ours).username == "ours"
    assert [e["name"] for e in got["pod_env"]] == list(MLFLOW_SECRET_KEYS)  # no KFP env on the TrainJob's pods
    kfp_roots, kfp_runs = tree(kfp_uri)  # KFP's runs stay on KFP's server, empty
    assert all(not r.data.metrics and "prmflow.stage" not in r.data.tags for r in kfp_runs.values())


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
