"""KFP component: the evaluate stage. A shim over prmflow.components.evaluate.stage.run."""

from kfp.dsl import Input, Metrics, Model, Output


def evaluate(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, policy: Input[Model],
             policy_subdir: str, baseline: Input[Model], prm_model: Input[Model], results: Output[Model],
             scores: Output[Metrics]):
    """Evaluate the final policy; `scores` shows the eval metrics in the KFP UI."""
    import os

    from prmflow.components.common.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.evaluate import stage

    paths = {"policy": os.path.join(policy.path, policy_subdir), "baseline": baseline.path, "prm": prm_model.path,
             "output": results.path}
    metrics = run_stage("evaluate", stage, config, paths, kfp_run_id, tracking_uri, experiment)
    for key, value in artifact_metadata(metrics).items():
        scores.log_metric(key, value)
