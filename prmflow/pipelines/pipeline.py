"""The prmflow DAG: wiring only (no `from __future__ import annotations`: KFP reads the real types). Each box is a stage's component; all logic lives in the stages.

    init_tracking
      └─ sft ─────────────── policy_0 ──> prm (backbone: the SFT policy, unless prm.backbone is set)
    (sft, prm, ppo set to `trainjob` in pipeline.cluster.trainer: the step submits a Kubeflow Trainer
     TrainJob of num_nodes GPU pods and waits for it; see pipelines/trainjob.py)
    for k in 0..iterations-1 (unrolled at compile time):
      rollout[shard] x N  (ParallelFor) ── Collected ──> advantage (CPU pool) ──> ppo ──> policy_k+1
    evaluate (if the stage exists)
    exit handler: finish_tracking marks the MLflow parent run FINISHED/FAILED

Stages find the MLflow parent run by the KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER) rather than by
a parameter from init_tracking: kfp.local (2.17) substitutes the loop item for upstream *parameter*
outputs used inside a ParallelFor, and the KFP exit task may not depend on other tasks anyway.
"""


from typing import Any, Callable

from kfp import dsl, kubernetes

from .. import stages
from . import components, trainjob
from .lineage import finish_tracking, init_tracking
from .settings import ClusterConfig, ImagesConfig, NodePool, PipelineSpec


def _component(fn: Callable, image: str):
    """A lightweight component on `image`. The images install prmflow and with it the pinned kfp, so the
    step does not pip-install kfp at start (KFP's default: ~1 s per step, and a network fetch where the
    image's kfp differed)."""
    return dsl.component(base_image=image, install_kfp_package=False)(fn)


def _stage_fn(stage: str) -> Callable | None:
    """The KFP component function of `stage`, or None when this build lacks the stage."""
    return getattr(components, stage) if stages.load(stage) is not None else None


def trainjob_spec(cluster: ClusterConfig, images: ImagesConfig) -> trainjob.TrainJobSpec:
    """What a `trainjob` step submits: the GPU pool's shape and placement on num_nodes pods."""
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
                                 disable_istio_sidecar=t.disable_istio_sidecar, system_namespace=t.system_namespace)


def _place(task, pool: NodePool, cluster: ClusterConfig, gpu: bool, cache: bool, pull_secrets=()):
    """Node pool, resources, retries, caching, secrets and workspace of one task: the plumbing
    every stage shares, kept here so the pipeline function below reads as the DAG."""
    for key, value in pool.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=str(value))
    for tol in pool.tolerations:
        kubernetes.add_toleration(task, key=tol.get("key"), operator=tol.get("operator", "Equal"),
                                  value=tol.get("value"), effect=tol.get("effect"))
    if pool.accelerator_type and pool.accelerator_count:
        task.set_accelerator_type(pool.accelerator_type).set_accelerator_limit(pool.accelerator_count)
    if pool.cpu:
        task.set_cpu_limit(pool.cpu)
    if pool.memory:
        task.set_memory_limit(pool.memory)
    if gpu and cluster.retries:
        task.set_retry(num_retries=cluster.retries, backoff_duration=cluster.backoff, backoff_factor=2.0)
    task.set_caching_options(cache)
    for secret, keys in cluster.secret_env().items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env={k: k for k in keys}, optional=True)
    if cluster.workspace_pvc:
        kubernetes.mount_pvc(task, pvc_name=cluster.workspace_pvc, mount_path=cluster.workspace_path)
    if pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(pull_secrets))
    return task


