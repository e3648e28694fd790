"""What the pipeline needs to know about the cluster, and the per-stage configs it passes on.

A pipeline YAML (configs/pipeline-*.yaml) has a `pipeline:` section for `PipelineConfig` (shape of
the DAG, node pools, images, secrets) and one section per stage whose keys are that stage's Config
keys (`prmflow <stage> --help`). The stage sections become the pipeline's parameters, one dict per
stage (`sft_config`, `prm_config`, ...), so a run can override any stage key at submission:
`prmflow pipeline submit --param 'ppo_config={"optim": {"lr": 1e-5}}'`, merged into the compiled section
(pipelines/params.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import stages, tasks
from ..components import config as config_lib
from ..errors import ConfigError
from .contracts import KFP_VERSIONS
from .contracts import kfp as kfp_rules

#: Image names that cannot be pulled (the reserved .invalid domain): the defaults until you build and
#: push the images (images/build.sh cpu|gpu REGISTRY/prmflow-cpu:TAG --push) and set pipeline.images.
PLACEHOLDER_REGISTRY = "registry.invalid"
DEFAULT_CPU_IMAGE = f"{PLACEHOLDER_REGISTRY}/prmflow-cpu:set-pipeline.images.cpu"
DEFAULT_GPU_IMAGE = f"{PLACEHOLDER_REGISTRY}/prmflow-gpu:set-pipeline.images.gpu"


@dataclass
class NodePool:
    node_selector: dict = field(default_factory=dict)
    """Node labels the stage's pod must match, e.g. {cloud.google.com/gke-nodepool: gpu-a100}."""
    tolerations: list[dict] = field(default_factory=list)
    """Taints the pod tolerates: [{key, operator, value, effect}]."""
    accelerator_type: str = ""
    """Accelerator resource, e.g. nvidia.com/gpu. Empty: no accelerator (CPU pool)."""
    accelerator_count: int = 0
    """Accelerators per pod."""
    cpu: str = ""
    """CPU limit, e.g. '8'. Empty: the cluster default."""
    memory: str = ""
    """Memory limit, e.g. '64G'. Empty: the cluster default."""


def _gpu_pool() -> NodePool:
    return NodePool(node_selector={"prmflow.io/pool": "gpu"},
                    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    accelerator_type="nvidia.com/gpu", accelerator_count=1, cpu="8", memory="64G")


def _cpu_pool() -> NodePool:
    return NodePool(node_selector={"prmflow.io/pool": "cpu"}, cpu="4", memory="16G")


#: The env vars each secret provides to a stage (optional keys), by reference only.
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
OBJECT_STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL")
#: Training stages that can run as a Kubeflow Trainer TrainJob instead of in the step's own pod.
TRAINJOB_STAGES = ("sft", "prm", "ppo")
PLACEMENTS = ("pod", "trainjob")
#: Kubeflow Trainer's MPI-based runtimes (manifests/base/runtimes): Trainer sets the image and command on
#: their launcher only, so the workers would run the runtime's image without prmflow.
MPI_RUNTIMES = ("deepspeed-distributed", "mlx-distributed")


