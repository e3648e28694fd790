"""A training stage as a Kubeflow Trainer TrainJob: submit it, wait for it, hand its output on.

When the pipeline runs a stage on several nodes (`pipeline.cluster.trainer.<stage>: trainjob`), the
stage's KFP step does not train: its pod (CPU pool) sets the stage up on the shared ReadWriteMany
volume and lets Kubeflow Trainer run it, the pattern Kubeflow's own components use:

    1. copy the step's input artifacts to <workspace>/trainjobs/<kfp run>/<stage>[-it<k>]/in/
    2. write the stage's full config there (paths on the volume, the TrainJob name as an MLflow tag)
    3. check the Trainer is v2.2.0 or newer (its public ConfigMap; runtimePatches and activeDeadlineSeconds
       exist from v2.2.0: an older API server drops them and the pods never reach the tainted GPU nodes)
    4. submit a TrainJob built by the `kubeflow` SDK (TrainerClient): the GPU image, `torchrun ...
       prmflow <stage> --config ...`, num_nodes pods with the GPU pool's accelerators, node selector,
       tolerations, image pull secrets, the workspace volume, a memory-backed /dev/shm and a /scratch
       (as the GPU task pods have), the Istio opt-out label, activeDeadlineSeconds = trainer.timeout_s,
       and the secrets as env in spec.trainer.env (Trainer's webhook refuses env on the `node` container
       in runtimePatches, and the SDK's own env takes no secret reference: contracts/trainer.py, sdk.py)
    5. poll its status (printed to the step's log) until Complete or Failed; Failed fails the step
       with the TrainJob's reason and message
    6. check the output's manifest and checksums. An output path on the volume (the workspace layout) is
       where the job wrote it: read there, not copied; any other output path gets a copy

The TrainJob is deleted when the step stops waiting for it without a result: the step's pod is
stopped (SIGTERM: the run was terminated, or the pod evicted), the wait times out, or the job failed.
Its name is derived from the KFP run, stage and iteration, so a retried step whose previous attempt
died without that chance (a lost node, SIGKILL) finds the job still running and waits for it instead
of starting a second one; a resubmitted job resumes from its checkpoint on the volume.
Only torch runtimes: on Trainer's MPI runtimes the image and command reach the launcher only.
This module is called by `kfp_shim.run_stage` when the pipeline set $PRMFLOW_TRAINJOB on the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import contextlib
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..components import config as config_lib
from ..components.data import io
from ..errors import PrmflowError
from ..tracking import kfp_plugin
from .contracts import sdk as sdk_rules
from .contracts import trainer as trainer_rules

#: The pipeline sets this env var (JSON of TrainJobSpec) on a step that runs its stage as a TrainJob.
ENV = "PRMFLOW_TRAINJOB"
COMPLETE, FAILED = trainer_rules.COMPLETE, trainer_rules.FAILED
#: How a node of a torch runtime starts its ranks (torchrun reads the PET_* env the Trainer's torch
#: plugin sets: nnodes, nproc per node, node rank, master address and port).
LAUNCHER = ["torchrun", "--no-python"]
#: The oldest Kubeflow Trainer with what the TrainJob uses (spec.runtimePatches, spec.activeDeadlineSeconds).
MIN_TRAINER = (2, 2, 0)
#: Trainer's public ConfigMap (from v2.2.0, readable by every authenticated user) and its version key.
VERSION_CONFIGMAP, VERSION_KEY = "kubeflow-trainer-public", "kubeflow_trainer_version"
ISTIO_LABEL = "sidecar.istio.io/inject"


class TrainJobError(PrmflowError):
    """A TrainJob could not be submitted, failed, or finished without a complete output."""


@dataclass
class TrainJobSpec:
    """What the pipeline tells a step about the TrainJob it submits (from pipeline.cluster)."""

    image: str
    num_nodes: int
    resources_per_node: dict = field(default_factory=dict)
    """Kubernetes resources of each node pod, e.g. {nvidia.com/gpu: 8, cpu: '32', memory: 512G}."""
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    secret_env: dict = field(default_factory=dict)
    """{secret name: [keys]}: each key becomes an env var of the same name (optional keys)."""
    workspace_pvc: str = ""
    workspace_path: str = "/workspace"
    runtime: str = "torch-distributed"
    namespace: str = ""
    timeout_s: int = 259200
    poll_s: int = 30
    image_pull_secrets: list = field(default_factory=list)
    service_account: str = ""
    """Service account of the node pods (pipeline.cluster.service_account); empty: the namespace's default."""
    disable_istio_sidecar: bool = True
    system_namespace: str = "kubeflow-system"
    shm_size: str = ""
    """Size of the memory-backed /dev/shm of each node pod (NCCL); empty: none (the container's 64 MiB)."""
    scratch_size: str = ""
    """Size limit of each node pod's /scratch emptyDir (TMPDIR); empty: none."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def placement(self) -> str:
        """What of the TrainJob decides what the stage computes: the image (the code) and the world size and
        shape (num_nodes, resources_per_node, runtime), as JSON. The step takes it as its `placement`
        parameter, because KFP's cache key holds a step's parameters but not its env (contracts/kfp.py
        CACHE_KEY): with it only in $PRMFLOW_TRAINJOB, a new images.gpu or num_nodes was a cache hit. The
        rest (timeout, polling, tolerations, secrets) changes where and how long it runs, not the result."""
        return json.dumps({k: getattr(self, k) for k in PLACEMENT_FIELDS}, sort_keys=True)


#: The TrainJobSpec fields in the step's cache key (TrainJobSpec.placement).
PLACEMENT_FIELDS = ("image", "num_nodes", "resources_per_node", "runtime")


def spec_from_env() -> TrainJobSpec | None:
    raw = os.environ.get(ENV, "")
    return TrainJobSpec(**json.loads(raw)) if raw else None


def job_name(kfp_run_id: str, stage: str, iteration: int | None) -> str:
    """A DNS-1035 name, the same for every attempt of one step (so a retry re-attaches)."""
    step = f"{stage}-it{iteration}" if iteration is not None else stage
    digest = hashlib.sha256(f"{kfp_run_id}/{step}".encode()).hexdigest()[:10]
    return f"prmflow-{step}-{digest}"


def workdir_of(spec: TrainJobSpec, kfp_run_id: str, stage: str, iteration: int | None) -> Path:
    run = re.sub(r"[^A-Za-z0-9_.-]", "_", kfp_run_id or "no-run-id")
    return Path(spec.workspace_path) / "trainjobs" / run / (f"{stage}-it{iteration}" if iteration is not None else stage)


def _staged_paths(values: dict[str, Any], input_keys: list[str], inputs_dir: Path) -> dict[str, str]:
    """Where each input outside the workspace goes on it: {key: path the stage reads}."""
    return {key: str(inputs_dir / key / Path(values[key]).name if Path(values[key]).is_file() else inputs_dir / key)
            for key in input_keys}


def _stage_inputs(values: dict[str, Any], staged: dict[str, str]) -> None:
    """Copy the inputs onto the workspace (only before submitting: a running job may be reading them)."""
    for key, target in staged.items():
        src, dst = Path(values[key]), Path(target)
        if dst.exists():
            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, symlinks=False) if src.is_dir() else shutil.copy2(src, dst)


def _option(fn):
    """An SDK option (callable(job_spec, trainer, backend)) from a function of job_spec."""
    return lambda job_spec, trainer, backend: fn(job_spec)


def _set_name(name: str):
    return _option(lambda job_spec: job_spec.setdefault("metadata", {}).__setitem__("name", name))


#: Where a node pod's local scratch is mounted (TMPDIR), as on the GPU task pods (pipeline.SCRATCH).
SCRATCH = "/scratch"


def _runtime_patch(spec: TrainJobSpec):
    """Node selector, tolerations, pull secrets, the workspace volume, /dev/shm and /scratch and the Istio
    opt-out on every node pod (spec.runtimePatches, Trainer >= v2.2.0). No env here: Trainer's webhook
    refuses env on the `node` container in a patch (`trainer_env` puts it in spec.trainer.env)."""
    from kubeflow.trainer.options.kubernetes import (ContainerPatch, JobSetSpecPatch, JobSetTemplatePatch,
                                                     JobSpecPatch, JobTemplatePatch, PodSpecPatch,
                                                     PodTemplatePatch, ReplicatedJobPatch, RuntimePatch,
                                                     TrainingRuntimeSpecPatch)

    volumes = [{"name": "workspace", "persistentVolumeClaim": {"claimName": spec.workspace_pvc}}]
    mounts = [{"name": "workspace", "mountPath": spec.workspace_path}]
    if spec.shm_size:  # NCCL shares tensors through /dev/shm; the container default is 64 MiB
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.scratch_size:
        volumes.append({"name": "scratch", "emptyDir": {"sizeLimit": spec.scratch_size}})
        mounts.append({"name": "scratch", "mountPath": SCRATCH})
    pod = PodSpecPatch(volumes=volumes, containers=[ContainerPatch(name="node", volume_mounts=mounts)],
                       node_selector={k: str(v) for k, v in spec.node_selector.items()} or None,
                       tolerations=spec.tolerations or None,
                       image_pull_secrets=[{"name": s} for s in spec.image_pull_secrets] or None,
                       service_account_name=spec.service_account or None)
    # an Istio sidecar (injected in Kubeflow profile namespaces) breaks the torch rendezvous (kubeflow/trainer#2794)
    metadata = {"labels": {ISTIO_LABEL: "false"}} if spec.disable_istio_sidecar else None
    return RuntimePatch(training_runtime_spec=TrainingRuntimeSpecPatch(template=JobSetTemplatePatch(
        spec=JobSetSpecPatch(replicated_jobs=[ReplicatedJobPatch(name="node", template=JobTemplatePatch(
            spec=JobSpecPatch(template=PodTemplatePatch(metadata=metadata, spec=pod))))]))))


def trainer_env(spec: TrainJobSpec, mlflow_env: list[dict] | None = None) -> list[dict]:
    """spec.trainer.env of the node container: each secret key by reference (optional, as on the task pods),
    TMPDIR on /scratch, and `mlflow_env` (what KFP's MLflow integration gave the step, kfp_plugin.forward_env),
    which replaces a secret key of the same name: an env name appears once (the CRD's list map, contracts/trainer.py
    ENV_LIST_MAP), and the pods log where the step would, with KFP's credentials for KFP's server."""
    mlflow_env = list(mlflow_env or [])
    taken = {e["name"] for e in mlflow_env}
    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
           for secret, keys in sorted(spec.secret_env.items()) for key in keys if key not in taken]
    return env + mlflow_env + ([{"name": "TMPDIR", "value": SCRATCH}] if spec.scratch_size else [])


def trainjob_body(client, runtime, spec: TrainJobSpec, name: str, stage: str, command: list[str],
                  kfp_run_id: str, mlflow_env: list[dict] | None = None) -> dict:
    """The TrainJob the step submits, as the SDK's `train()` builds it from our options (name, labels,
    command, runtime patch, deadline), with `trainer_env` added to spec.trainer.env (train() passes only
    the command and args of an option's trainer section on: contracts/sdk.py)."""
    from kubeflow.trainer import CustomTrainerContainer
    from kubeflow.trainer.constants import constants
    from kubeflow.trainer.options.kubernetes import ActiveDeadlineSeconds, Labels, TrainerCommand
    from kubeflow_trainer_api import models

    trainer = CustomTrainerContainer(image=spec.image, num_nodes=spec.num_nodes,
                                     resources_per_node=dict(spec.resources_per_node) or None)
    labels = {"prmflow.io/stage": stage, "prmflow.io/kfp-run": re.sub(r"[^A-Za-z0-9_.-]", "-", kfp_run_id)[:63]}
    backend = client.backend
    job_spec: dict = {}
    for option in (_set_name(name), Labels(labels), TrainerCommand(command), _runtime_patch(spec),
                   ActiveDeadlineSeconds(int(spec.timeout_s))):
        option(job_spec, trainer, backend)
    meta, section = job_spec.get("metadata", {}), job_spec.get("spec", {})
    body = models.TrainerV1alpha1TrainJob(
        apiVersion=constants.API_VERSION, kind=constants.TRAINJOB_KIND,
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=name, labels=meta.get("labels"),
                                                                 annotations=meta.get("annotations")),
        spec=backend._get_trainjob_spec(runtime=runtime, trainer=trainer, trainer_overrides=section.get("trainer", {}),
                                        runtime_patches=section.get("runtimePatches"),
                                        active_deadline_seconds=section.get("activeDeadlineSeconds"))).to_dict()
    env = trainer_env(spec, mlflow_env)
    if env:
        body["spec"].setdefault("trainer", {})
        body["spec"]["trainer"]["env"] = list(body["spec"]["trainer"].get("env") or []) + env
    return body