def build(spec: PipelineSpec, shard_threads: int | None = None) -> Any:
    """The pipeline function for `spec` (a KFP graph component, ready to compile or run locally).

    shard_threads (run-local only): OMP_NUM_THREADS of each rollout shard. kfp.local runs a ParallelFor's
    iterations side by side (two at a time in kfp 2.17), so shards that each took every core would
    oversubscribe them. None on a cluster: a shard has its pod's cores to itself."""
    pipe, cluster = spec.pipeline, spec.pipeline.cluster
    gpu, cpu, pulls = pipe.images.gpu, pipe.images.cpu, pipe.images.pull_secrets
    on_trainjob = set(cluster.trainer.stages())  # these steps submit a TrainJob from the CPU pool

    def trainer_image(stage):
        return cpu if stage in on_trainjob else gpu

    sft_op, prm_op = _component(_stage_fn("sft"), trainer_image("sft")), _component(_stage_fn("prm"), trainer_image("prm"))
    rollout_op, ppo_op = _component(_stage_fn("rollout"), gpu), _component(_stage_fn("ppo"), trainer_image("ppo"))
    advantage_op = _component(_stage_fn("advantage"), cpu)
    evaluate_fn = _stage_fn("evaluate")
    evaluate_op = _component(evaluate_fn, gpu) if evaluate_fn else None
    init_op, finish_op = _component(init_tracking, cpu), _component(finish_tracking, cpu)
    critic = (spec.stages.get("ppo") or {}).get("train_critic", False)
    shards = list(range(pipe.rollout_shards))
    det, sampled = cluster.cache, cluster.cache and cluster.cache_sampling

    def on_gpu(task, cache=det):
        return _place(task, cluster.gpu_pool, cluster, gpu=True, cache=cache, pull_secrets=pulls)

    def on_cpu(task, cache=det):
        return _place(task, cluster.cpu_pool, cluster, gpu=False, cache=cache, pull_secrets=pulls)

    def train(stage, task, name):
        """A training step: the stage in its own GPU pod, or a TrainJob submitted and awaited from the CPU pool."""
        if stage not in on_trainjob:
            return on_gpu(task).set_display_name(name)
        task.set_env_variable(trainjob.ENV, trainjob_spec(cluster, pipe.images).to_json())
        return _place(task, cluster.cpu_pool, cluster, gpu=True, cache=det,
                      pull_secrets=pulls).set_display_name(f"{name} (trainjob)")

    @dsl.pipeline(name=pipe.name, description="RL fine-tuning with step-level process rewards (prmflow)")
    def prmflow_pipeline(
        sft_config: dict = spec.stages["sft"], prm_config: dict = spec.stages["prm"],
        rollout_config: dict = spec.stages["rollout"], advantage_config: dict = spec.stages["advantage"],
        ppo_config: dict = spec.stages["ppo"], evaluate_config: dict = spec.stages["evaluate"],
        tracking_uri: str = pipe.tracking_uri, experiment: str = pipe.experiment, run_name: str = pipe.run_name,
    ):
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        common = dict(kfp_run_id=run_id, tracking_uri=tracking_uri, experiment=experiment)
        exit_task = on_cpu(finish_op(**common), cache=False)
        with dsl.ExitHandler(exit_task, name="track-pipeline-run"):
            init = on_cpu(init_op(**common, sft_config=sft_config, prm_config=prm_config, rollout_config=rollout_config,
                                  advantage_config=advantage_config, ppo_config=ppo_config,
                                  evaluate_config=evaluate_config, run_name=run_name), cache=False)
            if pipe.sft_model:  # an existing warm-up: imported, not retrained
                sft_policy = dsl.importer(artifact_uri=pipe.sft_model, artifact_class=dsl.Model,
                                          reimport=False).set_display_name("sft (imported)").output
            else:
                sft_policy = train("sft", sft_op(config=sft_config, **common).after(init), "sft").outputs["policy"]
            if pipe.prm_model:
                prm_model = dsl.importer(artifact_uri=pipe.prm_model, artifact_class=dsl.Model,
                                         reimport=False).set_display_name("prm (imported)").output
            else:
                prm_model = train("prm", prm_op(config=prm_config, **common, base=sft_policy).after(init),
                                  "prm").outputs["prm_model"]
            policy, subdir, previous = sft_policy, "", sft_policy
            for k in range(pipe.iterations):
                with dsl.ParallelFor(shards, name=f"rollout-shards-{k}") as shard:
                    roll = on_gpu(rollout_op(
                        config=rollout_config, **common, iteration=k, shard=shard, num_shards=len(shards),
                        policy=policy, policy_subdir=subdir, prm_model=prm_model,
                        ref=sft_policy, critic=previous if k else sft_policy,
                        critic_subdir="critic" if k else "", use_critic=bool(critic)).after(init), cache=sampled)
                    roll.set_display_name(f"rollout-{k}")
                    if shard_threads:
                        roll.set_env_variable("OMP_NUM_THREADS", str(shard_threads))
                adv = on_cpu(advantage_op(config=advantage_config, **common, iteration=k,
                                          rollouts=dsl.Collected(roll.outputs["rollouts"]), kl_source=previous,
                                          use_kl_state=k > 0)).set_display_name(f"advantage-{k}")
                upd = train("ppo", ppo_op(config=ppo_config, **common, iteration=k, policy=policy, policy_subdir=subdir,
                                          advantages=adv.outputs["advantages"], previous=previous,
                                          resume_previous=k > 0), f"ppo-{k}")
                policy, subdir, previous = upd.outputs["updated"], "policy", upd.outputs["updated"]
            if evaluate_op is not None:
                on_gpu(evaluate_op(config=evaluate_config, **common, policy=policy, policy_subdir=subdir,
                                   baseline=sft_policy, prm_model=prm_model),
                       cache=sampled).set_display_name("evaluate")

    return prmflow_pipeline


def compile_to(spec: PipelineSpec, path: str) -> str:
    from kfp import compiler

    compiler.Compiler().compile(build(spec), package_path=path)
    return path
