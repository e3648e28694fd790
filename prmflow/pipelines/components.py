"""The KFP components: one thin shim per stage that turns KFP's arguments (artifact paths, the run id,
the iteration) into the stage's `paths` and calls `kfp_shim.run_stage` (which runs `stage.run`).

KFP compiles each function's own source into the pipeline spec and runs it inside the stage's image,
so every import a shim needs is inside its body. The logic lives in the stages; these only translate.
"""

from typing import List

from kfp.dsl import Dataset, Input, Metrics, Model, Output

#: The stages with a component here, in pipeline order (the pipeline looks each up by name).
STAGES = ("sft", "prm", "rollout", "advantage", "ppo", "evaluate")


def sft(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Output[Model]):
    """Train the SFT policy; `policy` is the HF checkpoint directory."""
    from prmflow.pipelines.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.sft import stage

    metrics = run_stage("sft", stage, config, {"output": policy.path}, kfp_run_id, tracking_uri, experiment)
    policy.metadata.update(artifact_metadata(metrics))


def prm(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, base: Input[Model],
        prm_model: Output[Model]):
    """Train the process reward model; `prm_model` is its HF token-classification directory.

    The backbone is `base` (the SFT policy) unless the config names its own `backbone`."""
    from prmflow.pipelines.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.prm import stage

    paths = {"output": prm_model.path}
    if not (config or {}).get("backbone"):
        paths["backbone"] = base.path
    metrics = run_stage("prm", stage, config, paths, kfp_run_id, tracking_uri, experiment)
    prm_model.metadata.update(artifact_metadata(metrics))


def rollout(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int, shard: int,
            num_shards: int, policy: Input[Model], policy_subdir: str, prm_model: Input[Model], ref: Input[Model],
            critic: Input[Model], critic_subdir: str, use_critic: bool, rollouts: Output[Dataset]):
    """Sample and score shard `shard` of `num_shards` of this iteration's prompts."""
    import os

    from prmflow.pipelines.kfp_shim import dataset_metadata, run_stage
    from prmflow.components.rollout import stage

    # `prm: oracle` in the rollout config (the exact checker's step labels) stands in for the trained PRM
    prm = "oracle" if (config or {}).get("prm") == "oracle" else prm_model.path
    paths = {"policy": os.path.join(policy.path, policy_subdir), "prm": prm, "ref": ref.path,
             "critic": os.path.join(critic.path, critic_subdir) if use_critic else "",
             "shard": shard, "num_shards": num_shards, "output": rollouts.path}
    run_stage("rollout", stage, config, paths, kfp_run_id, tracking_uri, experiment, iteration)
    rollouts.metadata.update(dataset_metadata(rollouts.path))


def advantage(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int,
              rollouts: Input[List[Dataset]], kl_source: Input[Model], use_kl_state: bool, advantages: Output[Dataset]):
    """Turn the collected rollout shards into advantages; `kl_source` is the previous PPO output."""
    import os

    from prmflow.components.advantage import stage
    from prmflow.pipelines.kfp_shim import dataset_metadata, gather_shards, run_stage

    shards = gather_shards([r.path for r in rollouts], advantages.path + ".inputs")
    uses_kl = float((config or {}).get("kl_coef", 0) or 0) > 0  # e.g. GRPO puts KL in the PPO loss instead
    paths = {"input": shards, "output": advantages.path,
             "kl_state": os.path.join(kl_source.path, "kl_state.json") if use_kl_state and uses_kl else ""}
    run_stage("advantage", stage, config, paths, kfp_run_id, tracking_uri, experiment, iteration)
    advantages.metadata.update(dataset_metadata(advantages.path))


def ppo(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int, policy: Input[Model],
        policy_subdir: str, advantages: Input[Dataset], previous: Input[Model], resume_previous: bool,
        updated: Output[Model]):
    """Update the policy (and critic); `updated` holds policy/, critic/ and kl_state.json."""
    import os

    from prmflow.pipelines.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.ppo import stage

    paths = {"policy": os.path.join(policy.path, policy_subdir), "input": advantages.path,
             "output": updated.path}
    if resume_previous:  # the critic, the optimizer and the KL controller carry over from the previous iteration
        paths["kl_state"] = os.path.join(previous.path, "kl_state.json")
        if os.path.isdir(os.path.join(previous.path, "critic")):
            paths["critic"] = os.path.join(previous.path, "critic")
        if os.path.isdir(os.path.join(previous.path, "optimizer")):
            paths["optimizer_state"] = os.path.join(previous.path, "optimizer")  # Adam continues, not restarts
    metrics = run_stage("ppo", stage, config, paths, kfp_run_id, tracking_uri, experiment, iteration)
    updated.metadata.update(artifact_metadata(metrics))


def evaluate(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Input[Model],
             policy_subdir: str, baseline: Input[Model], prm_model: Input[Model], results: Output[Model],
             scores: Output[Metrics]):
    """Evaluate the final policy; `scores` shows the eval metrics in the KFP UI."""
    import os

    from prmflow.pipelines.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.evaluate import stage

    paths = {"policy": os.path.join(policy.path, policy_subdir), "baseline": baseline.path, "prm": prm_model.path,
             "output": results.path}
    metrics = run_stage("evaluate", stage, config, paths, kfp_run_id, tracking_uri, experiment)
    for key, value in artifact_metadata(metrics).items():
        scores.log_metric(key, value)
