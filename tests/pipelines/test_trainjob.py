"""Multi-node training through Kubeflow Trainer: the compiled step, the TrainJob it submits (to a fake
Kubernetes API server on loopback, through the real `kubeflow` SDK and `kubernetes` client), waiting,
failing with the job's reason, and handing the output on as the step's artifact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from kfp import dsl

from prmflow import cli
from prmflow.components import config as config_lib
from prmflow.components.data import io
from prmflow.pipelines import kfp_shim, trainjob
from prmflow.errors import ConfigError
from prmflow.pipelines import kfp_components as ppo_component
from prmflow.components.ppo import stage as ppo_stage
from prmflow.pipelines.settings import load_spec, safe_loader

from .fake_k8s import FakeK8s
from .test_compile_submit import IMAGES, all_tasks

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = """
pipeline:
  iterations: 2
  rollout_shards: 1
  images: {{cpu: registry.example.com/ml/prmflow-cpu:1.0, gpu: registry.example.com/ml/prmflow-gpu:1.0,
           pull_secrets: [regcred]}}
  cluster:
    mlflow_secret: mlflow-creds
    object_store_secret: s3-creds
    workspace_pvc: prmflow-rwx
    workspace_path: {workspace}
    gpu_pool:
      node_selector: {{cloud.google.com/gke-nodepool: h100-pool}}
      tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
      accelerator_type: nvidia.com/gpu
      accelerator_count: 8
      cpu: "96"
      memory: 1500G
    cpu_pool:
      node_selector: {{cloud.google.com/gke-nodepool: cpu-pool}}
    service_account: prmflow-runner
    trainer: {{ppo: trainjob, num_nodes: 2, poll_s: 1}}
