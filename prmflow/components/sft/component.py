"""KFP component: the sft stage. A shim over prmflow.components.sft.stage.run (see stage.py)."""

from kfp.dsl import Model, Output


def sft(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Output[Model]):
    """Train the SFT policy; `policy` is the HF checkpoint directory."""
    from prmflow.components.common.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.sft import stage

    metrics = run_stage("sft", stage, config, {"output": policy.path}, kfp_run_id, tracking_uri, experiment)
    policy.metadata.update(artifact_metadata(metrics))