def _create(client, body: dict) -> None:
    """POST the TrainJob; RuntimeError with the API server's answer as its cause (as the SDK's train())."""
    from kubeflow.trainer.constants import constants

    backend = client.backend
    try:
        backend.custom_api.create_namespaced_custom_object(constants.GROUP, constants.VERSION, backend.namespace,
                                                           constants.TRAINJOB_PLURAL, body)
    except Exception as e:  # noqa: BLE001 - the API server's answer (e.g. the webhook's refusal) is the cause
        raise RuntimeError(f"Failed to create {constants.TRAINJOB_KIND}: {backend.namespace}/{body['metadata']['name']}") from e


def check_trainer_version(client, spec: TrainJobSpec) -> str:
    """The Trainer's version from its public ConfigMap; TrainJobError when it is older than MIN_TRAINER
    (a Trainer before v2.2.0 has no such ConfigMap, and would drop runtimePatches: the pods would wait
    for nodes they cannot tolerate until the step's timeout)."""
    from kubernetes.client import ApiException

    need = "v" + ".".join(map(str, MIN_TRAINER))
    try:
        cm = client.backend.core_api.read_namespaced_config_map(VERSION_CONFIGMAP, spec.system_namespace)
        version = (cm.data or {}).get(VERSION_KEY, "")
    except ApiException as e:
        if e.status == 404:
            raise TrainJobError(f"Kubeflow Trainer is older than {need} (no ConfigMap {spec.system_namespace}/"
                                f"{VERSION_CONFIGMAP}): prmflow's TrainJobs need {need} or newer (spec.runtimePatches, "
                                f"activeDeadlineSeconds). Upgrade Trainer, or set pipeline.cluster.trainer."
                                f"system_namespace if it is installed elsewhere.") from None
        raise TrainJobError(f"Cannot read the Trainer version from ConfigMap {spec.system_namespace}/"
                            f"{VERSION_CONFIGMAP}: {e.status} {e.reason}.") from None
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version)
    if m is None or tuple(map(int, m.groups())) < MIN_TRAINER:
        raise TrainJobError(f"Kubeflow Trainer {version or '(no version)'} found ({spec.system_namespace}/"
                            f"{VERSION_CONFIGMAP}); prmflow's TrainJobs need {need} or newer "
                            f"(spec.runtimePatches, activeDeadlineSeconds). Upgrade Trainer.")
    return version