"""


def compile_yaml(tmp_path, text, *args):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(text)
    out = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out), *args]) == 0
    docs = list(yaml.load_all(out.read_text(), Loader=safe_loader()))
    return docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def trainjob_env(spec, executor):
    env = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][executor]["container"].get("env", [])}
    return env.get(trainjob.ENV)


def test_compiled_pipeline_has_the_submit_and_wait_step_for_ppo(tmp_path):
    spec, platform = compile_yaml(tmp_path, CLUSTER_YAML.format(workspace="/workspace"))
    by_name = {t["taskInfo"]["name"]: t for t in all_tasks(spec).values()}
    assert {"ppo-0 (trainjob)", "ppo-1 (trainjob)"} <= set(by_name) and "ppo-0" not in by_name
    assert "sft" in by_name and "prm" in by_name  # not set to trainjob: their own GPU pods, as before
    ex = by_name["ppo-0 (trainjob)"]["componentRef"]["name"].replace("comp-", "exec-")
    container = spec["deploymentSpec"]["executors"][ex]["container"]
    submitted = json.loads(trainjob_env(spec, ex))
    assert submitted["num_nodes"] == 2 and submitted["resources_per_node"]["nvidia.com/gpu"] == 8
    assert submitted["image"] == "registry.example.com/ml/prmflow-gpu:1.0"  # the nodes run the GPU image
    assert "prmflow-cpu" in container["image"] and "accelerator" not in container.get("resources", {})
    assert platform[ex]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}
    assert platform[ex]["pvcMount"][0]["constant"] == "prmflow-rwx"  # stages the inputs on the shared volume
    assert by_name["ppo-0 (trainjob)"]["retryPolicy"]["maxRetryCount"] == 2  # a retry re-attaches to the job
    sft_ex = by_name["sft"]["componentRef"]["name"].replace("comp-", "exec-")
    assert trainjob_env(spec, sft_ex) is None
    assert spec["deploymentSpec"]["executors"][sft_ex]["container"]["resources"]["accelerator"]["resourceCount"] == "8"


def driver_cache_keys(spec: dict, platform: dict) -> dict[str, dict]:
    """{task name: its cache key as KFP's driver builds it} (contracts/kfp.py cache_key, cache.go:83-111)."""
    from prmflow.pipelines.contracts import kfp as kfp_rules

    keys = {}
    for task in kfp_rules.executor_tasks(spec):
        label = spec["components"][task.component]["executorLabel"]
        container = spec["deploymentSpec"]["executors"][label]["container"]
        pvcs = [m["constant"] for m in platform.get(label, {}).get("pvcMount", [])]
        outputs = spec["components"][task.component].get("outputDefinitions", {})
        keys[task.name] = kfp_rules.cache_key(task, container, pvcs, outputs)
    return keys


@pytest.mark.parametrize("change,reruns", [("images.gpu=registry.example.com/ml/prmflow-gpu:1.1", True),
                                           ("cluster.trainer.num_nodes=4", True),
                                           ("cluster.gpu_pool.accelerator_count=4", True),
                                           ("cluster.trainer.timeout_s=3600", False)])
def test_a_new_image_or_node_shape_changes_the_trainjob_steps_cache_key(tmp_path, change, reruns):
    """KFP's cache key holds a step's parameters, command, image and PVCs, never its env: a TrainJob step runs
    on the CPU image and reads its TrainJob from $PRMFLOW_TRAINJOB, so a new GPU image or num_nodes there alone
    was a cache hit that reused the old result. The image and node shape are now the step's `placement`
    parameter; the deadline is not (a finished result does not depend on it)."""
    text = CLUSTER_YAML.format(workspace="/workspace")
    before = driver_cache_keys(*compile_yaml(tmp_path / "a", text) if (tmp_path / "a").mkdir() is None else ())
    after = driver_cache_keys(*compile_yaml(tmp_path / "b", text, f"--set={change}") if (tmp_path / "b").mkdir() is None else ())
    for task in ("ppo-0 (trainjob)", "ppo-1 (trainjob)"):
        assert (before[task] != after[task]) == reruns, (change, task)
    # the env still carries the whole TrainJob, and the GPU pod steps key on their own image as before
    assert (before["rollout-0"] != after["rollout-0"]) == change.startswith("images.gpu")
    assert before["advantage-0"] == after["advantage-0"]


def test_trainjob_without_a_shared_volume_is_refused_at_compile_time(tmp_path):
    text = CLUSTER_YAML.format(workspace="/workspace").replace("    workspace_pvc: prmflow-rwx\n", "")
    cfg = tmp_path / "p.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="set pipeline.cluster.workspace_pvc to a ReadWriteMany PVC"):
        load_spec(cfg)
    with pytest.raises(ConfigError, match=r"trainer.ppo is 'trainjobs'; use one of pod, trainjob"):
        load_spec(None, data=yaml.safe_load(CLUSTER_YAML.format(workspace="/w").replace("ppo: trainjob", "ppo: trainjobs")))


def fake_ppo_output(body) -> None:
    """The node pods' work, faked: read the config the TrainJob's command names, write a complete output."""
    command = body["spec"]["trainer"]["command"]
    cfg = config_lib.load(ppo_stage.Config, command[command.index("--config") + 1], section="ppo")
    with io.atomic_output_dir(cfg.output, "ppo") as tmp:
        (tmp / "policy").mkdir()
        (tmp / "policy" / "model.safetensors").write_bytes(b"weights")
        (tmp / "kl_state.json").write_text(json.dumps({"kl_coef": 0.05, "trainjob_tag": cfg.tracking.tags}))


@pytest.fixture(scope="module")
def compiled_ppo_step(tmp_path_factory):
    """(the compiled ppo step's $PRMFLOW_TRAINJOB, the workspace volume), compiled once for the module."""
    tmp = tmp_path_factory.mktemp("compiled")
    workspace = tmp / "pvc"
    spec, _ = compile_yaml(tmp, CLUSTER_YAML.format(workspace=workspace))
    return trainjob_env(spec, "exec-ppo"), workspace


def run_ppo_step(tmp_path, monkeypatch, fake, compiled, run_id, on_volume=False):
    """The ppo component function as the compiled step's container runs it (its env, KFP's paths);
    `on_volume`: the pipeline has a workspace on the shared volume, where the output then goes."""
    env, workspace = compiled
    monkeypatch.setenv(trainjob.ENV, env)
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv(kfp_shim.RUN_ID_ENV, run_id)  # the pod's pipeline/runid label on a cluster
    return ppo_step(tmp_path, workspace if on_volume else None), workspace


def ppo_step(tmp_path: Path, workspace: Path | None = None) -> Path:
    """KFP's part of a ppo step: its input artifacts downloaded, then the component function called
    (`workspace`: the pipeline's workspace on the shared volume; none: the output is a KFP output
    artifact in the step's pod, copied there from the volume). Returns where the whole output is."""
    inputs = tmp_path / "minio"  # where KFP's launcher put the input artifacts
    for name in ("policy", "advantages"):
        (inputs / name).mkdir(parents=True)
        (inputs / name / "part-00000.parquet").write_bytes(name.encode())
    policy, advantages = dsl.Model(uri="s3://b/policy"), dsl.Dataset(uri="s3://b/adv")
    policy.path, advantages.path = str(inputs / "policy"), str(inputs / "advantages")
    outs = {k: (dsl.Artifact if k in ("state", "kl_state") else dsl.Model)(uri=f"s3://b/{k}")
            for k in ("updated", "critic", "state", "kl_state")}
    for k, a in outs.items():
        a.path = str(tmp_path / "outputs" / k)
    (tmp_path / "outputs").mkdir()
    ppo_component.ppo(config={"optim": {"lr": 1e-6}}, tracking_uri="http://mlflow:5000", experiment="prm-rl",
                      workspace=f"{workspace}/prmflow/prmflow" if workspace else "", iteration=0, policy=policy,
                      advantages=advantages, **outs)
    # the whole ppo output: on the workspace (its location is the `state` artifact), else that artifact itself
    return Path(kfp_shim.located(outs["state"].path)) if workspace else Path(outs["state"].path)


@pytest.mark.parametrize("trainer_version", ["v2.2.0", "v2.3.0"])  # the fake admits it past that version's webhook and CRD
def test_ppo_step_submits_the_configured_trainjob_waits_and_hands_on_its_output(tmp_path, monkeypatch, capsys,
                                                                               compiled_ppo_step, trainer_version):
    with FakeK8s(work=fake_ppo_output, trainer_version=trainer_version) as fake:
        run_id = f"run-7f3a-{trainer_version}"  # the compiled step's workspace is shared by the module
        out, workspace = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, run_id)
    (job,) = fake.posted()
    name = job["metadata"]["name"]
    assert job["kind"] == "TrainJob" and job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    posts = [r["path"] for r in fake.requests if r["method"] == "POST"]
    assert posts == ["/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml-team/trainjobs"]
    assert any(r["path"].endswith("/clustertrainingruntimes/torch-distributed") for r in fake.requests)
    spec = job["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "kind": "ClusterTrainingRuntime",
                                  "apiGroup": "trainer.kubeflow.org"} \
        or spec["runtimeRef"]["name"] == "torch-distributed"
    trainer = spec["trainer"]
    assert trainer["image"] == "registry.example.com/ml/prmflow-gpu:1.0" and trainer["numNodes"] == 2
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "96", "memory": "1500G"}
    config_path = workspace / "trainjobs" / run_id / "ppo-it0" / "config.yaml"
    assert trainer["command"] == ["torchrun", "--no-python", "prmflow", "ppo", "--config", str(config_path)]
    assert spec["activeDeadlineSeconds"] == 259200  # trainer.timeout_s: the job ends even if nobody waits for it
    (patch,) = spec["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert rjob["name"] == "node"
    # no Istio sidecar in the node pods (profile namespaces inject one; it breaks the rendezvous)
    assert rjob["template"]["spec"]["template"]["metadata"] == {"labels": {"sidecar.istio.io/inject": "false"}}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "prmflow-runner"  # the nodes read the object store as the run does
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "h100-pool"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["volumes"][0] == {"name": "workspace", "persistentVolumeClaim": {"claimName": "prmflow-rwx"}}
    (node,) = pod["containers"]
    assert node["volumeMounts"][0] == {"name": "workspace", "mountPath": str(workspace)}
    # the secrets reach the node container through spec.trainer.env (the webhook refuses env in a node patch)
    assert "env" not in node
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in trainer["env"] if "valueFrom" in e}
    assert secrets["MLFLOW_TRACKING_PASSWORD"] == {"name": "mlflow-creds", "key": "MLFLOW_TRACKING_PASSWORD", "optional": True}
    assert secrets["AWS_SECRET_ACCESS_KEY"]["name"] == "s3-creds"
    assert {e["name"]: e.get("value") for e in trainer["env"] if "value" in e} == {"TMPDIR": "/scratch"}
    # the stage's config on the volume: inputs copied there, the TrainJob's name as an MLflow tag
    staged = yaml.safe_load(config_path.read_text())["ppo"]
    assert staged["policy"] == str(config_path.parent / "in" / "policy")
    assert (Path(staged["input"]) / "part-00000.parquet").read_bytes() == b"advantages"
    assert staged["optim"]["lr"] == 1e-6 and staged["tracking"]["uri"] == "http://mlflow:5000"
    assert staged["tracking"]["tags"] == {"prmflow.trainjob": name}
    # its output became the step's artifact, whole and verified
    io.verify_files(out, io.read_manifest(out))
    assert (out / "policy" / "model.safetensors").read_bytes() == b"weights"
    log = capsys.readouterr().err
    assert log.index(f"TrainJob {name}: Created") < log.index(f"TrainJob {name}: Running (node-0 Running, node-1 Running)") \
        < log.index(f"TrainJob {name}: Complete")


