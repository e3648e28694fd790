"""The prmflow DAG: wiring only (no `from __future__ import annotations`: KFP reads the real types). Each box is a
stage's component; all logic lives in the stages.

    init_tracking
      └─ sft ─────────────── policy_0 ──> prm (backbone: the SFT policy, unless prm.backbone is set)
    (sft, prm, ppo set to `trainjob` in pipeline.cluster.trainer: the step submits a Kubeflow Trainer
     TrainJob of num_nodes GPU pods and waits for it; see pipelines/trainjob.py)
    for k in 0..iterations-1 (unrolled at compile time):
      rollout[shard] x N  (ParallelFor) ── Collected ──> advantage (CPU pool) ──> ppo ──> policy_k+1
                                        └─ Collected ──> prm-update (pipeline.prm_update) ──> PRM_k+1
      (rollout k scores with PRM_k; advantage k and ppo k do not wait for the update)
      pipeline.schedule off_by_one: rollout k+1 samples with policy k (and its critic, PRM_k) while ppo k trains
    evaluate (if the stage exists; with the last PRM)
    exit handler: finish_tracking marks the MLflow parent run FINISHED/FAILED

Data flow (docs/cluster-data-flow.md): weights, optimizer moments and resume checkpoints are written
once to the workspace (a ReadWriteMany volume; a directory under run-local) at paths named by what
each step computes, never by the run id; artifacts carry only their location (kfp_shim). A task
takes only the inputs it reads. Every task that opens a location takes the `workspace` parameter:
KFP's driver mounts its per-run workspace only into tasks whose parameters name it (contracts/kfp.py). The MLflow
parent run is found by the KFP run id, which reaches a stage as $PRMFLOW_KFP_RUN_ID (the pod's pipeline/runid label),
so no cache key holds it.
"""


import math
import re
from types import SimpleNamespace
from typing import Any, Callable

from kfp import dsl, kubernetes

from .. import stages
from ..errors import ConfigError
from . import chain as chain_lib, kfp_components as components, kfp_shim, trainjob
from .lineage import finish_tracking, init_tracking
from .settings import (IMPORTER_SCHEMES, SERVER_DEFAULT_CLASS, ClusterConfig, ImagesConfig, NodePool, PipelineSpec,
                       resolved, safe_loader)


#: What a step's pod runs on a cluster: the image's installed prmflow, then KFP's executor (step.run).
STEP_COMMAND = ("prmflow", "pipeline", "step")


def step_component(fn: Callable, image: str, local: bool = False):
    """A component on `image` running `fn`. On a cluster its command is STEP_COMMAND: the function comes from
    the image's installed prmflow, so its Python source does not ride in the spec, in every task's pod-spec
    patch and in the run's status nodes (size.py: about an eighth of what an iteration stores). Under
    run-local (kfp.local) it stays a lightweight component, whose source KFP ships and runs. The images
    install prmflow and with it the pinned kfp, so no step pip-installs kfp at start."""
    component = dsl.component(base_image=image, install_kfp_package=False)(fn)
    if not local:  # the args stay KFP's: --executor_input {{$}} --function_to_execute NAME
        component.component_spec.implementation.container.command = list(STEP_COMMAND)
    return component


def _stage_fn(stage: str) -> Callable | None:
    """The KFP component function of `stage`, or None when this build lacks the stage."""
    return getattr(components, stages.component(stage)) if stages.load(stage) is not None else None


def trainjob_spec(cluster: ClusterConfig, images: ImagesConfig, scratch: str = "") -> trainjob.TrainJobSpec:
    """What a `trainjob` step submits: the GPU pool's shape and placement on num_nodes pods, each with the
    /dev/shm and /scratch of a GPU task pod."""
    pool = cluster.gpu_pool
    resources = {pool.accelerator_type: pool.accelerator_count} if pool.accelerator_type and pool.accelerator_count else {}
    resources.update({k: v for k, v in (("cpu", pool.cpu), ("memory", pool.memory)) if v})
    t = cluster.trainer
    return trainjob.TrainJobSpec(image=images.gpu, num_nodes=t.num_nodes, resources_per_node=resources,
                                 node_selector=dict(pool.node_selector), tolerations=list(pool.tolerations),
                                 secret_env=cluster.secret_env(), workspace_pvc=cluster.workspace_pvc,
                                 workspace_path=cluster.workspace_path, runtime=t.runtime, namespace=t.namespace,
                                 timeout_s=t.timeout_s, poll_s=t.poll_s, image_pull_secrets=list(images.pull_secrets),
                                 service_account=cluster.service_account,
                                 disable_istio_sidecar=t.disable_istio_sidecar, system_namespace=t.system_namespace,
                                 shm_size=cluster.shm_size, scratch_size=scratch)