@dataclass
class TrainerConfig:
    """Where each training stage runs: `pod` (the step's own pod, its ranks on that pod's GPUs) or
    `trainjob` (the step submits a Kubeflow Trainer TrainJob of num_nodes pods and waits for it)."""

    sft: str = "pod"
    """sft: pod (one pod of the GPU pool) or trainjob (num_nodes pods through Kubeflow Trainer)."""
    prm: str = "pod"
    """prm: pod or trainjob."""
    ppo: str = "pod"
    """ppo (policy + critic update): pod or trainjob."""
    num_nodes: int = 2
    """Pods (nodes) of a TrainJob; each gets the GPU pool's accelerators, node selector and tolerations."""
    runtime: str = "torch-distributed"
    """Kubeflow Trainer runtime of torch framework: torch-distributed (torchrun on every node, DeepSpeed inside each
    rank). MPI runtimes are refused."""
    namespace: str = ""
    """Namespace of the TrainJobs. Empty: the pipeline step's own namespace."""
    timeout_s: int = 259200
    """Longest wait for a TrainJob to finish (default 3 days), also its activeDeadlineSeconds; after it the step deletes
    the job and fails."""
    poll_s: int = 30
    """Seconds between two status reads of a running TrainJob."""
    disable_istio_sidecar: bool = True
    """Label the TrainJob's pods sidecar.istio.io/inject=false: an Istio sidecar (Kubeflow profile namespaces) breaks
    the torch rendezvous (kubeflow/trainer#2794)."""
    system_namespace: str = "kubeflow-system"
    """Namespace of the Trainer control plane, whose ConfigMap kubeflow-trainer-public states its version (checked: >= 2.2.0)."""

    def __post_init__(self):
        for stage in TRAINJOB_STAGES:
            if getattr(self, stage) not in PLACEMENTS:
                raise ConfigError(f"pipeline.cluster.trainer.{stage} is {getattr(self, stage)!r}; "
                                  f"use one of {', '.join(PLACEMENTS)}.")
        if self.num_nodes < 1:
            raise ConfigError(f"pipeline.cluster.trainer.num_nodes is {self.num_nodes}; it must be at least 1.")
        if self.runtime in MPI_RUNTIMES:
            raise ConfigError(f"pipeline.cluster.trainer.runtime is {self.runtime!r}, an MPI runtime: Kubeflow Trainer "
                              "sets the image and command on its launcher only, so the workers would run without "
                              "prmflow. Use runtime: torch-distributed (DeepSpeed runs inside each torchrun rank).")
        if not 0 < self.poll_s < self.timeout_s:
            raise ConfigError(f"pipeline.cluster.trainer.poll_s ({self.poll_s}) must be positive and below timeout_s "
                              f"({self.timeout_s}).")

    def stages(self) -> list[str]:
        """The training stages set to run as TrainJobs."""
        return [s for s in TRAINJOB_STAGES if getattr(self, s) == "trainjob"]


#: The oldest backends this pipeline's spec works on: Kubeflow Pipelines 2.15 (fan-in of
#: dsl.Collected artifact lists #11725, exit-handler task status #11953, retries inside the exit
#: handler #11908, optional secret env vars #12216, the pipeline workspace) and Kubeflow Trainer 2.2
#: (runtimePatches, which the TrainJob steps send).
MIN_KFP_BACKEND = (2, 15)
MIN_TRAINER = (2, 2)
#: URI schemes the KFP backend's importer accepts (backend/src/v2/component/importer_launcher.go).
IMPORTER_SCHEMES = ("s3://", "gs://", "minio://", "oci://")
#: Where KFP mounts its per-run pipeline workspace (kfp.dsl.constants.WORKSPACE_MOUNT_PATH).
KFP_WORKSPACE_MOUNT = "/kfp-workspace"
#: workspace_storage_class value that leaves the class to the KFP API server's default claim template.
SERVER_DEFAULT_CLASS = "server-default"


@dataclass
class GpuShapes:
    """GPUs of each GPU task's pod, so a task holds only the accelerators it uses. 0 = the GPU pool's
    accelerator_count. CPU and memory of a pod scale with its share of the pool's accelerators."""

    sft: int = 0
    """GPUs of the sft pod (its DeepSpeed ranks); 0 = gpu_pool.accelerator_count."""
    prm: int = 0
    """GPUs of the prm pod; 0 = gpu_pool.accelerator_count."""
    ppo: int = 0
    """GPUs of the ppo pod; 0 = gpu_pool.accelerator_count."""
    rollout_engines: int = 1
    """Sampling engines per rollout pod; the pod gets rollout.vllm.tensor_parallel_size x this many GPUs."""
    evaluate: int = 1
    """GPUs of the evaluate pod (HF generation of one model at a time uses one)."""
    prm_update: int = 1
    """GPUs of each prm-update pod (pipeline.prm_update): one process, so one GPU."""