def test_trainjob_node_pods_get_shared_memory_and_scratch_like_the_gpu_task_pods(tmp_path, monkeypatch, compiled_ppo_step):
    """NCCL needs more /dev/shm than a container's 64 MiB: the node pods get the memory-backed /dev/shm and the
    /scratch (TMPDIR) of the GPU task pods, sized by pipeline.cluster.shm_size / scratch_size."""
    with FakeK8s(work=fake_ppo_output) as fake:
        run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-shm")
    (job,) = fake.posted()
    (patch,) = job["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["scratch"]["emptyDir"]["sizeLimit"].endswith("Gi")
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/scratch"] == "scratch"


def test_a_failed_trainjob_fails_the_step_with_its_reason_and_hands_on_nothing(tmp_path, monkeypatch, compiled_ppo_step):
    def oom(body):
        return ("FailedJobs", "jobset failed: node-1 OOMKilled (exit code 137)")

    with FakeK8s(work=oom) as fake, pytest.raises(trainjob.TrainJobError) as err:
        run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-failed")
    assert "failed: FailedJobs: jobset failed: node-1 OOMKilled (exit code 137)" in str(err.value)
    assert fake.posted()[0]["metadata"]["name"] in str(err.value)
    assert not (tmp_path / "outputs" / "state").exists()


def test_an_output_on_the_volume_is_written_there_by_the_job_and_not_copied(tmp_path, monkeypatch, compiled_ppo_step):
    """Where the step's output path is on the shared volume (the workspace layout), the TrainJob writes it
    there and the step only checks it: no second copy of the checkpoint."""
    with FakeK8s(work=fake_ppo_output) as fake:
        out, workspace = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-in-place", on_volume=True)
    command = fake.posted()[0]["spec"]["trainer"]["command"]
    staged = yaml.safe_load(Path(command[command.index("--config") + 1]).read_text())["ppo"]
    assert staged["output"] == str(out) and out.is_relative_to(workspace)
    io.verify_files(out, io.read_manifest(out))
    assert not (workspace / "trainjobs" / "run-in-place" / "ppo-it0" / "output").exists()
    assert not (tmp_path / "outputs" / "state" / "manifest.json").exists()  # the step's pod holds only its location


def test_a_trainjob_that_completes_without_a_complete_output_fails_the_step(tmp_path, monkeypatch, compiled_ppo_step):
    def no_manifest(body):
        command = body["spec"]["trainer"]["command"]
        out = Path(yaml.safe_load(Path(command[command.index("--config") + 1]).read_text())["ppo"]["output"])
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # weights and manifest missing: a rank-0 crash after exit 0

    with FakeK8s(work=no_manifest) as fake, pytest.raises(trainjob.TrainJobError, match="output at .* is not complete"):
        run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-incomplete")
    assert not (tmp_path / "outputs" / "state").exists()


def test_a_retried_step_waits_for_the_job_its_first_attempt_submitted(tmp_path, monkeypatch, compiled_ppo_step):
    with FakeK8s(work=fake_ppo_output) as fake:
        _, workspace = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-retried")
        staged = workspace / "trainjobs" / "run-retried" / "ppo-it0" / "in" / "policy" / "part-00000.parquet"
        marker = staged.with_name("being-read-by-the-job")
        marker.write_text("")  # stands for the running job's open files: a re-copy would delete it
        fake.requests.clear()
        shutil.rmtree(tmp_path / "outputs")
        shutil.rmtree(tmp_path / "minio")  # the retry's pod downloads its inputs afresh
        out, _ = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-retried")
    assert fake.posted() == [] and len(fake.jobs) == 1
    assert marker.exists() and staged.exists()  # the job's inputs were left alone (it may still be reading them)
    assert (out / "policy" / "model.safetensors").read_bytes() == b"weights"



def test_a_failed_trainjob_is_deleted_and_the_retried_step_submits_a_new_one(tmp_path, monkeypatch, compiled_ppo_step):
    """The failed job is deleted (its pods already stopped; its reason is in the step's error), so the retry
    submits afresh under the same name, and the MLflow run names the job that ran."""
    outcomes = [("FailedJobs", "node-0: preempted"), None]
    with FakeK8s(work=lambda body: outcomes.pop(0) or fake_ppo_output(body)) as fake:
        with pytest.raises(trainjob.TrainJobError, match="preempted") as err:
            run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-resubmit")
        first = fake.posted()[0]["metadata"]["name"]
        assert fake.deleted == [first] and "deleted it" in str(err.value)
        shutil.rmtree(tmp_path / "minio")
        shutil.rmtree(tmp_path / "outputs")
        out, workspace = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-resubmit")
    assert [job["metadata"]["name"] for job in fake.posted()] == [first, first]
    assert fake.deleted == [first]  # the completed one stays
    staged = yaml.safe_load((workspace / "trainjobs" / "run-resubmit" / "ppo-it0" / "config.yaml").read_text())["ppo"]
    assert staged["tracking"]["tags"] == {"prmflow.trainjob": first}
    assert (out / "policy" / "model.safetensors").read_bytes() == b"weights"


def test_an_old_trainer_is_refused_before_anything_is_submitted(tmp_path, monkeypatch, compiled_ppo_step):
    """Trainer < v2.2.0 has no runtimePatches: it would drop the node selector and tolerations, and the pods
    would wait for GPU nodes they cannot tolerate until the step's timeout."""
    with FakeK8s(work=fake_ppo_output, trainer_version=None) as fake, \
            pytest.raises(trainjob.TrainJobError, match=r"older than v2\.2\.0 \(no ConfigMap kubeflow-system/kubeflow-tr"):
        run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-old-trainer")
    assert fake.posted() == []
    shutil.rmtree(tmp_path / "minio")
    shutil.rmtree(tmp_path / "outputs")
    with FakeK8s(work=fake_ppo_output, trainer_version="v2.1.0") as fake, \
            pytest.raises(trainjob.TrainJobError, match=r"Trainer v2\.1\.0 found .* need v2\.2\.0 or newer"):
        run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-old-trainer")
    assert fake.posted() == []


def test_mpi_runtimes_are_refused_naming_the_torch_runtime(tmp_path, monkeypatch, compiled_ppo_step):
    data = yaml.safe_load(CLUSTER_YAML.format(workspace="/w"))
    data["pipeline"]["cluster"]["trainer"]["runtime"] = "deepspeed-distributed"
    with pytest.raises(ConfigError, match="an MPI runtime.*Use runtime: torch-distributed"):
        load_spec(None, data=data)  # at compile time, for Trainer's own MPI runtimes
    env, workspace = compiled_ppo_step
    renamed = json.dumps({**json.loads(env), "runtime": "team-mpi"})  # a cluster's own runtime: known when read
    with FakeK8s(work=fake_ppo_output, runtimes={"team-mpi": "deepspeed"}) as fake, \
            pytest.raises(trainjob.TrainJobError, match="'deepspeed' runtime.*runtime to torch-distributed"):
        run_ppo_step(tmp_path, monkeypatch, fake, (renamed, workspace), "run-mpi")
    assert fake.posted() == []


def start_ppo_step(tmp_path: Path, fake, env: str, run_id: str):
    """The ppo step in its own process (as in its pod), once its TrainJob's pods run; (process, job name)."""
    import os
    import subprocess
    import sys
    import time

    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from pathlib import Path; "
            f"from pipelines.test_trainjob import ppo_step; ppo_step(Path({str(tmp_path)!r}))")
    child_env = {**os.environ, trainjob.ENV: env, "KUBECONFIG": str(fake.kubeconfig(tmp_path / "kubeconfig")),
                 "PYTHONPATH": str(ROOT), kfp_shim.RUN_ID_ENV: run_id}
    step = subprocess.Popen([sys.executable, "-c", code], env=child_env, stderr=subprocess.PIPE, text=True)
    name = trainjob.job_name(run_id, "ppo", 0)
    for _ in range(1200):  # until the fake controller has the job's pods Running (or the step died)
        seen = fake.pods_seen.get(name)
        if (seen is not None and seen.wait(0.1)) or step.poll() is not None:
            break
        if seen is None:
            time.sleep(0.1)
    assert step.poll() is None, step.stderr.read()
    assert fake.phase[name] == "Running"
    return step, name


