"""KFP component: the sft stage. A shim over prmflow.components.sft.stage.run (see stage.py)."""

from kfp import dsl
from kfp.dsl import Model, Output

from prmflow.pipelines.settings import DEFAULT_GPU_IMAGE


def sft(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Output[Model]):
    """Train the SFT policy; `policy` is the HF checkpoint directory."""
    from prmflow.pipelines.shim import artifact_metadata, run_stage

    metrics = run_stage("sft", config, {"output": policy.path}, kfp_run_id, tracking_uri, experiment)
    policy.metadata.update(artifact_metadata(metrics))


component = dsl.component(base_image=DEFAULT_GPU_IMAGE)(sft)