def client_for(spec: TrainJobSpec):
    """A TrainerClient on $KUBECONFIG when set, else the pod's in-cluster service account."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient
    from kubernetes import config as kube_config

    config_file = os.environ.get("KUBECONFIG") or None
    namespace = spec.namespace or None
    if namespace is None and config_file:  # the SDK reads the context's namespace from ~/.kube/config only
        _, current = kube_config.list_kube_config_contexts(config_file=config_file)
        namespace = current.get("context", {}).get("namespace")
    return TrainerClient(KubernetesBackendConfig(namespace=namespace, config_file=config_file))


def _failure_reason(client, name: str) -> str:
    """'<reason>: <message>' of the TrainJob's Failed condition (the SDK reports only the status)."""
    from kubeflow.trainer.constants import constants

    backend = client.backend
    cr = backend.custom_api.get_namespaced_custom_object(constants.GROUP, constants.VERSION, backend.namespace,
                                                         constants.TRAINJOB_PLURAL, name)
    for cond in (cr.get("status") or {}).get("conditions") or []:
        if cond.get("type") == FAILED and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".rstrip(": ")
    return "no reason given"


def _existing_status(client, name: str) -> str | None:
    """The status of TrainJob `name`, or None when there is none."""
    from kubernetes.client import ApiException

    try:
        return client.get_job(name).status
    except RuntimeError as e:
        if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
            return None
        raise


