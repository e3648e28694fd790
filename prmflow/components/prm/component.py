"""KFP component: the prm stage. A shim over prmflow.components.prm.stage.run (see stage.py)."""

from kfp.dsl import Input, Model, Output


def prm(config: dict, kfp_run_id: str, tracking_uri: str, experiment: str, base: Input[Model],
        prm_model: Output[Model]):
    """Train the process reward model; `prm_model` is its HF token-classification directory.

    The backbone is `base` (the SFT policy) unless the config names its own `backbone` (or the old key
    `model_path`)."""
    from prmflow.components.common.kfp_shim import artifact_metadata, run_stage
    from prmflow.components.prm import stage

    paths = {"output": prm_model.path}
    if not any((config or {}).get(k) for k in ("backbone", "model_path")):
        paths["backbone"] = base.path
    metrics = run_stage("prm", stage, config, paths, kfp_run_id, tracking_uri, experiment)
    prm_model.metadata.update(artifact_metadata(metrics))