def test_a_stopped_step_deletes_its_trainjob(tmp_path, compiled_ppo_step):
    """Terminating the KFP run stops the step's pod (SIGTERM): the TrainJob and its GPUs go with it."""
    import signal
    import threading

    release = threading.Event()
    with FakeK8s(work=lambda body: release.wait(60) and fake_ppo_output(body)) as fake:
        step, name = start_ppo_step(tmp_path, fake, compiled_ppo_step[0], "run-stopped")
        step.send_signal(signal.SIGTERM)
        _, err = step.communicate(timeout=120)
        release.set()
    assert step.returncode != 0
    assert fake.deleted == [name] and name not in fake.jobs
    assert f"deleted TrainJob {name} (the step was stopped)" in err and "SIGTERM" in err
    assert not (tmp_path / "outputs" / "state").exists()


def test_a_step_retried_after_its_pod_died_reattaches_to_the_running_trainjob(tmp_path, monkeypatch, compiled_ppo_step):
    """A lost node kills the step without a signal it can act on (SIGKILL): the job keeps running, and the
    retried step waits for that job rather than submitting a second one."""
    import signal
    import threading

    release = threading.Event()
    with FakeK8s(work=lambda body: release.wait(60) and fake_ppo_output(body)) as fake:
        step, name = start_ppo_step(tmp_path, fake, compiled_ppo_step[0], "run-node-lost")
        step.send_signal(signal.SIGKILL)
        step.communicate(timeout=120)
        shutil.rmtree(tmp_path / "minio")
        shutil.rmtree(tmp_path / "outputs")
        threading.Timer(1.0, release.set).start()  # the job finishes while the retry waits for it
        out, _ = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-node-lost")
    assert [job["metadata"]["name"] for job in fake.posted()] == [name] and fake.deleted == []
    assert (out / "policy" / "model.safetensors").read_bytes() == b"weights"


