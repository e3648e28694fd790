"""What the pipeline needs to know about the cluster, and the per-stage configs it passes on.

A pipeline YAML (configs/pipeline-*.yaml) has a `pipeline:` section for `PipelineConfig` (shape of
the DAG, node pools, images, secrets) and one section per stage whose keys are that stage's Config
keys (`prmflow <stage> --help`). The stage sections become the pipeline's parameters, one dict per
stage (`sft_config`, `prm_config`, ...), so a run can override any stage key at submission:
`prmflow pipeline submit --param 'ppo_config={"optim": {"lr": 1e-5}}'`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import stages
from ..components.common import config as config_lib
from ..components.common.errors import ConfigError

#: The project's own images. The tags are what images/build.sh pushes; pin them by digest in the
#: pipeline YAML (cluster.cpu_image / cluster.gpu_image) or $PRMFLOW_CPU_IMAGE / $PRMFLOW_GPU_IMAGE.
DEFAULT_CPU_IMAGE = os.environ.get("PRMFLOW_CPU_IMAGE", "ghcr.io/prmflow/prmflow-cpu:0.1.0")
DEFAULT_GPU_IMAGE = os.environ.get("PRMFLOW_GPU_IMAGE", "ghcr.io/prmflow/prmflow-gpu:0.1.0")


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


@dataclass
class ClusterConfig:
    cpu_image: str = DEFAULT_CPU_IMAGE
    """Image of CPU stages (advantage, tracking steps)."""
    gpu_image: str = DEFAULT_GPU_IMAGE
    """Image of GPU stages (sft, prm, rollout, ppo, evaluate)."""
    gpu_pool: NodePool = field(default_factory=_gpu_pool)
    """Where sft, prm, rollout, ppo and evaluate run."""
    cpu_pool: NodePool = field(default_factory=_cpu_pool)
    """Where advantage runs (no model in memory)."""
    retries: int = 2
    """Retries of a failed GPU stage (preemption); stages resume from their checkpoint."""
    backoff: str = "120s"
    """Wait before the first retry; doubles each time."""
    cache: bool = True
    """Let KFP reuse results of deterministic stages (fixed seed, same inputs)."""
    cache_sampling: bool = False
    """Also cache rollout/evaluate, whose sampling is only repeatable with a fixed seed."""
    workspace_pvc: str = ""
    """PVC mounted at workspace_path on every stage, for large checkpoints (empty: artifact store only)."""
    workspace_path: str = "/workspace"
    """Mount path of workspace_pvc."""
    mlflow_secret: str = ""
    """Kubernetes secret with MLFLOW_TRACKING_URI / MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD keys."""
    object_store_secret: str = ""
    """Kubernetes secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / MLFLOW_S3_ENDPOINT_URL keys."""


@dataclass
class PipelineConfig:
    name: str = "prmflow"
    """Pipeline name in KFP."""
    iterations: int = 2
    """RL iterations (rollout -> advantage -> ppo), unrolled at compile time."""
    rollout_shards: int = 2
    """Rollout pods per iteration (ParallelFor); each samples the prompts with index % shards == its shard."""
    tracking_uri: str = ""
    """MLflow tracking URI of the stages (not a secret). Empty: from mlflow_secret, else the embedded store."""
    experiment: str = "prmflow"
    """MLflow experiment."""
    run_name: str = ""
    """MLflow name of the pipeline's parent run (default: pipeline-<KFP run id>)."""
    sft_model: str = ""
    """Start from this SFT policy instead of running the sft stage: an HF model directory or object-store URI (imported with dsl.importer). Reuses one warm-up across runs that compare RL settings."""
    prm_model: str = ""
    """Use this trained PRM instead of running the prm stage (directory or URI, imported like sft_model)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Node pools, images, retries, caching, secrets."""

    def __post_init__(self):
        if self.iterations < 1:
            raise ConfigError(f"pipeline.iterations is {self.iterations}; it must be at least 1.")
        if self.rollout_shards < 1:
            raise ConfigError(f"pipeline.rollout_shards is {self.rollout_shards}; it must be at least 1.")


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
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Pipeline config '{p}' does not exist.")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"Pipeline config '{p}' must hold a mapping with a 'pipeline' section and stage sections.")
    data = data or {}
    sections = stages.PIPELINE_STAGES
    unknown = set(data) - {"pipeline", *sections}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; known: pipeline, {', '.join(sections)}.")
    pipe = config_lib.build(PipelineConfig, config_lib.flatten(data.get("pipeline") or {}), where=f"{path} [pipeline]")
    if overrides:
        pipe = config_lib.build(PipelineConfig, {**config_lib.flatten(config_lib.to_dict(pipe)), **overrides}, "command line")
    available = stages.available()
    stage_configs: dict[str, dict[str, Any]] = {}
    for name in sections:
        section = data.get(name) or {}
        if name in available:
            config_lib.build(available[name].Config, config_lib.flatten(section), where=f"{path} [{name}]")
            # old key names (warned about just now) become the new ones in the pipeline's parameters
            section = config_lib.upgrade_stored(available[name].Config, section, fill=False)
        stage_configs[name] = section
    return PipelineSpec(pipe, stage_configs)
