"""`prmflow pipeline plan --config FILE`: what a cluster run will hold and move, before a GPU is spent.

    prmflow pipeline plan --config configs/cluster/qwen2.5-7b-gsm8k-math.yaml [--model-params 7.62e9] [--set KEY=VALUE]

The plan compiles the pipeline and walks the compiled spec with a model of the KFP launcher: every
input artifact of a task is downloaded whole from the object store before the task starts
(kubeflow/pipelines backend/src/v2/component/launcher_v2.go, downloadArtifacts; a Collected list
downloads every element). What an artifact weighs follows from what produced it (`artifact_bytes`):
weights and optimizer moments stay on the workspace, so a Model artifact of sft/prm/prm-update/ppo is a location
of a few KB, while an imported model is its whole size. What a task opens on the workspace follows
from the input names it was wired with. Sizes: weights = bytes per parameter (bf16: 2) x P; Adam
state in fp32 (master copy + two moments, 12 bytes per parameter with DeepSpeed; 8 with torch);
rollouts as an upper bound, every response at max_new_tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .settings import MIN_KFP_BACKEND, MIN_TRAINER, PipelineSpec, quantity_bytes, safe_loader

#: Bytes of a location artifact (location.json: where, fingerprint, a sha256 and a size per file).
LOCATION_BYTES = 16 * 1024
KL_STATE_BYTES = 512
#: Rollout columns per response token: ids (4 B) and five float32 lists (behavior, old, ref logprobs,
#: values, step scores spread), as an upper bound of the Parquet size.
ROLLOUT_BYTES_PER_TOKEN = 24
#: Advantages add token_rewards, advantages, returns and kl (4 x float32) per token.
ADVANTAGE_EXTRA_PER_TOKEN = 16
GB = 1e9


@dataclass
class Sizes:
    """What one model's state weighs, and the per-shard rollout hand-off."""

    weights: float
    optimizer: float
    rollouts_per_shard: float
    advantages: float
    critic: bool
    save_optimizer: bool
    rollouts: float = 0.0
    """All shards of one iteration's rollouts (prm-update keeps a copy of them on the workspace)."""


@dataclass
class TaskRow:
    stage: str
    name: str
    pods: int
    gpus: int = 0
    cpu: str = ""
    memory: str = ""
    object_store_read: float = 0.0
    workspace_read: float = 0.0
    workspace_written: float = 0.0
    inputs: dict = field(default_factory=dict)


def stage_of(component: str) -> str:
    """comp-rollout-12 -> rollout; comp-importer-2 -> importer."""
    return re.sub(r"^comp-|-\d+$", "", component)


def artifact_bytes(stage: str, key: str, s: Sizes, legacy: bool = False) -> float:
    """Bytes of output `key` of a `stage` task, as the launcher would download it. legacy: the layout
    before the workspace (every Model artifact held its files; ppo's held policy, critic and optimizer)."""
    if stage == "importer":
        return s.weights
    if stage == "rollout":
        return s.rollouts_per_shard
    if stage == "advantage":
        return s.advantages
    if stage == "ppo" and key == "kl_state":
        return KL_STATE_BYTES
    if stage in ("sft", "prm", "prm-update", "ppo", "locate"):
        if not legacy:
            return LOCATION_BYTES
        if stage == "ppo":
            models = 2 if s.critic else 1
            return models * s.weights + (models * s.optimizer if s.save_optimizer else 0)
        return s.weights
    return 1e6  # evaluate results, metrics


def opened_on_workspace(stage: str, inputs: dict, s: Sizes) -> float:
    """Bytes a task reads in place from the workspace, by the names of its located inputs."""
    total = 0.0
    for name in inputs:
        if name in ("policy", "ref", "prm_model", "critic", "base", "baseline"):
            total += s.weights
        elif stage == "prm-update" and name in ("rollouts", "previous"):
            total += s.rollouts  # its workspace copy of this iteration's rollouts; the last one's (update k replays k)
        elif name == "previous":  # ppo: the critic and Adam's moments of the last iteration
            models = 2 if s.critic else 1
            total += (s.weights if s.critic else 0) + (models * s.optimizer if s.save_optimizer else 0)
    return total


def written_to_workspace(stage: str, s: Sizes) -> float:
    if stage in ("sft", "prm"):
        return s.weights
    if stage == "prm-update":  # the updated PRM and the copy of the rollouts the next update replays
        return s.weights + s.rollouts
    if stage == "ppo":
        models = 2 if s.critic else 1
        return models * s.weights + (models * s.optimizer if s.save_optimizer else 0)
    return 0.0