def _scaled(quantity: str, n: int, of: int) -> str:
    """`quantity` (a Kubernetes CPU or memory amount of a whole pool pod) times n/of, rounded down."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity or "")
    if not m or not of or n == of:
        return quantity
    return f"{max(1, int(float(m.group(1)) * n / of))}{m.group(2)}"


def gpu_counts(spec: PipelineSpec) -> dict[str, int]:
    """GPUs of each GPU task's pod: training stages as configured (0 = the pool's count), rollout =
    tensor parallel size x engines per pod, evaluate as configured."""
    cluster, g = spec.pipeline.cluster, spec.pipeline.cluster.gpus
    pool = cluster.gpu_pool.accelerator_count
    roll = resolved(spec, "rollout")
    tp = roll.vllm.tensor_parallel_size if roll is not None and roll.sampler == "vllm" else 1
    counts = {"sft": g.sft or pool, "prm": g.prm or pool, "ppo": g.ppo or pool, "rollout": tp * g.rollout_engines,
              "evaluate": g.evaluate, "prm-update": g.prm_update}
    ev = resolved(spec, "evaluate")
    if ev is not None and ev.sampler == "vllm" and g.evaluate < ev.vllm.tensor_parallel_size:
        raise ConfigError(f"evaluate.sampler is vllm, whose engine takes {ev.vllm.tensor_parallel_size} GPU(s) "
                          f"(evaluate.vllm.tensor_parallel_size), but pipeline.cluster.gpus.evaluate is {g.evaluate}; "
                          f"raise it, or set evaluate.sampler: hf.")
    if pool:
        for stage, n in counts.items():
            if n > pool:
                raise ConfigError(f"pipeline.cluster.gpus: the {stage} pod needs {n} GPUs, but a gpu_pool node has "
                                  f"{pool} (accelerator_count); lower it or raise the pool's count.")
    return counts


def check_prm_update(roll_cfg, adv_cfg) -> None:
    """pipeline.prm_update keeps a trained PRM on-policy: refused where there is none, or nothing reads its scores."""
    if roll_cfg.prm == "oracle":
        raise ConfigError("pipeline.prm_update is true but rollout.prm is oracle: the task's checker labels the "
                          "steps, there is no trained PRM to update. Remove rollout.prm (the pipeline's PRM scores "
                          "the rollouts) or set pipeline.prm_update: false.")
    if not adv_cfg.switches()[1]:
        raise ConfigError(f"pipeline.prm_update is true but the advantage stage reads no step rewards (estimator="
                          f"{adv_cfg.estimator}, step_rewards={adv_cfg.step_rewards}), so no PRM score reaches the "
                          f"policy. Use step rewards (e.g. advantage.estimator: grpo_progress) or set "
                          f"pipeline.prm_update: false.")


def check_schedule(schedule: str, ppo_cfg) -> int:
    """How many iterations behind rollout's policy is (pipeline.schedule: serial 0, off_by_one 1). Off by one, ppo k
    trains policy k on samples of policy k-1: refused unless ppo recomputes the ratio's denominator under policy k and
    weights each token by pi_k / pi_sampler (rollout_correction), which also makes the staleness visible (train/is_*)."""
    if schedule == "serial":
        return 0
    missing = [f"ppo.{key}: {want}" for key, want, ok in (
        ("rollout_correction", "token_truncate", ppo_cfg.rollout_correction != "none"),
        ("recompute_old_logprobs", "true", ppo_cfg.recompute_old_logprobs is True)) if not ok]
    if missing:
        raise ConfigError(f"pipeline.schedule is {schedule}: ppo k trains policy k on rollouts sampled with policy "
                          f"k-1, so its ratio needs old log-probs recomputed under policy k and an importance weight "
                          f"pi_k / pi_sampler. Set {' and '.join(missing)}, or pipeline.schedule: serial.")
    return 1


def scratch_size(spec: PipelineSpec) -> str:
    """Local scratch of a GPU pod: cluster.scratch_size, else one model's bf16 weights + 20 GiB."""
    cluster = spec.pipeline.cluster
    if cluster.scratch_size:
        return cluster.scratch_size
    params = cluster.model_params or model_params(resolved(spec, "sft").policy if resolved(spec, "sft") else "")
    return f"{int(math.ceil(2 * params / 2**30)) + 20}Gi"


