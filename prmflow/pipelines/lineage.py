"""The pipeline's own KFP steps: open the MLflow parent run, and close it from the exit handler."""


from kfp import dsl


def init_tracking(kfp_run_id: str, tracking_uri: str, experiment: str, sft_config: dict, prm_config: dict,
                  rollout_config: dict, advantage_config: dict, ppo_config: dict, evaluate_config: dict,
                  run_name: str = "") -> str:
    """Create the MLflow parent run of this pipeline run, tagged with the KFP run id; returns its id.

    Every stage's config is resolved here (defaults filled in, types coerced, unknown keys refused), so
    a bad key fails the pipeline in its first CPU step rather than hours later on a GPU node, and the
    parent run's params are the full, typed configuration (`sft.max_steps` = 12, not the 12.0 a KFP
    struct parameter turns it into).

    The stage configs come as separate parameters: kfp.local pastes a dict that *contains* pipeline
    parameters into its executor JSON unescaped, which breaks the step.
    """
    from prmflow import stages
    from prmflow.components.common import config as config_lib
    from prmflow.components.common import tracking

    cfg = tracking.TrackingConfig(uri=tracking_uri, experiment=experiment, pipeline_run_id=kfp_run_id,
                                  run_name=run_name)
    sections = {"sft": sft_config, "prm": prm_config, "rollout": rollout_config, "advantage": advantage_config,
                "ppo": ppo_config, "evaluate": evaluate_config}
    flat, available = {}, stages.available()
    for section, values in sections.items():
        if section not in available:
            continue
        resolved = config_lib.build(available[section].Config, config_lib.flatten(dict(values or {})),
                                    where=f"pipeline config section '{section}'")
        flat.update({f"{section}.{key}": value for key, value in config_lib.flat_dict(resolved).items()
                     if not key.startswith("tracking.")})
    run = tracking.start_pipeline_run(cfg, params=flat)
    return run.run_id


def finish_tracking(kfp_run_id: str, tracking_uri: str, experiment: str, status: dsl.PipelineTaskFinalStatus):
    """Exit handler: mark the parent run FINISHED or FAILED and copy the children's eval/* metrics onto it.

    The evaluate stage's keep their names (eval/accuracy, ...); another stage's are filed under the
    stage (sft/accuracy, prm/step_auc), so the parent compares runs without one stage's metric
    shadowing another's."""
    from mlflow.tracking import MlflowClient

    from prmflow.components.common import tracking

    cfg = tracking.TrackingConfig(uri=tracking_uri, experiment=experiment, pipeline_run_id=kfp_run_id)
    state = "FINISHED" if status.state == "SUCCEEDED" else "FAILED"
    client = MlflowClient(tracking.resolve_uri(cfg))
    parent = tracking.find_pipeline_run(client, experiment, kfp_run_id)
    metrics = {}
    if parent:
        exp = client.get_experiment_by_name(experiment)
        children = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
        for child in sorted(children, key=lambda r: r.info.start_time):  # later runs win
            stage = child.data.tags.get("prmflow.stage", "")
            for key, value in child.data.metrics.items():
                if key.startswith("eval/"):  # the evaluate stage's own names; others' under their stage
                    metrics[key if stage == "evaluate" else f"{stage}/{key[len('eval/'):]}"] = value
    tracking.finish_pipeline_run(cfg, state, metrics)
    print(f"pipeline run {kfp_run_id}: {state}, MLflow parent run {parent}")