@dataclass
class ImagesConfig:
    """The images every step (and TrainJob node) runs; compiled into the pipeline spec."""

    cpu: str = DEFAULT_CPU_IMAGE
    """Image of CPU steps (advantage, tracking, TrainJob submitters): REGISTRY/prmflow-cpu@sha256:... as images/build.sh
    cpu ... --push prints it."""
    gpu: str = DEFAULT_GPU_IMAGE
    """Image of GPU steps and TrainJob nodes (sft, prm, prm-update, rollout, ppo, evaluate): REGISTRY/prmflow-gpu@sha256:..."""
    pull_secrets: list[str] = field(default_factory=list)
    """Kubernetes secrets (type dockerconfigjson, in the run's namespace) to pull the images from a private registry."""

    def placeholders(self) -> list[str]:
        """The `pipeline.images` keys still at their unpullable defaults."""
        return [k for k in ("cpu", "gpu") if getattr(self, k).startswith(PLACEHOLDER_REGISTRY + "/")]


def quantity_bytes(text: str) -> float:
    """A Kubernetes quantity ('200Gi', '1.5G', '500Mi') as a number, by the Kubernetes client's own parser; 0.0
    for text that is not one (the API server would refuse it in a pod or volume spec)."""
    from kubernetes.utils import parse_quantity

    try:
        return float(parse_quantity(str(text).strip()))
    except (ValueError, TypeError, ArithmeticError):
        return 0.0