def walk(ir: dict, sizes: Sizes, legacy: bool = False) -> list[TaskRow]:
    """Every executor task of the compiled spec with the artifacts it downloads (the launcher's rule)."""
    comps, execs = ir["components"], ir["deploymentSpec"]["executors"]
    rows: list[TaskRow] = []

    def dag_outputs(comp: str, key: str, loops: int) -> list[tuple[str, str, int]]:
        sel = comps[comp]["dag"]["outputs"]["artifacts"][key]["artifactSelectors"]
        out = []
        for s in sel:
            sub = comps[comp]["dag"]["tasks"][s["producerSubtask"]]["componentRef"]["name"]
            out.append((stage_of(sub), s["outputArtifactKey"], loops))
        return out

    def visit(comp: str, mult: int, env: dict):
        tasks = comps[comp]["dag"]["tasks"]
        loops = {n: (len(json.loads(t["parameterIterator"]["items"]["raw"])) if "parameterIterator" in t else 1)
                 for n, t in tasks.items()}
        for name, t in tasks.items():
            ref = t["componentRef"]["name"]
            inputs = {}
            for iname, spec in (t.get("inputs") or {}).get("artifacts", {}).items():
                if "componentInputArtifact" in spec:
                    inputs[iname] = env[spec["componentInputArtifact"]]
                else:
                    p = spec["taskOutputArtifact"]["producerTask"]
                    pref = tasks[p]["componentRef"]["name"]
                    key = spec["taskOutputArtifact"]["outputArtifactKey"]
                    inputs[iname] = (dag_outputs(pref, key, loops[p]) if "dag" in comps[pref]
                                     else [(stage_of(pref), key, 1)])
            if "dag" in comps[ref]:
                visit(ref, mult * loops[name], inputs)
                continue
            stage = stage_of(ref)
            ex = execs.get(comps[ref].get("executorLabel", ""), {})
            res = ex.get("container", {}).get("resources", {})
            row = TaskRow(stage, t["taskInfo"]["name"], mult, int(res.get("accelerator", {}).get("resourceCount", 0) or 0),
                          res.get("resourceCpuLimit", ""), res.get("resourceMemoryLimit", ""), inputs=inputs)
            row.object_store_read = sum(n * artifact_bytes(st, k, sizes, legacy)
                                        for srcs in inputs.values() for st, k, n in srcs)
            row.workspace_read = 0.0 if legacy else opened_on_workspace(stage, inputs, sizes)
            row.workspace_written = 0.0 if legacy else written_to_workspace(stage, sizes)
            rows.append(row)

    visit_root = ir["root"]
    comps["__root__"] = visit_root
    visit("__root__", 1, {})
    del comps["__root__"]
    return rows


def sizes_of(spec: PipelineSpec, params: float) -> Sizes:
    from .settings import resolved

    ppo, roll = resolved(spec, "ppo"), resolved(spec, "rollout")
    dtype_bytes = 2 if ppo.engine.dtype in ("bfloat16", "float16") else 4
    adam = 12 if ppo.engine.backend == "deepspeed" else 8
    responses = roll.num_prompts * roll.n_samples
    tokens = responses * (roll.sampling.max_new_tokens + (roll.max_prompt_len or 256))
    shards = spec.pipeline.rollout_shards
    rollouts = tokens * ROLLOUT_BYTES_PER_TOKEN
    return Sizes(weights=dtype_bytes * params, optimizer=adam * params, rollouts_per_shard=rollouts / shards,
                 advantages=rollouts + tokens * ADVANTAGE_EXTRA_PER_TOKEN, critic=ppo.train_critic,
                 save_optimizer=ppo.save_optimizer, rollouts=rollouts)


def compiled(spec: PipelineSpec) -> dict:
    from .pipeline import compile_to

    with tempfile.TemporaryDirectory() as tmp:
        path = compile_to(spec, str(Path(tmp) / "pipeline.yaml"), check_size=False)  # printed by render
        return next(yaml.load_all(Path(path).read_text(), Loader=safe_loader()))


def per_iteration(rows: list[TaskRow]) -> list[TaskRow]:
    """The tasks of one steady-state RL iteration (k = 1 where there is one: iteration 0 carries no
    critic or optimizer over): its rollout shards, advantage, ppo and prm-update (pipeline.prm_update)."""
    k = 1 if any(r.name == "ppo-1" or r.name.startswith("ppo-1 ") for r in rows) else 0
    return [r for r in rows if r.name in (f"rollout-{k}", f"advantage-{k}", f"ppo-{k}", f"ppo-{k} (trainjob)",
                                          f"prm-update-{k}")]


