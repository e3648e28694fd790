"""`prmflow pipeline run-local`: the pipeline of a config through kfp.local on this machine, a chain of runs
one after another, each task a subprocess (OMP threads split between the rollout shards that run at once)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from ..errors import PrmflowError
from .params import run_arguments


def run_local(spec, params: dict, root: Path, verbose: bool = True, runs: int | None = None) -> tuple[str, str, str | None]:
    """Run the pipeline of `spec` through kfp.local; returns (tracking URI, experiment, parent run id).
    verbose=False: the tasks' output goes to ROOT/run-local.log, the terminal gets one line per task.

    More iterations than one cluster run holds run as the same chain of runs a cluster runs (chain.py), one
    after another here; `runs`: stop after the first `runs` of them. The chain's id names ROOT and the run's
    arguments, so the same command run again (after a stop, a kill or --runs) continues the chain: finished
    tasks hit ROOT/cache, the state is on ROOT/workspace, and its MLflow parent run is the same one."""
    import shutil
    import time
    import uuid
    import warnings

    from kfp import local
    from mlflow.tracking import MlflowClient

    from .. import tracking
    from ..tracking.delivery import find_pipeline_run
    from . import console
    from . import chain, chain_packages
    from .kfp_shim import RUN_ID_ENV
    from .pipeline import build

    # the tasks run as subprocesses: give them an absolute store so they all log to the same one
    given = params.get("tracking_uri") or spec.pipeline.tracking_uri
    tracking.check_store(*tracking.configured_uri(tracking.TrackingConfig(uri=given), "tracking_uri"))  # before a task runs
    params.setdefault("tracking_uri", tracking.resolve_uri(tracking.TrackingConfig(uri=spec.pipeline.tracking_uri)))
    experiment = params.get("experiment", spec.pipeline.experiment)
    root = root.resolve()
    console.check_root(root)  # before kfp.local makes anything there
    # ROOT/workspace stands in for the ReadWriteMany volume. It is passed to the steps as a path, not as
    # kfp.local's workspace_root, which kfp.local (2.17) deletes at the end of every run
    # (pipeline_orchestrator.py); ROOT/cache is kfp.local's cache: a re-run skips the finished steps.
    # kfp.local's own workspace_root (unused by our steps) is named here, under ROOT: left to kfp.local it is a
    # fresh /tmp/kfp-workspace-* per init (config.py), removed only once a pipeline has started, so a run that
    # stopped before that (a bad --param, Ctrl-C while building) left one behind in /tmp every time
    kfp_workspace = root / ".kfp-workspace"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True,
               enable_caching=spec.pipeline.cluster.cache, cache_root=str(root / "cache"),
               workspace_root=str(kfp_workspace))
    # K as a cluster run of this config holds it; a local sft_model / prm_model (which a cluster would refuse to
    # import) is sized as trained in the run, the larger task, so K is never more than a cluster run holds
    sized = dataclasses.replace(spec, pipeline=dataclasses.replace(spec.pipeline, sft_model="", prm_model=""))
    segments = chain.segments(spec.pipeline.iterations, chain_packages.per_run(sized))
    before = os.environ.get(RUN_ID_ENV)
    t0 = time.monotonic()
    log_path = root / "run-local.log"
    shown = contextlib.nullcontext() if verbose else console.task_log(log_path)
    with warnings.catch_warnings(), console.root_logger_restored(detach=not verbose), shown as task_log, \
            console.parallel_task_records_kept():
        # kfp.local's notes that it ignores the cluster settings (images, GPUs, node pools) here, per task
        warnings.filterwarnings("ignore", message=".*(non-Python base image|have no effect in the current local runner).*")
        try:
            chain_id = ""
            for seg in segments[:runs]:
                run_id = uuid.uuid4().hex
                os.environ[RUN_ID_ENV] = run_id  # the steps' parent run; not a cache-key input
                pipeline_fn = build(spec, shard_threads=local_shard_threads(spec.pipeline.rollout_shards),
                                    workspace=str(root / "workspace"), run_id=run_id,
                                    segment=seg if len(segments) > 1 else None)
                defaults = {name: inp.default for name, inp in pipeline_fn.component_spec.inputs.items()}
                arguments = run_arguments(defaults, params)  # a stage's --param merges into its section, as on a cluster
                arguments.pop(chain.FIRST_PARAM, None)  # the segment's own, compiled in as the default
                if not chain_id:  # this ROOT, these arguments, this DAG: the same command continues the same chain
                    chain_id = chain.chain_id(str(root), spec.stages, arguments, chain.shape_key(spec),
                                              spec.pipeline.iterations)
                if len(segments) > 1:
                    line = f"run {seg.index + 1}/{seg.count} of the chain: iterations {seg.first}..{seg.end - 1} of {seg.total}"
                    print(line, flush=True)  # the log's, and with one line per task, the terminal's too
                    if task_log is not None:
                        print(line, file=task_log.console, flush=True)
                try:
                    pipeline_fn(**{**arguments, chain.CHAIN_ID_PARAM: chain_id})
                except RuntimeError as e:  # kfp.local (raise_on_error): "Pipeline 'prmflow' finished with status FAILURE ..."
                    if "finished with status" not in str(e):
                        raise
                    raise TaskFailed("run-local: a task failed; its error is above. Fix it and run the same command "
                                     "again (it continues where it stopped).") from None
        finally:
            shutil.rmtree(kfp_workspace, ignore_errors=True)
            if before is None:
                os.environ.pop(RUN_ID_ENV, None)
            else:
                os.environ[RUN_ID_ENV] = before
    print(f"pipeline finished in {time.monotonic() - t0:.0f} s; artifacts under {root}; runs in {params['tracking_uri']}"
          + ("" if verbose else f"; full log: {log_path}"))
    # this run's own parent, found by the id its tasks were given: not the experiment's newest pipeline run, which
    # may be another pipeline's logging to the same store
    parent = find_pipeline_run(MlflowClient(params["tracking_uri"]), experiment, run_id)
    if runs is not None and runs < len(segments):
        print(f"stopped after {runs} of the chain's {len(segments)} runs (--runs); the same command without --runs "
              f"continues from iteration {segments[runs - 1].end}")
    return params["tracking_uri"], experiment, parent


class TaskFailed(PrmflowError):
    """A task of a local pipeline run failed; what it raised is shown above this error."""

    exit_code = 1


#: How many ParallelFor iterations kfp.local (2.17) runs at once (its orchestrator's cap).
KFP_LOCAL_PARALLEL = 2


def local_shard_threads(shards: int, environ=os.environ) -> int | None:
    """Threads per rollout shard under kfp.local: the cores this process may use, split between the shards
    that run at once; None (torch's default) for one shard, or when OMP_NUM_THREADS is set (the user's)."""
    if shards < 2 or environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // min(shards, KFP_LOCAL_PARALLEL))


def print_summary(uri: str, experiment: str, parent: str | None) -> None:
    from mlflow.tracking import MlflowClient

    from .summary import format_table, pipeline_rows

    if parent is None:  # tracking turned off
        return
    print(f"\nMLflow run {parent} (experiment {experiment}):")
    print(format_table(pipeline_rows(MlflowClient(uri), parent)))
    print()
