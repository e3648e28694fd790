"""KFP component: the ppo stage. A shim over prmflow.components.ppo.stage.run (see stage.py)."""

from kfp.dsl import Dataset, Input, Model, Output


def ppo(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int, policy: Input[Model],
        policy_subdir: str, advantages: Input[Dataset], previous: Input[Model], resume_previous: bool,
        updated: Output[Model]):
    """Update the policy (and critic); `updated` holds policy/, critic/ and kl_state.json."""
    import os

    from prmflow.components.common.kfp_shim import artifact_metadata, run_stage
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
