"""`prmflow pipeline plan --config FILE`: what a cluster run will hold and move, before a GPU is spent.

    prmflow pipeline plan --config configs/cluster/qwen2.5-7b-gsm8k-math.yaml [--model-params 7.62e9] [--set KEY=VALUE]
        [--durations-from RUN_ID [--tracking-uri URI]]

The plan compiles the pipeline and walks the compiled spec with a model of the KFP launcher: every
input artifact of a task is downloaded whole from the object store before the task starts
(kubeflow/pipelines backend/src/v2/component/launcher_v2.go, downloadArtifacts; a Collected list
downloads every element). What an artifact weighs follows from what produced it (`artifact_bytes`):
weights and optimizer moments stay on the workspace, so a Model artifact of sft/prm/prm-update/ppo is a location
of a few KB, while an imported model is its whole size. What a task opens on the workspace follows
from the input names it was wired with. Sizes: weights = bytes per parameter (bf16: 2) x P; Adam
state in fp32 (master copy + two moments, 12 bytes per parameter with DeepSpeed; 8 with torch);
rollouts as an upper bound, every response at max_new_tokens.

Time: the longest path through the compiled DAG (`critical_path`), each task as long as its stage's
duration (pipeline.task_seconds, or the stage runs of a finished run in MLflow), in both schedules of
pipeline.schedule, and the overlap's speedup.
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


def render(spec: PipelineSpec, params: float, volume_bytes: float = 0.0, measured: dict[str, float] | None = None,
           source: str = "") -> str:
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
    lines.extend(time_lines(spec, measured, source))
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
    from . import chain, chain_packages

    segs = chain.segments(spec.pipeline.iterations, chain_packages.per_run(spec))
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
    measured = measured_seconds(args.durations_from, args.tracking_uri or spec.pipeline.tracking_uri) \
        if args.durations_from else None
    print(render(spec, model_params_of(spec, args.model_params), parse_quantity(args.volume or ""), measured,
                 f"MLflow run {args.durations_from}"))
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
    p.add_argument("--durations-from", default="", metavar="RUN_ID",
                   help="MLflow parent run of a finished pipeline run: its stage runs' median times replace the "
                        "recipe's pipeline.task_seconds in the critical path")
    p.add_argument("--tracking-uri", default="", help="MLflow store of --durations-from (default: pipeline.tracking_uri, "
                                                       "else MLFLOW_TRACKING_URI)")
    p.set_defaults(handler=run)




# --- time: the critical path of the compiled DAG ----------------------------------------------------------------

#: Seconds assumed for a task of a stage the recipe gives no estimate for: the tracking steps and a model's
#: import or location (a CPU pod's start and one small write).
BOOKKEEPING_SECONDS = 10.0


def task_graph(ir: dict) -> tuple[dict[str, dict], str]:
    """Every task of the compiled spec, through every sub-DAG: {id: {"stage", "name", "deps", "children"}}, and
    the id of the root. `deps` are the ids it waits for (KFP's dependentTasks, data edges included: a task
    reading a loop's Collected output waits for the loop), `children` the tasks of its sub-DAG (ParallelFor,
    exit handler), which start when it starts; a sub-DAG ends when its last child does."""
    comps = ir["components"]
    graph: dict[str, dict] = {}

    def add(dag: dict, prefix: str) -> list[str]:
        ids = []
        for key, t in dag["tasks"].items():
            tid, ref = f"{prefix}/{key}", t["componentRef"]["name"]
            node = {"stage": stage_of(ref), "name": t["taskInfo"]["name"], "children": [],
                    "deps": [f"{prefix}/{d}" for d in t.get("dependentTasks", [])]}
            graph[tid] = node
            if "dag" in comps[ref]:
                node["stage"] = ""
                node["children"] = add(comps[ref]["dag"], tid)
            ids.append(tid)
        return ids

    graph["root"] = {"stage": "", "name": "root", "deps": [], "children": add(ir["root"]["dag"], "root")}
    return graph, "root"


def finish_times(graph: dict[str, dict], seconds) -> dict[str, float]:
    """{task id: when it ends} with every task started as soon as all it waits for has ended: a longest path.
    seconds(stage) is one task's duration (a ParallelFor's iterations run side by side, each that long)."""
    start: dict[str, float] = {}
    end: dict[str, float] = {}

    def finish(tid: str, at: float) -> float:
        if tid in end:
            return end[tid]
        node = graph[tid]
        start[tid] = max([at] + [finish(d, at) for d in node["deps"]])
        if node["children"]:
            end[tid] = max([start[tid]] + [finish(c, start[tid]) for c in node["children"]])
        else:
            end[tid] = start[tid] + seconds(node["stage"])
        return end[tid]

    finish("root", 0.0)
    return end


@dataclass
class CriticalPath:
    """The modelled time of one schedule: the whole run and its RL loop (first rollout to last ppo)."""

    schedule: str
    total: float
    loop: float
    iterations: int
    period: float
    """Seconds an iteration adds once the loop is full: the last ppo's end minus the one two iterations before, / 2."""