def _reporter(name: str):
    last: list[Any] = [None]

    def report(job) -> None:
        nodes = ", ".join(f"{s.name} {s.status}" for s in job.steps)
        line = f"TrainJob {name}: {job.status}" + (f" ({nodes})" if nodes else "")
        if line != last[0]:
            print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)
            last[0] = line
    return report


def _check_output(src: Path) -> None:
    """The TrainJob's output is committed whole: its manifest and every file's checksum."""
    try:
        io.verify_files(src, io.read_manifest(src))
    except PrmflowError as e:
        raise TrainJobError(f"The TrainJob finished but its output at '{src}' is not complete: {e}") from None


def _commit_output(src: Path, dst: Path) -> None:
    """Copy the TrainJob's output to the step's output path, whole or not at all (only when that path is
    not on the shared volume, where the job could have written it itself)."""
    _check_output(src)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    os.replace(tmp, dst)


def _api_message(e: BaseException) -> str:
    """The API server's own message behind an SDK error (e.g. the webhook's refusal), else the cause."""
    cause = e.__cause__
    body = getattr(cause, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)
        except (ValueError, AttributeError):
            return str(body)
    return str(cause)


class JobDeadline(Exception):
    """The step's own deadline for its TrainJob (pipeline.cluster.trainer.timeout_s) passed."""