def model_params(path: str) -> float:
    """Parameters of the HF model at `path` from its config.json (0 when it is not readable here)."""
    import json
    from pathlib import Path

    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return 0.0
    c = json.loads(cfg_path.read_text())
    c = c.get("text_config", c)
    h, layers, vocab = c.get("hidden_size", 0), c.get("num_hidden_layers", 0), c.get("vocab_size", 0)
    inter = c.get("intermediate_size", 4 * h)
    heads, kv = c.get("num_attention_heads", 1), c.get("num_key_value_heads", c.get("num_attention_heads", 1))
    attn = h * h * 2 + 2 * h * (h // heads) * kv  # q, o + k, v
    embed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return float(layers * (attn + 3 * h * inter) + embed)


def _place(task, pool: NodePool, cluster: ClusterConfig, gpu: bool, cache: bool, local: bool, gpus: int = 0,
           scratch: str = "", pull_secrets=()):
    """Node pool, resources, retries, caching, secrets, pull secrets, workspace, run id and shared memory of one task:
    the plumbing every step shares, kept here so the pipeline function below reads as the DAG."""
    for key, value in pool.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=str(value))
    for tol in pool.tolerations:
        kubernetes.add_toleration(task, key=tol.get("key"), operator=tol.get("operator", "Equal"),
                                  value=tol.get("value"), effect=tol.get("effect"))
    share = pool.accelerator_count
    if pool.accelerator_type and gpus:
        task.set_accelerator_type(pool.accelerator_type).set_accelerator_limit(gpus)
    if pool.cpu:
        task.set_cpu_limit(_scaled(pool.cpu, gpus or share, share))
    if pool.memory:
        task.set_memory_limit(_scaled(pool.memory, gpus or share, share))
    if gpu and cluster.retries and not local:  # a retry outlasts a preemption; on this machine it only waits (2 + 4 min)
        task.set_retry(num_retries=cluster.retries, backoff_duration=cluster.backoff, backoff_factor=2.0)
    task.set_caching_options(cache)
    for secret, keys in cluster.secret_env().items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env={k: k for k in keys}, optional=True)
    if cluster.workspace_pvc:
        kubernetes.mount_pvc(task, pvc_name=cluster.workspace_pvc, mount_path=cluster.workspace_path)
    if pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(pull_secrets))
    if not local:  # the run id from the pod's label: an env var is not a cache-key input, a parameter would be
        kubernetes.use_field_path_as_env(task, env_name=kfp_shim.RUN_ID_ENV, field_path=RUN_ID_FIELD)
    if gpus and not local:  # NCCL and vLLM's tensor parallel workers share tensors through /dev/shm
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                   size_limit=cluster.shm_size)
        kubernetes.empty_dir_mount(task, volume_name="scratch", mount_path=SCRATCH, size_limit=scratch)
        task.set_env_variable("TMPDIR", SCRATCH)
    return task


#: The pod label the KFP API server puts on every pod of a run (apiserver/template/argo_template.go).
RUN_ID_FIELD = "metadata.labels['pipeline/runid']"
SCRATCH = "/scratch"


