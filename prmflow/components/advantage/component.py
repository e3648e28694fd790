"""KFP component: the advantage stage (CPU pool). A shim over prmflow.components.advantage.stage.run."""

from typing import List

from kfp.dsl import Dataset, Input, Model, Output


def advantage(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, iteration: int,
              rollouts: Input[List[Dataset]], kl_source: Input[Model], use_kl_state: bool, advantages: Output[Dataset]):
    """Turn the collected rollout shards into advantages; `kl_source` is the previous PPO output."""
    import os

    from prmflow.components.advantage import stage
    from prmflow.components.common.kfp_shim import dataset_metadata, gather_shards, run_stage

    shards = gather_shards([r.path for r in rollouts], advantages.path + ".inputs")
    uses_kl = float((config or {}).get("kl_coef", 0) or 0) > 0  # e.g. GRPO puts KL in the PPO loss instead
    paths = {"input": shards, "output": advantages.path,
             "kl_state": os.path.join(kl_source.path, "kl_state.json") if use_kl_state and uses_kl else ""}
    run_stage("advantage", stage, config, paths, kfp_run_id, tracking_uri, experiment, iteration)
    advantages.metadata.update(dataset_metadata(advantages.path))