def wait_for_job(client, name: str, timeout_s: float, poll_s: float, report, clock=time.monotonic,
                 sleep=time.sleep):
    """Read TrainJob `name` every poll_s seconds until it is Complete or Failed; JobDeadline after timeout_s
    (on `clock`). The SDK's get_job gives up on one read after 120 s (TimeoutError) and wraps a 500 in a
    RuntimeError (contracts/sdk.py): such a read is read again, not taken for the deadline, so a slow or
    restarting API server neither deletes a running job nor fails the step. A 404 (the job was deleted
    elsewhere) or an authorization error fails the step, leaving the job to its own activeDeadlineSeconds
    and to a retry of the step, which re-attaches to it."""
    deadline = clock() + timeout_s
    while True:
        try:
            job = client.get_job(name)
        except (TimeoutError, RuntimeError) as e:
            kind = sdk_rules.read_failure(e)
            if kind == "gone":
                raise TrainJobError(f"TrainJob '{name}' is gone (deleted outside this step?): {e}.") from None
            if kind == "fatal":
                raise TrainJobError(f"Cannot read TrainJob '{name}': {e} ({_api_message(e)}). It was not deleted: a "
                                    f"retry of this step waits for it again.") from None
            print(f"{time.strftime('%H:%M:%S')} reading TrainJob {name} failed ({e}: {_api_message(e)}); "
                  f"reading again in {poll_s:g} s", file=sys.stderr, flush=True)
        else:
            report(job)
            if job.status in (COMPLETE, FAILED):
                return job
        if clock() >= deadline:
            raise JobDeadline(f"still running after {timeout_s:g} s")
        sleep(poll_s)


class StepStopped(BaseException):
    """The step's pod was told to stop (SIGTERM/SIGINT). A BaseException: the SDK's `except Exception`
    around its API calls must not swallow it."""


@contextlib.contextmanager
def _stop_on_signal() -> Any:
    """SIGTERM/SIGINT raise StepStopped in the waiting step (main thread only: elsewhere a no-op)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise StepStopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _delete(client, name: str, why: str) -> str:
    """Delete TrainJob `name` (its JobSet and pods go with it); a sentence saying so, or why it could not."""
    try:
        client.delete_job(name)
    except (RuntimeError, TimeoutError) as e:
        return f"could not delete it ({e}: {e.__cause__}); delete it with: kubectl delete trainjob {name}"
    print(f"deleted TrainJob {name} ({why})", file=sys.stderr, flush=True)
    return "deleted it"


def _log_tail(client, name: str, lines: int = 40) -> str:
    """The last lines of node-0's log, while its pod still exists ('' when it does not)."""
    try:
        return "".join(list(client.get_job_logs(name))[-lines:]).rstrip()
    except Exception:  # noqa: BLE001 - the log is a courtesy; the failure reason is already in hand
        return ""