def importable(uri: str, cluster: ClusterConfig, key: str, local: bool) -> str:
    """`uri` if the KFP backend's importer accepts it (or this is run-local); a path on workspace_pvc is
    'workspace'; anything else is an error naming the key."""
    if local or uri.startswith(IMPORTER_SCHEMES):
        return "import"
    if cluster.workspace_pvc and (uri.rstrip("/") + "/").startswith(cluster.workspace_path.rstrip("/") + "/"):
        return "workspace"
    raise ConfigError(f"pipeline.{key} is {uri!r}: the KFP backend imports only {', '.join(IMPORTER_SCHEMES)} URIs, "
                      f"and a plain directory is not on the pods. Upload it (e.g. aws s3 cp --recursive DIR "
                      f"s3://BUCKET/PATH) and give that URI, or put it on workspace_pvc under "
                      f"{cluster.workspace_path}/.")


def build(spec: PipelineSpec, shard_threads: int | None = None, workspace: str | None = None,
          run_id: str | None = None, segment: chain_lib.Segment | None = None) -> Any:
    """The pipeline function for `spec` (a KFP graph component, ready to compile or run locally).

    segment: one run of a chain (pipelines/chain.py); None: one run of all pipeline.iterations. A
    segment after the first starts from the state the one before it recorded (chain_resume), its
    stages number iterations from the run parameter first_iteration, and only the last evaluates.

    workspace (run-local): a local directory standing in for the ReadWriteMany volume; None on a
    cluster (workspace_pvc, or KFP's per-run workspace). run_id (run-local): the id the tracking steps
    and $PRMFLOW_KFP_RUN_ID carry. shard_threads (run-local only): OMP_NUM_THREADS of each rollout shard.
    kfp.local runs a ParallelFor's iterations side by side (two at a time in kfp 2.17), so shards that
    each took every core would oversubscribe them. None on a cluster: a shard has its pod's cores."""
    pipe, cluster = spec.pipeline, spec.pipeline.cluster
    seg = segment or chain_lib.segments(pipe.iterations, pipe.iterations)[0]
    local = workspace is not None
    ws = workspace if local else cluster.workspace_root(pipe.name)
    gpu, cpu, pulls = pipe.images.gpu, pipe.images.cpu, pipe.images.pull_secrets
    on_trainjob = set(cluster.trainer.stages())  # these steps submit a TrainJob from the CPU pool
    gpus = gpu_counts(spec)
    scratch = scratch_size(spec)

    def trainer_image(stage):
        return cpu if stage in on_trainjob else gpu

    tj_spec = trainjob_spec(cluster, pipe.images, scratch)

    def placed(stage) -> dict:
        """A TrainJob step's image and node shape as a parameter: in the cache key, which env is not."""
        return {"placement": tj_spec.placement()} if stage in on_trainjob else {}

    def step(fn, image):
        return step_component(fn, image, local)

    sft_op, prm_op = step(_stage_fn("sft"), trainer_image("sft")), step(_stage_fn("prm"), trainer_image("prm"))
    rollout_op, ppo_op = step(_stage_fn("rollout"), gpu), step(_stage_fn("ppo"), trainer_image("ppo"))
    advantage_op = step(_stage_fn("advantage"), cpu)
    evaluate_fn = _stage_fn("evaluate")
    evaluate_op = step(evaluate_fn, gpu) if evaluate_fn else None
    locate_op = step(components.locate, cpu)
    resume_op, next_op = step(components.chain_resume, cpu), step(components.chain_next, cpu)
    shape = chain_lib.shape_key(spec)
    init_op, finish_op = step(init_tracking, cpu), step(finish_tracking, cpu)
    # what each task reads, decided here once: an input nothing reads is not wired
    ppo_cfg, adv_cfg, roll_cfg = resolved(spec, "ppo"), resolved(spec, "advantage"), resolved(spec, "rollout")
    critic = ppo_cfg.train_critic
    carry_state = critic or ppo_cfg.save_optimizer  # the next ppo continues the critic / Adam's moments
    reward_kl = adv_cfg.kl_coef > 0  # beta_k for k > 0 comes from the last ppo's kl_state
    oracle_prm = roll_cfg.prm == "oracle"
    if pipe.prm_update:
        check_prm_update(roll_cfg, adv_cfg)
    lag = check_schedule(pipe.schedule, ppo_cfg)
    update_op = step(components.prm_update, gpu) if pipe.prm_update else None
    prm_needs_base = not any((spec.stages.get("prm") or {}).get(k) for k in ("backbone", "model_path"))
    shards = list(range(pipe.rollout_shards))
    det, sampled = cluster.cache, cluster.cache and cluster.cache_sampling

    def on_gpu(task, stage, cache=det):
        return _place(task, cluster.gpu_pool, cluster, gpu=True, cache=cache, local=local, gpus=gpus[stage],
                      scratch=scratch, pull_secrets=pulls)

    def on_cpu(task, cache=det, gpu_retries=False):
        return _place(task, cluster.cpu_pool, cluster, gpu=gpu_retries, cache=cache, local=local, pull_secrets=pulls)

    def train(stage, task, name):
        """A training step: the stage in its own GPU pod, or a TrainJob submitted and awaited from the CPU pool."""
        if stage not in on_trainjob:
            return on_gpu(task, stage).set_display_name(name)
        task.set_env_variable(trainjob.ENV, tj_spec.to_json())
        return on_cpu(task, gpu_retries=True).set_display_name(f"{name} (trainjob)")

    def model_input(uri: str, key: str, name: str):
        """An existing model: imported (object store, run-local) or located in place on workspace_pvc."""
        if importable(uri, cluster, key, local) == "import":
            return dsl.importer(artifact_uri=uri, artifact_class=dsl.Model, reimport=False).set_display_name(
                f"{name} (imported)").output
        return on_cpu(locate_op(path=uri)).set_display_name(f"{name} (on the workspace)").outputs["model"]

    # the state a later run of a chain reads from the record (an imported sft_model / prm_model is imported again)
    prm_recorded = not pipe.prm_model or pipe.prm_update
    needs = ["policy"] + ["sft_policy"] * (not pipe.sft_model) + ["prm_model"] * prm_recorded + ["critic"] * critic + [
        "state"] * carry_state + ["kl_state"] * reward_kl + ["prm_state"] * pipe.prm_update
    if lag:  # off by one: the next rollout samples with the pieces one update older than the newest
        needs += ["sampled_policy"] + ["sampled_critic"] * critic + ["sampled_prm_model"] * pipe.prm_update

    config = dsl.PipelineConfig(workspace=dsl.WorkspaceConfig(
        size=cluster.workspace_size,
        kubernetes=dsl.KubernetesWorkspaceConfig(pvcSpecPatch=workspace_pvc_patch(cluster)),
    )) if not local and not cluster.workspace_pvc else None

    def prmflow_pipeline(
        sft_config: dict = spec.stages["sft"], prm_config: dict = spec.stages["prm"],
        rollout_config: dict = spec.stages["rollout"], advantage_config: dict = spec.stages["advantage"],
        ppo_config: dict = spec.stages["ppo"], evaluate_config: dict = spec.stages["evaluate"],
        tracking_uri: str = pipe.tracking_uri, experiment: str = pipe.experiment, run_name: str = pipe.run_name,
        chain_id: str = "", first_iteration: int = seg.first, chain: str = "",
    ):
        run = run_id if local else dsl.PIPELINE_JOB_ID_PLACEHOLDER  # only the uncached tracking steps take it
        common = dict(tracking_uri=tracking_uri, experiment=experiment)
        chained = seg.shape != "whole"
        first = first_iteration if chained else 0
        configs = dict(sft_config=sft_config, prm_config=prm_config, rollout_config=rollout_config,
                       advantage_config=advantage_config, ppo_config=ppo_config)
        offset = {"first_iteration": first_iteration} if chained else {}  # stages number iterations globally
        exit_task = on_cpu(finish_op(kfp_run_id=run, **common, chain_id=chain_id, first_iteration=first,
                                     iterations=seg.iterations, last=seg.last), cache=False)
        with dsl.ExitHandler(exit_task, name="track-pipeline-run"):
            init = on_cpu(init_op(kfp_run_id=run, **common, **configs, evaluate_config=evaluate_config,
                                  run_name=run_name, chain_id=chain_id, first_iteration=first), cache=False)
            resumed = None
            if seg.first:  # a later run of a chain: the state the run before it recorded on the workspace
                resumed = on_cpu(resume_op(workspace=ws, shape=shape, first_iteration=first_iteration,
                                           needs=needs, **configs).after(init)).set_display_name("chain-resume")
            if pipe.sft_model:  # an existing warm-up: imported, not retrained
                sft_policy = model_input(pipe.sft_model, "sft_model", "sft")
            elif resumed:
                sft_policy = resumed.outputs["sft_policy"]
            else:
                sft_policy = train("sft", sft_op(config=sft_config, **common, workspace=ws, **placed("sft")).after(init),
                                   "sft").outputs["policy"]
            if resumed and prm_recorded:
                prm_model = resumed.outputs["prm_model"]
            elif pipe.prm_model:
                prm_model = model_input(pipe.prm_model, "prm_model", "prm")
            else:
                prm_base = {"base": sft_policy} if prm_needs_base else {}
                prm_task = prm_op(config=prm_config, **common, workspace=ws, **prm_base, **placed("prm")).after(init)
                prm_model = train("prm", prm_task, "prm").outputs["prm_model"]
            policy, upd, prm_upd = sft_policy, None, None
            if resumed:  # the last run's final ppo and prm-update outputs, as its own tasks named them
                policy, upd = resumed.outputs["policy"], SimpleNamespace(outputs={
                    key: resumed.outputs[key] for key in ("critic", "kl_state", "state")})
                prm_upd = SimpleNamespace(outputs={"state": resumed.outputs["prm_state"]}) if update_op else None
            # what rollout k samples with: policy k (serial) or, off by one, policy k-1 (ppo k-2's), with its critic
            # and the PRM of update k-2, so rollout k+1 waits for neither ppo k nor prm-update k
            sampled_with = {"policy": [policy], "critic": [upd.outputs["critic"] if upd else sft_policy],
                            "prm_model": [prm_model]}
            if resumed and lag:  # where the run before left off: its last rollout sampled one update behind
                for key in [k for k in sampled_with if f"sampled_{k}" in needs]:
                    sampled_with[key].insert(0, resumed.outputs[f"sampled_{key}"])
            for k in range(seg.iterations):
                behind = {key: seq[-1 - min(lag, len(seq) - 1)] for key, seq in sampled_with.items()}
                # the reference (SFT) policy: ref_logprobs for the KL terms and the KL-to-SFT of every iteration
                reads = {"ref": sft_policy, **({"prm_model": behind["prm_model"]} if not oracle_prm else {})}
                if critic:  # values of the sampling policy's critic: a new one (from the SFT policy) at first
                    reads["critic"] = behind["critic"]
                with dsl.ParallelFor(shards, name=f"rollout-shards-{k}") as shard:
                    roll = on_gpu(rollout_op(config=rollout_config, **common, workspace=ws, iteration=k, shard=shard,
                                             num_shards=len(shards), policy=behind["policy"], **reads, **offset).after(init),
                                  "rollout", cache=sampled)
                    roll.set_display_name(f"rollout-{k}")
                    if shard_threads:
                        roll.set_env_variable("OMP_NUM_THREADS", str(shard_threads))
                kl_in = {"kl_state": upd.outputs["kl_state"]} if upd and reward_kl else {}
                adv = on_cpu(advantage_op(config=advantage_config, **common, iteration=k, **offset,
                                          rollouts=dsl.Collected(roll.outputs["rollouts"]), **kl_in))
                adv.set_display_name(f"advantage-{k}")
                prev = {"previous": upd.outputs["state"]} if upd and carry_state else {}
                upd = train("ppo", ppo_op(config=ppo_config, **common, workspace=ws, **placed("ppo"), iteration=k, **offset,
                                          policy=policy, advantages=adv.outputs["advantages"], **prev), f"ppo-{k}")
                policy = upd.outputs["updated"]
                sampled_with["policy"].append(policy)
                if critic:
                    sampled_with["critic"].append(upd.outputs["critic"])
                if update_op is not None:  # PRM_k+1 from PRM_k on rollouts k; advantage k and ppo k do not wait
                    replay = {"previous": prm_upd.outputs["state"]} if prm_upd else {}
                    prm_upd = train("prm-update", update_op(
                        config=spec.stages["prm-update"], **common, workspace=ws, iteration=k, **offset, prm_model=prm_model,
                        rollouts=dsl.Collected(roll.outputs["rollouts"]), **replay), f"prm-update-{k}")
                    prm_model = prm_upd.outputs["updated_prm"]
                    sampled_with["prm_model"].append(prm_model)
            if not seg.last:  # record the state for the next run; on a cluster, submit it from here
                pieces = {"sft_policy": sft_policy} if not pipe.sft_model else {}
                pieces.update({"prm_model": prm_model} if prm_recorded else {})
                pieces.update({"critic": upd.outputs["critic"]} if critic else {})
                pieces.update({"state": upd.outputs["state"]} if carry_state else {})
                pieces.update({"kl_state": upd.outputs["kl_state"]} if reward_kl else {})
                pieces.update({"prm_state": prm_upd.outputs["state"]} if update_op else {})
                pieces.update({f"sampled_{key}": sampled_with[key][-1 - lag] for key in sampled_with
                               if f"sampled_{key}" in needs})
                nxt = on_cpu(next_op(workspace=ws, shape=shape, first_iteration=first_iteration,
                                     iterations=seg.iterations, **configs, policy=policy, **pieces, chain=chain,
                                     chain_id=chain_id), cache=False).set_display_name("chain-next")
                if not local:  # Kubeflow's PodDefault of that label projects the pipelines token it submits with
                    kubernetes.add_pod_label(nxt, label_key=chain_lib.TOKEN_POD_LABEL, label_value="true")
            elif evaluate_op is not None:
                on_gpu(evaluate_op(config=evaluate_config, **common, workspace=ws, policy=policy, baseline=sft_policy,
                                   prm_model=prm_model), "evaluate", cache=sampled).set_display_name("evaluate")

    if seg.shape == "whole":  # one run: no chain parameters in its spec
        import inspect

        sig = inspect.signature(prmflow_pipeline)
        prmflow_pipeline.__signature__ = sig.replace(parameters=[
            p for name, p in sig.parameters.items() if name not in (chain_lib.FIRST_PARAM, chain_lib.CHAIN_PARAM)])
    decorate = dsl.pipeline(name=pipe.name, description="RL fine-tuning with step-level process rewards (prmflow)",
                            pipeline_config=config)
    return on_a_fresh_stack(decorate, prmflow_pipeline)  # KFP wires the graph here, calling prmflow_pipeline once


