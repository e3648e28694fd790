"""The pipeline's own KFP steps: open the MLflow parent run, and close it from the exit handler."""


from kfp import dsl


def init_tracking(kfp_run_id: str, tracking_uri: str, experiment: str, sft_config: dict, prm_config: dict,
                  rollout_config: dict, advantage_config: dict, ppo_config: dict, evaluate_config: dict,
                  run_name: str = "", chain_id: str = "", first_iteration: int = 0) -> str:
    """Create the MLflow parent run of this pipeline run, tagged with the KFP run id; returns its id. With a
    `chain_id` (a run of a chain, or a run started again), the chain's parent run is reused when it exists:
    one parent for every run of the chain, the stage runs of earlier attempts (the cache's hits) under it.

    Every stage's config is resolved here (defaults filled in, types coerced, unknown keys refused), so
    a bad key fails the pipeline in its first CPU step rather than hours later on a GPU node, and the
    parent run's params are the full, typed configuration (`sft.max_steps` = 12, not the 12.0 a KFP
    struct parameter turns it into).

    The stage configs come as separate parameters: kfp.local pastes a dict that *contains* pipeline
    parameters into its executor JSON unescaped, which breaks the step.
    """
    from prmflow import stages
    from prmflow.components import config as config_lib
    from prmflow.components.runtime import shutdown
    from prmflow import tracking

    shutdown.freeze_objects_at_exit()  # this task's process ends with this function
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
        # a stage that leaves the keys of its parts that are off out of its own run's params (ppo) does so here too
        params_of = getattr(available[section], "used_params", config_lib.flat_dict)
        flat.update({f"{section}.{key}": value for key, value in params_of(resolved).items()
                     if not key.startswith("tracking.")})
    run = tracking.start_pipeline_run(cfg, params=flat, chain_id=chain_id, first_iteration=first_iteration)
    return run.run_id


def finish_tracking(kfp_run_id: str, tracking_uri: str, experiment: str, status: dsl.PipelineTaskFinalStatus,
                    chain_id: str = "", first_iteration: int = 0, iterations: int = 0, last: bool = True):
    """Exit handler: mark the parent run FINISHED or FAILED, log its summary metrics and register its models.
    A run of a chain that is not the `last` leaves the chain's parent RUNNING when it succeeds, and logs only
    its own iterations' points [first_iteration, first_iteration + iterations) (0 iterations: all).

    See pipelines/summary.py: the training stages' held-out metrics (sft/eval_accuracy, prm/eval_*),
    reward, accuracy and KL to SFT per RL iteration (pipeline/*, step = iteration), and, for a
    FINISHED run, the final policy and the PRM in the Model Registry (<experiment>-policy, -prm)."""
    from mlflow.tracking import MlflowClient

    from prmflow.components.runtime import shutdown
    from prmflow import tracking
    from prmflow.pipelines.summary import parent_summary, register_models
    from prmflow.tracking import kfp_plugin

    shutdown.freeze_objects_at_exit()
    cfg = tracking.TrackingConfig(uri=tracking_uri, experiment=experiment, pipeline_run_id=kfp_run_id)
    state = "FINISHED" if status.state == "SUCCEEDED" else "FAILED"
    ending = state == "FAILED" or last
    uri = tracking.resolve_uri(cfg)
    kfp_plugin.target(uri)  # on another server than KFP's: without the auth KFP set for its own
    client = MlflowClient(uri)
    parent = tracking.find_pipeline_run(client, experiment, kfp_run_id)
    metrics, series = parent_summary(client, parent) if parent else ({}, [])
    if iterations:  # a chain's earlier runs logged theirs
        series = [p for p in series if first_iteration <= p[2] < first_iteration + iterations]
    if parent:  # a run started again (all cache hits) logs no point its parent already has: one curve
        logged = {key: {m.step for m in client.get_metric_history(parent, key)} for key in {p[0] for p in series}}
        series = [p for p in series if p[2] not in logged[p[0]]]
    tracking.finish_pipeline_run(cfg, state if ending else None, metrics if ending else {}, series)
    registered = register_models(uri, experiment, parent) if parent and state == "FINISHED" and last else {}
    print(f"pipeline run {kfp_run_id}: {state if ending else 'SUCCEEDED (the chain goes on)'}, MLflow parent run {parent}"
          + "".join(f"; registered {name} version {v}" for name, v in registered.items()))