@dataclass
class ClusterConfig:
    gpu_pool: NodePool = field(default_factory=_gpu_pool)
    """Where sft, prm, prm-update, rollout, ppo and evaluate run."""
    cpu_pool: NodePool = field(default_factory=_cpu_pool)
    """Where advantage runs (no model in memory)."""
    retries: int = 2
    """Retries of a failed GPU stage (preemption); stages resume from their checkpoint. On a cluster only: run-local
    does not retry."""
    backoff: str = "120s"
    """Wait before the first retry; doubles each time."""
    cache: bool = True
    """Let KFP reuse results of deterministic stages (fixed seed, same inputs)."""
    cache_sampling: bool = False
    """Also cache rollout/evaluate, whose sampling is only repeatable with a fixed seed."""
    workspace_pvc: str = ""
    """ReadWriteMany PVC mounted at workspace_path on every step: weights, optimizer moments and resume checkpoints live
    there (under prmflow/PIPELINE NAME/), written once; it outlives a run, so a re-submitted run resumes from it. Empty:
    KFP's per-run pipeline workspace of workspace_size."""
    workspace_path: str = "/workspace"
    """Mount path of workspace_pvc."""
    workspace_size: str = "200Gi"
    """Size of KFP's per-run pipeline workspace (KFP >= 2.15), used when workspace_pvc is empty. It is deleted with the
    run, and its per-run name is in the cache key of each step that mounts it (those opening weights), so only
    workspace_pvc lets a failed run resume."""
    workspace_storage_class: str = ""
    """Storage class of the per-run workspace (ReadWriteMany; `kubectl get storageclass`). Empty: the cluster's default,
    which only KFP >= 2.17 accepts (see kfp_version); server-default: the claim template's class in the KFP API server's
    config (workspace.volumeclaimtemplatespec)."""
    kfp_version: str = "2.15"
    """Kubeflow Pipelines version of the target backend (2.15, 2.16 or 2.17): compile, plan and submit --dry-run refuse
    what its driver and compiler would refuse (submit and upload check against the version the server states). Default:
    the oldest supported, so the spec runs on all of them."""
    gpus: GpuShapes = field(default_factory=GpuShapes)
    """GPUs per task (rollout = tensor parallel size x engines per pod); the GPU pool gives node selector and tolerations."""
    shm_size: str = "16Gi"
    """Memory-backed /dev/shm on every GPU pod (NCCL and vLLM tensor parallel workers need more than the container
    default 64 MiB); counts against the pod's memory."""
    scratch_size: str = ""
    """Size limit of the local /scratch emptyDir (TMPDIR, caches) of GPU pods; empty: one model's bf16 weights + 20Gi
    (model_params)."""
    model_params: float = 0.0
    """Parameters of the policy (e.g. 7.62e9), for scratch sizing and `pipeline plan`; 0 = read from the policy's
    config.json when it is readable here."""
    mlflow_secret: str = ""
    """Kubernetes secret with MLFLOW_TRACKING_URI / MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD keys. KFP 2.17's
    MLflow integration may set the same variables: then name the server in tracking_uri (docs/mlflow.md)."""
    object_store_secret: str = ""
    """Kubernetes secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / MLFLOW_S3_ENDPOINT_URL keys."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Multi-node training: which of sft/prm/ppo run as Kubeflow Trainer TrainJobs, on how many nodes."""
    service_account: str = ""
    """Kubernetes service account of the run's pods (submit --service-account overrides) and of TrainJob nodes (compiled
    in). Empty: KFP's default (pipeline-runner; default-editor in a profile namespace)."""

    def secret_env(self) -> dict[str, list[str]]:
        """{secret name: env var keys} of the configured secrets."""
        out = {}
        if self.mlflow_secret:
            out[self.mlflow_secret] = list(MLFLOW_SECRET_KEYS)
        if self.object_store_secret:
            out.setdefault(self.object_store_secret, []).extend(OBJECT_STORE_SECRET_KEYS)
        return out

    def workspace_root(self, pipeline_name: str) -> str:
        """Where the steps keep heavy state: on workspace_pvc, or in KFP's per-run workspace."""
        if self.workspace_pvc:
            return f"{self.workspace_path.rstrip('/')}/prmflow/{pipeline_name}"
        return "{{$.workspace_path}}/prmflow"

    def __post_init__(self):
        for stage in ("sft", "prm", "ppo", "rollout_engines", "prm_update"):
            least = 1 if stage in ("rollout_engines", "prm_update") else 0
            if getattr(self.gpus, stage) < least:
                raise ConfigError(f"pipeline.cluster.gpus.{stage} is {getattr(self.gpus, stage)}; it must be "
                                  f"{'at least 1' if least else '0 (the pool size) or more'}.")
        # the driver refuses a pod whose own mount path starts with /kfp-workspace once it mounts the workspace,
        # and a parameter naming such a path makes it mount it (contracts/kfp.py)
        if self.workspace_pvc and kfp_rules.volume_mount_conflicts([self.workspace_path]):
            raise ConfigError(f"pipeline.cluster.workspace_path is {self.workspace_path}, under {KFP_WORKSPACE_MOUNT} "
                              f"where KFP mounts its own per-run workspace (KFP's driver refuses such a mount); mount "
                              f"workspace_pvc elsewhere (e.g. /workspace).")

        try:
            kfp_rules.family(self.kfp_version)
        except ValueError:
            raise ConfigError(f"pipeline.cluster.kfp_version is {self.kfp_version!r}; use one of "
                              f"{', '.join(KFP_VERSIONS)} (the Kubeflow Pipelines version of your cluster).") from None
        for key in ("workspace_size", "shm_size", "scratch_size"):  # empty scratch_size: sized from model_params
            value = getattr(self, key)
            if (value or key != "scratch_size") and quantity_bytes(value) <= 0:
                raise ConfigError(f"pipeline.cluster.{key} is {value!r}, not a positive size as Kubernetes writes one; "
                                  f"give e.g. 200Gi, 500Mi or 1Ti (a pod or volume with it would be refused).")
        from kfp import dsl

        try:  # KFP's compiler reads the workspace size by a stricter rule than Kubernetes ('100m', '1e3' fail)
            dsl.WorkspaceConfig(size=self.workspace_size)
        except ValueError as e:
            raise ConfigError(f"pipeline.cluster.workspace_size: {e}") from None
        if self.trainer.stages() and not self.workspace_pvc:
            raise ConfigError(f"pipeline.cluster.trainer runs {', '.join(self.trainer.stages())} as TrainJobs, whose "
                              "pods read their inputs and write their output on a shared volume: set "
                              "pipeline.cluster.workspace_pvc to a ReadWriteMany PVC.")


#: The stages `pipeline.task_seconds` times (a rollout's is one shard's).
TIMED_STAGES = ("sft", "prm", "rollout", "advantage", "ppo", "prm-update", "evaluate")