def storage(spec: PipelineSpec, s: Sizes) -> float:
    """Workspace bytes a whole run leaves: sft and prm weights, and every iteration's ppo output (and
    prm-update output: a PRM and a copy of the rollouts)."""
    pipe = spec.pipeline
    return (0 if pipe.sft_model else s.weights) + (0 if pipe.prm_model else s.weights) + \
        pipe.iterations * (written_to_workspace("ppo", s) + (written_to_workspace("prm-update", s) if pipe.prm_update else 0))


def parse_quantity(q: str) -> float:
    """'200Gi' -> bytes; 0.0 for anything that is not a Kubernetes quantity (settings.quantity_bytes)."""
    return quantity_bytes(q or "")


def warnings_of(spec: PipelineSpec, s: Sizes, rows: list[TaskRow], volume_bytes: float = 0.0) -> list[str]:
    from .pipeline import gpu_counts

    out = []
    cluster = spec.pipeline.cluster
    pool = cluster.gpu_pool.accelerator_count
    counts = gpu_counts(spec)
    for stage in ("rollout", "evaluate", "prm", "sft", "ppo"):
        if stage in cluster.trainer.stages() or not pool:
            continue
        if counts[stage] < pool:
            continue
        if stage == "evaluate" and counts[stage] > 1:
            out.append(f"evaluate holds {counts[stage]} GPUs and generates with one (cluster.gpus.evaluate).")
    need = storage(spec, s)
    size = volume_bytes or (0.0 if cluster.workspace_pvc else parse_quantity(cluster.workspace_size))
    if size and need > size:
        out.append(f"the workspace needs {need / GB:.0f} GB for this run and is {size / GB:.0f} GB: raise "
                   f"{'workspace_size' if not cluster.workspace_pvc else 'the PVC'} or turn off ppo.save_optimizer.")
    if cluster.workspace_pvc:
        out.append(f"workspace_pvc '{cluster.workspace_pvc}' must be ReadWriteMany (the rollout shards, ppo and evaluate "
                   f"pods mount it at once): kubectl get pvc {cluster.workspace_pvc} -o jsonpath='{{.spec.accessModes}}'")
    else:
        out.append("KFP's per-run workspace dies with the run and is in every cache key: a failed run cannot resume; "
                   "set cluster.workspace_pvc to a ReadWriteMany PVC for that.")
    for r in rows:
        if r.stage == "importer":
            out.append(f"'{r.name}' imports a model through the object store: every reader downloads all of it; "
                       f"put it on workspace_pvc instead.")
            break
    return out


def render(spec: PipelineSpec, params: float, volume_bytes: float = 0.0) -> str:
    s = sizes_of(spec, params)
    rows = walk(compiled(spec), s)
    lines = [f"plan of '{spec.pipeline.name}': {spec.pipeline.iterations} RL iterations x {spec.pipeline.rollout_shards} "
             f"rollout shards; P = {params:.3g} parameters, weights {s.weights / GB:.1f} GB, "
             f"optimizer {s.optimizer / GB:.1f} GB per model",
             f"{'task':<22}{'pods':>5}{'GPUs':>6}{'cpu':>6}{'memory':>8}{'object store read':>19}"
             f"{'workspace read':>16}{'workspace written':>19}"]
    seen = set()
    for r in rows:
        key = re.sub(r"-\d+( \(trainjob\))?$", r"-k\1", r.name)
        if key in seen or r.stage in ("init", "finish"):
            continue
        seen.add(key)
        lines.append(f"{key:<22}{r.pods:>5}{r.gpus:>6}{r.cpu:>6}{r.memory:>8}{r.object_store_read / GB:>16.3f} GB"
                     f"{r.pods * r.workspace_read / GB:>13.1f} GB{r.pods * r.workspace_written / GB:>16.1f} GB")
    it = per_iteration(rows)
    lines.append(f"per iteration: {sum(r.pods * r.object_store_read for r in it) / GB:.3f} GB through the object store, "
                 f"{sum(r.pods * r.workspace_read for r in it) / GB:.1f} GB read and "
                 f"{sum(r.pods * r.workspace_written for r in it) / GB:.1f} GB written on the workspace")
    lines.append(f"workspace needed for the run: {storage(spec, s) / GB:.0f} GB")
    lines.append(f"backend: checked against Kubeflow Pipelines {spec.pipeline.cluster.kfp_version} "
                 "(pipeline.cluster.kfp_version); "
                 f"floors: Kubeflow Pipelines >= {'.'.join(map(str, MIN_KFP_BACKEND))}"
                 + (f", Kubeflow Trainer >= {'.'.join(map(str, MIN_TRAINER))}" if spec.pipeline.cluster.trainer.stages() else ""))
    lines.extend(run_size_lines(spec))
    for w in warnings_of(spec, s, rows, volume_bytes):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def run_size_lines(spec: PipelineSpec) -> list[str]:
    """How many iterations one run holds on each KFP version (size.py), the target's first; an error line
    when this config's pipeline.iterations would outgrow the target's limits (compile and submit refuse it)."""
    from . import size
    from .contracts import KFP_VERSIONS
    from .contracts import kfp as kfp_rules
    from .pipeline import compiled_docs

    target = spec.pipeline.cluster.kfp_version
    docs = {n: compiled_docs(spec, n) for n in (size.LOW, size.HIGH)}
    lines = []
    for version in [target] + [v for v in KFP_VERSIONS if v != kfp_rules.family(target)]:
        cap = size.capacity(docs.__getitem__, version)
        lines.append(("run size: " if version == target else "  also:   ") + size.describe(cap, spec.pipeline.iterations))
        if version == target:
            refusal = size.too_long(cap, spec.pipeline.iterations)
            if refusal and spec.pipeline.run_iterations >= spec.pipeline.iterations:
                lines.append(f"error: {refusal} (compile and submit refuse it)")
    lines.append(chain_line(spec))
    return lines