def critical_path(ir: dict, seconds, schedule: str = "") -> CriticalPath:
    """The critical path of the compiled spec `ir` from per-stage task durations `seconds(stage)`."""
    graph, root = task_graph(ir)
    end = finish_times(graph, seconds)
    ppo = {int(m.group(1)): end[t] for t, n in graph.items() if (m := re.fullmatch(r"ppo-(\d+)( \(trainjob\))?", n["name"]))}
    shards = [t for t, n in graph.items() if n["name"] == "rollout-shards-0"]
    loop_start = min(end[t] - seconds("rollout") for t in graph if graph[t]["name"] == "rollout-0") if shards else 0.0
    n = len(ppo)  # off by one, the loop's cycles may span two iterations: their ends alternate, so take two
    period = (ppo[n - 1] - ppo[n - 3]) / 2 if n > 2 else ppo[n - 1] - ppo[n - 2] if n > 1 else (
        ppo[0] - loop_start if n else 0.0)
    return CriticalPath(schedule, end[root], (ppo[n - 1] - loop_start) if n else 0.0, n, period)


#: The two schedules `pipeline.schedule` offers; the plan models both.
SCHEDULES = ("serial", "off_by_one")
#: Iterations compiled to find a schedule's steady state; longer runs add whole two-iteration periods (exact
#: once those repeat, which is checked).
STEADY = 7


def with_schedule(spec: PipelineSpec, schedule: str, iterations: int) -> PipelineSpec:
    """`spec` at `iterations` in `schedule`; off by one with the ppo keys it needs (pipeline.check_schedule) set."""
    import dataclasses

    stages = dict(spec.stages)
    if schedule == "off_by_one":
        ppo = dict(stages.get("ppo") or {})
        if ppo.get("rollout_correction", "none") == "none":
            ppo["rollout_correction"] = "token_truncate"
        ppo["recompute_old_logprobs"] = True
        stages["ppo"] = ppo
    return dataclasses.replace(spec, stages=stages, pipeline=dataclasses.replace(
        spec.pipeline, schedule=schedule, iterations=iterations))


def modelled(spec: PipelineSpec, seconds, schedule: str) -> CriticalPath:
    """The critical path of `spec` in `schedule` at its pipeline.iterations: compiled at up to STEADY iterations,
    then whole two-iteration periods added once the last ones agree (else compiled at full length)."""
    from .pipeline import compiled_docs

    n = spec.pipeline.iterations

    def at(k: int) -> CriticalPath:
        return critical_path(compiled_docs(with_schedule(spec, schedule, k), k)[0], seconds, schedule)

    if n <= STEADY:
        return at(n)
    cps = {k: at(k) for k in range(STEADY - 3, STEADY + 1)}
    steps = {round(cps[k].total - cps[k - 2].total, 6) for k in (STEADY - 1, STEADY)}
    if len(steps) > 1:
        return at(n)
    base = cps[STEADY - (n - STEADY) % 2]  # the same parity as n
    blocks = (n - base.iterations) // 2
    step = steps.pop()
    return CriticalPath(schedule, base.total + blocks * step, base.loop + blocks * step, n, step / 2)


