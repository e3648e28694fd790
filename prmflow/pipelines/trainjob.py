"""A training stage as a Kubeflow Trainer TrainJob: submit it, wait for it, hand its output on.

When the pipeline runs a stage on several nodes (`pipeline.cluster.trainer.<stage>: trainjob`), the
stage's KFP step does not train: its pod (CPU pool) sets the stage up on the shared ReadWriteMany
volume and lets Kubeflow Trainer run it, the pattern Kubeflow's own components use:

    1. copy the step's input artifacts to <workspace>/trainjobs/<kfp run>/<stage>[-it<k>]/in/
    2. write the stage's full config there (paths on the volume, the TrainJob name as an MLflow tag)
    3. submit a TrainJob through the `kubeflow` SDK (TrainerClient): the GPU image, `torchrun ...
       prmflow <stage> --config ...` (mpirun for an MPI runtime), num_nodes pods with the GPU pool's
       accelerators, node selector, tolerations, the workspace volume and the secrets as env
    4. poll its status (printed to the step's log) until Complete or Failed; Failed fails the step
       with the TrainJob's reason and message
    5. check the output's manifest and checksums, copy it to the step's output artifact

The TrainJob's name is derived from the KFP run, stage and iteration, so a retried step finds the job
its previous attempt submitted and waits for it instead of starting a second one; the stage resumes
from its checkpoint on the volume when a job is resubmitted after a failure.
This module is called by `kfp_shim.run_stage` when the pipeline set $PRMFLOW_TRAINJOB on the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..components.common import config as config_lib
from ..components.common import io
from ..errors import PrmflowError

#: The pipeline sets this env var (JSON of TrainJobSpec) on a step that runs its stage as a TrainJob.
ENV = "PRMFLOW_TRAINJOB"
COMPLETE, FAILED = "Complete", "Failed"
#: How each Kubeflow Trainer framework starts the ranks of one node (torchrun reads the PET_* env
#: the Trainer's torch plugin sets: nnodes, nproc per node, node rank, master address and port).
LAUNCHERS = {"torch": ["torchrun", "--no-python"], "deepspeed": ["mpirun", "--hostfile", "/etc/mpi/hostfile"]}


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


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


def _runtime_patch(spec: TrainJobSpec, framework: str):
    """Node selector, tolerations, the workspace volume and secret env on every node pod."""
    from kubeflow.trainer.options.kubernetes import (ContainerPatch, JobSetSpecPatch, JobSetTemplatePatch,
                                                     JobSpecPatch, JobTemplatePatch, PodSpecPatch,
                                                     PodTemplatePatch, ReplicatedJobPatch, RuntimePatch,
                                                     TrainingRuntimeSpecPatch)

    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
           for secret, keys in sorted(spec.secret_env.items()) for key in keys]
    mounts = [{"name": "workspace", "mountPath": spec.workspace_path}]
    pod = PodSpecPatch(volumes=[{"name": "workspace", "persistentVolumeClaim": {"claimName": spec.workspace_pvc}}],
                       containers=[ContainerPatch(name="node", env=env or None, volume_mounts=mounts)],
                       node_selector={k: str(v) for k, v in spec.node_selector.items()} or None,
                       tolerations=spec.tolerations or None)
    jobs = ["launcher", "node"] if framework == "deepspeed" else ["node"]  # MPI runtimes add a launcher pod
    return RuntimePatch(training_runtime_spec=TrainingRuntimeSpecPatch(template=JobSetTemplatePatch(
        spec=JobSetSpecPatch(replicated_jobs=[ReplicatedJobPatch(name=j, template=JobTemplatePatch(
            spec=JobSpecPatch(template=PodTemplatePatch(spec=pod)))) for j in jobs]))))


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


def _commit_output(src: Path, dst: Path | None) -> None:
    """Copy the TrainJob's output to the step's output path, whole or not at all (dst None: only check it)."""
    try:
        manifest = io.read_manifest(src)
        io.verify_files(src, manifest)
    except PrmflowError as e:
        raise TrainJobError(f"The TrainJob finished but its output at '{src}' is not complete: {e}") from None
    if dst is None:
        return
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    os.replace(tmp, dst)


def run(stage: str, config_cls: type, values: dict[str, Any], paths: dict[str, Any], spec: TrainJobSpec,
        kfp_run_id: str, iteration: int | None) -> dict:
    """Run `stage` as a TrainJob; `values` is the stage's flat config with the step's `paths` in it.
    Returns {"trainjob": name}; raises TrainJobError when the job fails or its output is incomplete."""
    from kubeflow.trainer import CustomTrainerContainer
    from kubeflow.trainer.options.kubernetes import Labels, TrainerCommand

    work = workdir_of(spec, kfp_run_id, stage, iteration)
    base = job_name(kfp_run_id, stage, iteration)
    inputs = [k for k, v in paths.items() if k != "output" and isinstance(v, str) and v and os.path.exists(v)
              and not Path(v).resolve().is_relative_to(Path(spec.workspace_path).resolve())]
    staged = _staged_paths(values, inputs, work / "in")
    # an output already on the workspace (the pipeline's heavy state) is written there by the job itself, once
    direct = Path(paths["output"]).resolve().is_relative_to(Path(spec.workspace_path).resolve())
    output = Path(paths["output"]) if direct else work / "output"
    original, values = values, {**values, **staged, "output": str(output)}
    client = client_for(spec)
    name, status = base, _existing_status(client, base)
    for attempt in range(1, 100):  # a failed job of an earlier attempt keeps its name; resubmit as -r<k>
        if status != FAILED:
            break
        name = f"{base}-r{attempt}"
        status = _existing_status(client, name)
    tags = {**(values.get("tracking.tags") or {}), "prmflow.trainjob": name}
    cfg = config_lib.build(config_cls, {**values, "tracking.tags": tags}, where=f"pipeline step '{stage}'")
    config_path = work / "config.yaml"
    if status is None:  # a new job: its inputs and config on the volume (a running one keeps what it reads)
        _stage_inputs(original, staged)
        config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config_path.with_name(f".config.yaml.tmp-{os.getpid()}")
        tmp.write_text(yaml.safe_dump({stage: config_lib.to_dict(cfg)}, sort_keys=False))
        os.replace(tmp, config_path)
        runtime = client.get_runtime(spec.runtime)
        framework = runtime.trainer.framework
        launcher = LAUNCHERS.get(framework)
        if launcher is None:
            raise TrainJobError(f"Runtime '{spec.runtime}' is a '{framework}' runtime; prmflow runs on "
                                f"{' or '.join(LAUNCHERS)} runtimes (pipeline.cluster.trainer.runtime).")
        trainer = CustomTrainerContainer(image=spec.image, num_nodes=spec.num_nodes,
                                         resources_per_node=dict(spec.resources_per_node) or None)
        command = [*launcher, "prmflow", stage, "--config", str(config_path)]
        labels = {"prmflow.io/stage": stage, "prmflow.io/kfp-run": re.sub(r"[^A-Za-z0-9_.-]", "-", kfp_run_id)[:63]}
        try:
            client.train(runtime=runtime, trainer=trainer, options=[
                _set_name(name), Labels(labels), TrainerCommand(command), _runtime_patch(spec, framework)])
        except (RuntimeError, TimeoutError, ValueError) as e:
            raise TrainJobError(f"Could not submit TrainJob '{name}' for stage {stage}: {e} ({e.__cause__})") from e
        print(f"submitted TrainJob {name} ({spec.num_nodes} nodes x {spec.resources_per_node}, runtime "
              f"{spec.runtime}): {' '.join(command)}", file=sys.stderr, flush=True)
    else:
        print(f"TrainJob {name} exists ({status}): waiting for it", file=sys.stderr, flush=True)
    try:
        job = client.wait_for_job_status(name, status={COMPLETE, FAILED}, timeout=spec.timeout_s,
                                         polling_interval=spec.poll_s, callbacks=[_reporter(name)])
    except TimeoutError as e:
        raise TrainJobError(f"TrainJob '{name}' ({stage}) did not finish within pipeline.cluster.trainer."
                            f"timeout_s = {spec.timeout_s} s; it is left running: {e}") from None
    if job.status == FAILED:
        raise TrainJobError(f"TrainJob '{name}' ({stage}) failed: {_failure_reason(client, name)}. "
                            f"Logs: kubectl logs -l jobset.sigs.k8s.io/jobset-name={name}")
    if direct:
        _commit_output(output, None)  # checked complete where it is
    else:
        _commit_output(output, Path(paths["output"]))
    return {"trainjob": name}