def chain_line(spec: PipelineSpec) -> str:
    """How the iterations run: one run, or a chain of runs x K iterations (pipelines/chain.py)."""
    from . import chain

    segs = chain.segments(spec.pipeline.iterations, chain.per_run(spec))
    if len(segs) == 1:
        return f"runs: one run of {spec.pipeline.iterations} iterations"
    return (f"runs: a chain of {len(segs)} runs x {segs[0].iterations} iterations (the last {segs[-1].iterations}), "
            f"each run starting from the last one's state on the workspace and submitting the next from the cluster "
            f"(pipeline.run_iterations; docs/cluster.md#long-runs-a-chain-of-runs)")


def model_params_of(spec: PipelineSpec, given: float = 0.0) -> float:
    from ..errors import ConfigError
    from .pipeline import model_params
    from .settings import resolved

    params = given or spec.pipeline.cluster.model_params or model_params(resolved(spec, "sft").policy)
    if not params:
        raise ConfigError("pipeline plan: the model size is unknown; pass --model-params (e.g. 7.62e9) or set "
                          "pipeline.cluster.model_params, or make sft.policy a readable HF directory.")
    return params


def run(args) -> int:
    from .params import load_with_sets

    spec = load_with_sets(args.config, args.set)
    print(render(spec, model_params_of(spec, args.model_params), parse_quantity(args.volume or "")))
    return 0


#: Fewer parameters than this is no language model: `--model-params 7` almost surely meant 7e9.
MIN_MODEL_PARAMS = 1000


def _model_params_arg(text: str) -> float:
    """--model-params: a count of parameters, finite and at least MIN_MODEL_PARAMS (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number; give the policy's parameter count, e.g. 7.62e9") from None
    if not math.isfinite(value) or value < MIN_MODEL_PARAMS:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a parameter count; give the whole count, e.g. 7.62e9 for a 7.62-billion-parameter policy")
    return value


def _volume_arg(text: str) -> str:
    """--volume: a positive size as Kubernetes writes it (2Ti, 500Gi, 800G); parse_quantity reads anything else as 0."""
    if parse_quantity(text) <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive size; write it as the PVC does, e.g. 2Ti or 500Gi")
    return text


def add_parser(psub) -> None:
    p = psub.add_parser("plan", help="pods, GPUs and bytes moved per task, and the storage a run needs, from the compiled spec")
    p.add_argument("--config", required=True, help="pipeline YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pipeline: key (rollout_shards=8, cluster.kfp_version=2.17) or a stage key "
                        "(rollout.n_samples=16), as compile and submit take it")
    p.add_argument("--model-params", type=_model_params_arg, default=0.0,
                   help="parameters of the policy, e.g. 7.62e9 (default: cluster.model_params or its config.json)")
    p.add_argument("--volume", type=_volume_arg, default=None,
                   help="size of workspace_pvc, e.g. 2Ti (warns when the run needs more)")
    p.set_defaults(handler=run)