def test_a_trainjob_that_outlives_the_timeout_is_deleted(tmp_path, monkeypatch, compiled_ppo_step):
    import threading

    env, workspace = compiled_ppo_step
    short = json.dumps({**json.loads(env), "timeout_s": 3, "poll_s": 1})
    release = threading.Event()
    with FakeK8s(work=lambda body: release.wait(60) and fake_ppo_output(body)) as fake, \
            pytest.raises(trainjob.TrainJobError, match="did not finish within pipeline.cluster.trainer.timeout_s = 3 s"):
        try:
            run_ppo_step(tmp_path, monkeypatch, fake, (short, workspace), "run-timeout")
        finally:
            release.set()
    (job,) = fake.posted()
    assert job["spec"]["activeDeadlineSeconds"] == 3
    assert fake.deleted == [job["metadata"]["name"]]


def test_the_7b_two_node_recipe_compiles_with_sft_and_ppo_as_trainjobs(tmp_path):
    text = (ROOT / "configs" / "cluster" / "ppo-7b-2x8.yaml").read_text()
    spec, _ = compile_yaml(tmp_path, text, *IMAGES)
    by_name = {t["taskInfo"]["name"]: t for t in all_tasks(spec).values()}
    assert "sft (trainjob)" in by_name and "prm" in by_name
    assert {f"ppo-{k} (trainjob)" for k in range(10)} <= set(by_name)
    ex = by_name["ppo-9 (trainjob)"]["componentRef"]["name"].replace("comp-", "exec-")
    submitted = json.loads(trainjob_env(spec, ex))
    assert submitted["num_nodes"] == 2 and submitted["resources_per_node"]["nvidia.com/gpu"] == 8
    assert submitted["workspace_pvc"] == "prmflow-workspace" and submitted["runtime"] == "torch-distributed"
    ppo_params = spec["root"]["inputDefinitions"]["parameters"]["ppo_config"]["defaultValue"]
    assert ppo_params["train_critic"] is True and ppo_params["engine"]["zero_stage"] == 2  # ZeRO-2 across nodes over TCP


