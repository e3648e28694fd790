"""KFP component: one shard of the rollout stage. A shim over prmflow.components.rollout.stage.run."""

from kfp.dsl import Dataset, Input, Model, Output


def rollout(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int, shard: int,
            num_shards: int, policy: Input[Model], policy_subdir: str, prm_model: Input[Model], ref: Input[Model],
            critic: Input[Model], critic_subdir: str, use_critic: bool, rollouts: Output[Dataset]):
    """Sample and score shard `shard` of `num_shards` of this iteration's prompts."""
    import os

    from prmflow.components.common.kfp_shim import dataset_metadata, run_stage
    from prmflow.components.rollout import stage

    # `prm: oracle` in the rollout config (the exact checker's step labels) stands in for the trained PRM
    prm = "oracle" if (config or {}).get("prm") == "oracle" else prm_model.path
    paths = {"policy": os.path.join(policy.path, policy_subdir), "prm": prm, "ref": ref.path,
             "critic": os.path.join(critic.path, critic_subdir) if use_critic else "",
             "shard": shard, "num_shards": num_shards, "output": rollouts.path}
    run_stage("rollout", stage, config, paths, kfp_run_id, tracking_uri, experiment, iteration)
    rollouts.metadata.update(dataset_metadata(rollouts.path))