def measured_seconds(run_id: str, tracking_uri: str = "") -> dict[str, float]:
    """{stage: median seconds of its stage runs} of the finished pipeline run `run_id` (its MLflow parent run):
    each child run's own span (end - start), so without a pod's scheduling, image pull and imports."""
    import statistics

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from ..errors import ConfigError
    from .settings import TIMED_STAGES

    client = MlflowClient(tracking_uri or None)
    try:
        parent = client.get_run(run_id)
    except MlflowException as e:
        raise ConfigError(f"--durations-from {run_id}: no such MLflow run at {client.tracking_uri} ({e.message}); "
                          f"give the pipeline's parent run id (the MLflow UI, or the line run-local prints) and "
                          f"--tracking-uri of its store.") from None
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'", max_results=5000)
    spans: dict[str, list[float]] = {}
    for r in runs:
        stage = r.data.tags.get("prmflow.stage", "").replace("_", "-")
        if stage in TIMED_STAGES and r.info.end_time and r.info.status == "FINISHED":
            spans.setdefault(stage, []).append((r.info.end_time - r.info.start_time) / 1000)
    if not spans:
        raise ConfigError(f"--durations-from {run_id}: the run has no finished stage runs (tag prmflow.stage) to time; "
                          f"give the parent run of a finished pipeline run.")
    return {stage: statistics.median(v) for stage, v in spans.items()}


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s < 3600 else f"{int(s // 3600)} h {round(s % 3600 / 60):02d} min"


def time_lines(spec: PipelineSpec, measured: dict[str, float] | None = None, source: str = "") -> list[str]:
    """The critical path per schedule and the overlap's speedup, from measured durations where given, else the
    recipe's pipeline.task_seconds; nothing but a line saying so when neither times rollout, advantage and ppo."""
    from .settings import TIMED_STAGES

    given = {**spec.pipeline.task_seconds, **(measured or {})}
    missing = [s for s in ("rollout", "advantage", "ppo") if s not in given]
    if missing:
        return [f"time: no estimate for {', '.join(missing)}: set pipeline.task_seconds, or --durations-from RUN_ID "
                "of a finished run"]
    origin = {s: ("measured" if s in (measured or {}) else "estimate") for s in given}

    def seconds(stage: str) -> float:
        return float(given.get(stage, BOOKKEEPING_SECONDS))

    what = f"measured in {source}" if measured else "the recipe's estimates (pipeline.task_seconds)"
    lines = [f"time (a model: the longest path through the compiled DAG, every pod started at once; {what}):",
             "  per task: " + ", ".join(f"{s} {given[s]:.0f} s{'' if origin[s] == 'measured' or not measured else ' (est.)'}"
                                       for s in TIMED_STAGES if s in given) + f", others {BOOKKEEPING_SECONDS:.0f} s"]
    cps = {sch: modelled(spec, seconds, sch) for sch in SCHEDULES}
    lines.append(f"  {'schedule':<12}{'per iteration':>15}{f'RL loop ({spec.pipeline.iterations} it.)':>22}{'whole run':>15}")
    for sch, cp in cps.items():
        mark = " <- pipeline.schedule" if sch == spec.pipeline.schedule else ""
        lines.append(f"  {sch:<12}{_minutes(cp.period):>15}{_minutes(cp.loop):>22}{_minutes(cp.total):>15}{mark}")
    s, o = cps["serial"], cps["off_by_one"]
    lines.append(f"  overlap speedup: {s.period / o.period:.2f}x per iteration, {s.loop / o.loop:.2f}x the RL loop, "
                 f"{s.total / o.total:.2f}x the whole run")
    return lines