def on_a_fresh_stack(fn: Callable, *args) -> Any:
    """fn(*args), run on a new thread (its stack holds only fn's frames); its exception, if any, is raised here.

    KFP (2.17) calls inspect.stack() in every task setting (set_cpu_limit, add_node_selector_constraint, ...:
    PipelineTask._ensure_container_spec_exists, for the caller's name in an error message). That reads the
    source of every frame on the stack, and for each frame with no file behind it (`python -m`'s
    <frozen runpy>, the <string> frames of a pytest-xdist worker) scans all of sys.modules. Under a caller's
    deep stack with torch loaded, wiring one pipeline took 10-14 s that way; on a fresh stack the walk is
    short. The caller waits: KFP's pipeline context is process-global, so two graphs are never wired at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfp-wiring") as pool:
        return pool.submit(fn, *args).result()


def workspace_pvc_patch(cluster: ClusterConfig) -> dict:
    """pvcSpecPatch of KFP's per-run workspace: ReadWriteMany, and the storage class unless it is left to the
    cluster's default (KFP >= 2.17) or to the API server's claim template (server-default)."""
    cls = cluster.workspace_storage_class
    return {"accessModes": ["ReadWriteMany"], **({"storageClassName": cls} if cls and cls != SERVER_DEFAULT_CLASS else {})}


def is_compiled_spec(path: str) -> bool:
    """`path` is a regular file holding a KFP pipeline spec (what compile_to writes): its first YAML document
    has the IR's pipelineInfo and root."""
    import os

    import yaml

    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            first = next((d for d in yaml.load_all(f, Loader=safe_loader()) if d), None)
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        return False
    return isinstance(first, dict) and "pipelineInfo" in first and "root" in first