def run(stage: str, config_cls: type, values: dict[str, Any], paths: dict[str, Any], spec: TrainJobSpec,
        kfp_run_id: str, iteration: int | None) -> dict:
    """Run `stage` as a TrainJob; `values` is the stage's flat config with the step's `paths` in it.
    Returns {"trainjob": name}; raises TrainJobError when the job fails, times out, the step is stopped
    (the job is deleted in these three cases), or its output is incomplete."""
    work = workdir_of(spec, kfp_run_id, stage, iteration)
    base = job_name(kfp_run_id, stage, iteration)
    inputs = [k for k, v in paths.items() if k != "output" and isinstance(v, str) and v and os.path.exists(v)
              and not Path(v).resolve().is_relative_to(Path(spec.workspace_path).resolve())]
    staged = _staged_paths(values, inputs, work / "in")
    # an output path on the shared volume (the pipeline's workspace layout) is written by the job where it is
    # read from; any other (a KFP artifact in the step's pod) is written on the volume, then copied there
    in_place = Path(paths["output"]).resolve().is_relative_to(Path(spec.workspace_path).resolve())
    output = Path(paths["output"]) if in_place else work / "output"
    original, values = values, {**values, **staged, "output": str(output)}
    client = client_for(spec)
    name, status = base, _existing_status(client, base)
    for attempt in range(1, 100):  # a failed job that could not be deleted keeps its name; resubmit as -r<k>
        if status != FAILED:
            break
        name = f"{base}-r{attempt}"
        status = _existing_status(client, name)
    tags = {**(values.get("tracking.tags") or {}), "prmflow.trainjob": name}
    cfg = config_lib.build(config_cls, {**values, "tracking.tags": tags}, where=f"pipeline step '{stage}'")
    config_path = work / "config.yaml"
    if status is None:  # a new job: its inputs and config on the volume (a running one keeps what it reads)
        version = check_trainer_version(client, spec)
        _stage_inputs(original, staged)
        config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config_path.with_name(f".config.yaml.tmp-{os.getpid()}")
        tmp.write_text(yaml.safe_dump({stage: config_lib.to_dict(cfg)}, sort_keys=False))
        os.replace(tmp, config_path)
        runtime = client.get_runtime(spec.runtime)
        framework = runtime.trainer.framework
        if framework != "torch":
            raise TrainJobError(f"Runtime '{spec.runtime}' is a '{framework}' runtime; prmflow runs on torch runtimes: "
                                f"set pipeline.cluster.trainer.runtime to torch-distributed (DeepSpeed runs inside "
                                f"each torchrun rank). On MPI runtimes Trainer sets the image and command on the "
                                f"launcher only.")
        command = [*LAUNCHER, "prmflow", stage, "--config", str(config_path)]
        try:
            body = trainjob_body(client, runtime, spec, name, stage, command, kfp_run_id,
                                 kfp_plugin.forward_env(str(values.get("tracking.uri") or "")))
            _create(client, body)
        except (RuntimeError, TimeoutError, ValueError) as e:
            raise TrainJobError(f"Could not submit TrainJob '{name}' for stage {stage}: {e} ({_api_message(e)})") from e
        print(f"submitted TrainJob {name} (Trainer {version}; {spec.num_nodes} nodes x {spec.resources_per_node}, "
              f"runtime {spec.runtime}, deadline {spec.timeout_s} s): {' '.join(command)}", file=sys.stderr, flush=True)
    else:
        print(f"TrainJob {name} exists ({status}): waiting for it", file=sys.stderr, flush=True)
    try:
        with _stop_on_signal():
            job = wait_for_job(client, name, spec.timeout_s, spec.poll_s, _reporter(name))
    except StepStopped as e:
        raise TrainJobError(f"The step was stopped ({e}) while TrainJob '{name}' ({stage}) ran: "
                            f"{_delete(client, name, 'the step was stopped')}.") from None
    except JobDeadline as e:
        raise TrainJobError(f"TrainJob '{name}' ({stage}) did not finish within pipeline.cluster.trainer."
                            f"timeout_s = {spec.timeout_s} s ({e}): {_delete(client, name, 'timed out')}.") from None
    if job.status == FAILED:
        reason, tail = _failure_reason(client, name), _log_tail(client, name)
        raise TrainJobError(f"TrainJob '{name}' ({stage}) failed: {reason}"
                            + (f"\nlast lines of node-0:\n{tail}" if tail else "")
                            + f"\n{_delete(client, name, 'failed')}.")
    if in_place:
        _check_output(output)
    else:
        _commit_output(output, Path(paths["output"]))
    return {"trainjob": name}