@dataclass
class PipelineConfig:
    name: str = "prmflow"
    """Pipeline name in KFP."""
    iterations: int = 2
    """RL iterations (rollout -> advantage -> ppo). More than one KFP run holds become a chain of runs
    (run_iterations each), each starting from the last one's state on the workspace (docs/cluster.md)."""
    run_iterations: int = 0
    """Iterations of one run of the chain. 0: as many as one run holds on every KFP version from
    cluster.kfp_version up (pipeline plan prints it); run-local chains the same way."""
    rollout_shards: int = 2
    """Rollout pods per iteration (ParallelFor); each samples the prompts with index % shards == its shard."""
    tracking_uri: str = ""
    """MLflow tracking URI of the stages (not a secret). Empty: from mlflow_secret, else the embedded store."""
    experiment: str = "prmflow"
    """MLflow experiment."""
    run_name: str = ""
    """MLflow name of the pipeline's parent run (default: pipeline-<KFP run id>)."""
    sft_model: str = ""
    """Start from this SFT policy instead of running the sft stage: an HF model directory or object-store URI (imported
    with dsl.importer). Reuses one warm-up across runs that compare RL settings."""
    prm_model: str = ""
    """Use this trained PRM instead of running the prm stage (directory or URI, imported like sft_model)."""
    prm_update: bool = False
    """Keep the PRM on-policy: after rollout k a prm-update-k task (GPU pool) trains it on those rollouts' outcomes
    (section prm-update:); rollout k+1 and evaluate read it. Needs a trained PRM and an advantage that reads step
    rewards. docs/process-rewards.md#4-the-prm-follows-the-policy-prmflow-prm-update"""
    schedule: Literal["serial", "off_by_one"] = "serial"
    """serial: rollout k samples with policy k. off_by_one: rollout k+1 samples with policy k while ppo k trains (one
    iteration stale, needs ppo.rollout_correction and ppo.recompute_old_logprobs: true). docs/cluster.md#overlapped-schedule"""
    task_seconds: dict = field(default_factory=dict)
    """Estimated seconds of one task per stage ({sft, prm, rollout (one shard), advantage, ppo, prm-update, evaluate}:
    s), for `pipeline plan`'s critical path; `plan --durations-from RUN_ID` measures them instead."""
    images: ImagesConfig = field(default_factory=ImagesConfig)
    """The CPU and GPU images and their pull secrets (placeholders until set: compile refuses them)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Node pools, retries, caching, secrets, TrainJobs."""

    def __post_init__(self):
        if self.iterations < 1:
            raise ConfigError(f"pipeline.iterations is {self.iterations}; it must be at least 1.")
        if self.run_iterations < 0:
            raise ConfigError(f"pipeline.run_iterations is {self.run_iterations}; give 0 (as many as one run "
                              f"holds) or a positive number of iterations per run.")
        if self.rollout_shards < 1:
            raise ConfigError(f"pipeline.rollout_shards is {self.rollout_shards}; it must be at least 1.")
        for stage, value in self.task_seconds.items():
            if stage not in TIMED_STAGES or isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"pipeline.task_seconds: {stage}: {value!r}; give seconds (a number >= 0) for any of "
                                  f"{', '.join(TIMED_STAGES)}.")


@dataclass
class PipelineSpec:
    """A pipeline config plus the per-stage config dicts (validated against each stage's Config)."""

    pipeline: PipelineConfig
    stages: dict[str, dict[str, Any]]