def run_node_pods(body, workspace: Path):
    """The node pods, for real on this machine: the TrainJob's command with the env Kubeflow Trainer's
    torch plugin gives a 1-node, 1-process job (torchrun reads the PET_* variables)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0",
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env.pop(trainjob.ENV, None)  # the pods are not steps: they train
    proc = subprocess.run(body["spec"]["trainer"]["command"], env=env, capture_output=True, text=True, cwd=workspace)
    if proc.returncode:
        return ("FailedJobs", f"node-0 exited {proc.returncode}: {proc.stderr[-2000:]}")
    return None


@pytest.mark.slow
def test_sft_trainjob_command_trains_and_tags_its_mlflow_run(tmp_path, monkeypatch):
    """The command the TrainJob carries, run as its pod would run it (torchrun, the config on the
    volume): the step's artifact is the trained policy and the stage's MLflow run names the TrainJob."""
    import mlflow

    from prmflow.pipelines import kfp_components as sft_component

    workspace = tmp_path / "pvc"
    workspace.mkdir()
    spec, _ = compile_yaml(tmp_path, CLUSTER_YAML.format(workspace=workspace).replace("ppo: trainjob", "sft: trainjob"))
    ex = next(e for e in spec["deploymentSpec"]["executors"] if trainjob_env(spec, e))
    monkeypatch.setenv(trainjob.ENV, trainjob_env(spec, ex))
    monkeypatch.setenv(kfp_shim.RUN_ID_ENV, "run-9")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with FakeK8s(work=lambda body: run_node_pods(body, workspace)) as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
        policy = dsl.Model(uri="s3://b/policy")
        policy.path = str(tmp_path / "outputs" / "policy")
        (tmp_path / "outputs").mkdir()
        sft_component.sft(config={"max_steps": 2, "num_prompts": 32, "eval_size": 8, "micro_batch_size": 4,
                                  "eval_every": 2, "save_every": 0, "optim": {"warmup_steps": 0},
                                  "engine": {"backend": "torch"}},
                          tracking_uri=store, experiment="trainjob-test", workspace=f"{workspace}/prmflow/prmflow",
                          policy=policy)
    name = fake.posted()[0]["metadata"]["name"]
    out = Path(kfp_shim.located(policy.path))  # the job wrote the policy once, on the workspace
    assert out.parent == workspace / "prmflow" / "prmflow" and not (workspace / "trainjobs" / "run-9" / "sft" / "output").exists()
    io.verify_files(out, io.read_manifest(out))
    assert (out / "model.safetensors").is_file()
    runs = mlflow.MlflowClient(store).search_runs(
        [mlflow.MlflowClient(store).get_experiment_by_name("trainjob-test").experiment_id])
    assert [r.data.tags.get("prmflow.trainjob") for r in runs if r.data.tags.get("prmflow.stage") == "sft"] == [name]


def test_a_trainjob_step_survives_a_stalled_api_server_and_a_transient_500(tmp_path, monkeypatch, compiled_ppo_step):
    """The API server stalls 130 s on a status read (an etcd hiccup, a control-plane upgrade), longer than the
    SDK's 120 s read timeout, then answers one read with a 500: the step reads again and hands on the job's
    output; the job is neither deleted nor left behind. Time is scaled 1:100 (the SDK's read timeout
    kubeflow.common.constants.DEFAULT_TIMEOUT 120 s -> 1.2 s, the stall 130 s -> 1.3 s), so no test waits
    two minutes."""
    from kubeflow.common import constants as sdk_constants

    from prmflow.pipelines.contracts import sdk as sdk_rules

    assert sdk_constants.DEFAULT_TIMEOUT == sdk_rules.READ_TIMEOUT_S  # the rule we scale is the installed SDK's
    monkeypatch.setattr(sdk_constants, "DEFAULT_TIMEOUT", sdk_rules.READ_TIMEOUT_S / 100)
    with FakeK8s(work=fake_ppo_output, read_faults=[("stall", 130 / 100), ("status", 500)]) as fake:
        out, _ = run_ppo_step(tmp_path, monkeypatch, fake, compiled_ppo_step, "run-stall")
        assert fake.read_faults == []  # both faults were met
    (job,) = fake.posted()
    assert fake.deleted == [] and fake.phase[job["metadata"]["name"]] == "Complete"
    assert (out / "policy" / "model.safetensors").read_bytes() == b"weights"