def compile_to(spec: PipelineSpec, path: str, check_backend: bool = True, check_size: bool = True,
               segment: chain_lib.Segment | None = None) -> str:
    """Compile `spec` to `path`, checked against the rules of the KFP backend it targets
    (pipeline.cluster.kfp_version, compat.py) and against the size one run may grow to (size.py): a spec
    that version would refuse, or a run it would stop when it outgrows its limits, is not written.
    check_backend=False: neither is checked here (submit checks both against the server's own version);
    check_size=False: `plan`, which prints the limits instead. segment: one run of a chain (chain.py), whose
    package is measured as it is against every KFP version from pipeline.cluster.kfp_version up."""
    import os

    import yaml
    from kfp import compiler

    from . import compat, size

    if not path.endswith((".yaml", ".yml")):
        # KFP writes by suffix, and a spec with platform features (node pools, volumes, secrets: every prmflow
        # pipeline) only as YAML: for another suffix it opens the path for writing, then raises
        # (kfp 2.17.0 kfp/compiler/pipeline_spec_builder.py:2298, write_pipeline_spec_to_file), so refuse the name first
        raise ConfigError(f"{path}: a compiled pipeline is written as YAML only (KFP keeps its Kubernetes settings, "
                          f"node pools, volumes and secrets, only in YAML); name the output .yaml or .yml. "
                          f"{path} is left as it is.")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        what = "is a directory" if os.path.isdir(path) else f"is in {folder}, which is not a directory here"
        raise ConfigError(f"{path} {what}; name a .yaml file in an existing directory.")
    if os.path.lexists(path) and not is_compiled_spec(path):  # a spec compiled before is replaced; anything else is kept
        raise ConfigError(f"{path} exists and is not a compiled pipeline (a config, or another file of yours): it is "
                          f"left as it is. Name another output with -o, e.g. -o compiled-pipeline.yaml.")
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        compiler.Compiler().compile(build(spec, segment=segment), package_path=tmp)
        with open(tmp) as f:
            docs = [d for d in yaml.load_all(f, Loader=safe_loader()) if d]
        cluster = spec.pipeline.cluster
        if check_backend:
            compat.check(docs, cluster.kfp_version, cluster.workspace_storage_class == SERVER_DEFAULT_CLASS,
                         where=f"pipeline '{spec.pipeline.name}'")
        if segment is not None:  # one run of a chain: measured as compiled, on every version it may run on
            refusal = next((r for r in (size.check_package(docs, v) for v in chain_lib.versions_from(
                cluster.kfp_version)) if r), None) if check_backend and check_size else None
        else:
            refusal = size.too_long(run_capacity(spec), spec.pipeline.iterations) if check_backend and check_size else None
        if refusal:  # a run the cluster would stop mid-way (size.py, contracts/argo.py): nothing is written
            raise ConfigError(f"pipeline '{spec.pipeline.name}': {refusal}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def compiled_docs(spec: PipelineSpec, iterations: int, segment: chain_lib.Segment | None = None) -> list[dict]:
    """The compiled spec (pipeline spec and platform spec) of `spec` at `iterations` iterations (of `segment`'s
    shape: a run of a chain)."""
    import dataclasses
    import os
    import tempfile

    import yaml
    from kfp import compiler


    at = dataclasses.replace(spec, pipeline=dataclasses.replace(spec.pipeline, iterations=iterations))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipeline.yaml")
        compiler.Compiler().compile(build(at, segment=segment), package_path=path)
        with open(path) as f:
            return [d for d in yaml.load_all(f, Loader=safe_loader()) if d]


def run_capacity(spec, kfp_version: str | None = None):
    """How many iterations one run of `spec` holds on `kfp_version` (default: its pipeline.cluster.kfp_version):
    size.Capacity, from the spec compiled at size.LOW and size.HIGH iterations."""
    from . import size

    docs = {n: compiled_docs(spec, n) for n in (size.LOW, size.HIGH)}
    return size.capacity(docs.__getitem__, kfp_version or spec.pipeline.cluster.kfp_version)