def load_spec(path: str | Path | None, overrides: dict[str, Any] | None = None,
              data: dict[str, Any] | None = None) -> PipelineSpec:
    """Read a pipeline YAML (or take its parsed `data`, `path` then only names it in errors); every
    stage section is checked against its stage's Config now, at compile time, so a typo fails before
    anything is submitted."""
    if data is None and path:
        data = config_lib.read_yaml(path, "Pipeline config")
    data = data or {}
    sections = stages.PIPELINE_STAGES
    unknown = set(data) - {"pipeline", *sections}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; known: pipeline, {', '.join(sections)}.")
    for name, section in data.items():  # `sft: 3` or `ppo: [..]` (an indentation slip): not a section's keys
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{path}: section '{name}' must be a mapping of its keys (e.g. {name}: {{key: value}}), "
                              f"not {section!r}.")
    pipe = config_lib.build(PipelineConfig, config_lib.flatten(data.get("pipeline") or {}), where=f"{path} [pipeline]")
    if overrides:
        pipe = config_lib.build(PipelineConfig, {**config_lib.flatten(config_lib.to_dict(pipe)), **overrides}, "command line")
    available = stages.available()
    stage_configs: dict[str, dict[str, Any]] = {}
    prefixes: dict[str, str] = {}  # stage -> the arithmetic prompt prefix it trains or tests on
    trained_on: list[str] = []  # the datasets the policy trains on: evaluate refuses their prompts (train_tasks)
    for name in sections:
        section = data.get(name) or {}
        if name == "evaluate" and name in available and "train_tasks" not in section and trained_on:
            section = {**section, "train_tasks": list(trained_on)}
        if name in available:
            section = {**stage_fills(name, section, pipe.iterations), **section}
            built = config_lib.build(available[name].Config, config_lib.flatten(section), where=f"{path} [{name}]")
            policy_data = [built.task] if name in ("sft", "rollout") else [built.ptx_task] if (
                name == "ppo" and built.ptx_coef > 0) else []  # ppo's SFT (ptx) loss trains on ptx_task
            trained_on += [t for t in policy_data if t not in trained_on and t not in tasks.TASKS]
            if name == "ppo" and built.optim.lr_schedule != "constant" and built.rl_iterations < pipe.iterations:
                raise ConfigError(f"{path} [ppo]: rl_iterations is {built.rl_iterations}, so the LR schedule "
                                  f"({built.optim.lr_schedule}) ends before pipeline.iterations ({pipe.iterations}) "
                                  f"and ppo would refuse iteration {built.rl_iterations} at run time. Leave "
                                  f"ppo.rl_iterations out (the pipeline sets it to pipeline.iterations), raise it, or "
                                  f"set ppo.optim.lr_schedule: constant.")
            if hasattr(built, "arithmetic") and (getattr(built, "task", None) == "arithmetic" or (
                    getattr(built, "ptx_coef", 0) > 0 and built.ptx_task == "arithmetic")):  # ppo's SFT (ptx) loss
                prefixes[name] = built.arithmetic.prompt_prefix
        stage_configs[name] = section
    if len(set(prefixes.values())) > 1:  # the policy would be trained on one prompt and tested on another
        seen = ", ".join(f"[{k}] {v!r}" for k, v in prefixes.items())
        raise ConfigError(f"{path}: arithmetic.prompt_prefix differs between stages ({seen}); set the same value "
                          f"in every section that uses the arithmetic task.")
    return PipelineSpec(pipe, stage_configs)


def stage_fills(stage: str, section: dict, iterations: int) -> dict[str, Any]:
    """Keys a stage's section leaves out that the pipeline fills in: ppo's LR schedule spans the whole run
    (rl_iterations = pipeline.iterations). The stage commands fill them too when their --config is a pipeline config."""
    return {"rl_iterations": iterations} if stage == "ppo" and "rl_iterations" not in section else {}


def pipeline_fills(stage: str, path: str | Path) -> dict[str, Any]:
    """stage_fills for a stage command whose --config is a pipeline config (it has a `pipeline:` section)."""
    data = config_lib.read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("pipeline"), dict):
        return {}
    iterations = data["pipeline"].get("iterations", PipelineConfig.iterations)
    return stage_fills(stage, config_lib.flatten(data.get(stage) or {}), iterations)


def safe_loader() -> type:
    """PyYAML's safe loader in C (libyaml) where PyYAML was built with it, else its pure-Python SafeLoader:
    the same documents either way (only the parser differs; both construct with SafeConstructor), and a
    compiled pipeline (~10,000 YAML nodes) reads about 4x faster."""
    import yaml

    return yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


def resolved(spec: PipelineSpec, stage: str):
    """The stage's Config built from its section (defaults filled in), or None without the stage."""
    available = stages.available()
    if stage not in available:
        return None
    return config_lib.build(available[stage].Config, config_lib.flatten(dict(spec.stages.get(stage) or {})),
                            where=f"[{stage}]")
