"""KFP component: the evaluate stage. A shim over prmflow.components.evaluate.stage.run."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from prmflow.pipelines.settings import DEFAULT_GPU_IMAGE


def evaluate(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Input[Model],
             policy_subdir: str, baseline: Input[Model], prm_model: Input[Model], results: Output[Model],
             scores: Output[Metrics]):
    """Evaluate the final policy; `scores` shows the eval metrics in the KFP UI."""
    import os

    from prmflow.pipelines.shim import artifact_metadata, run_stage

    paths = {"policy": os.path.join(policy.path, policy_subdir), "baseline": baseline.path, "prm": prm_model.path,
             "output": results.path}
    metrics = run_stage("evaluate", config, paths, kfp_run_id, tracking_uri, experiment)
    for key, value in artifact_metadata(metrics).items():
        scores.log_metric(key, value)


component = dsl.component(base_image=DEFAULT_GPU_IMAGE)(evaluate)
