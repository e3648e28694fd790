"""`prmflow pipeline step`: one step of a KFP run, in its pod, run from the image's installed prmflow.

A compiled spec's steps call this instead of carrying each function's Python source (a lightweight
component ships it in every pod-spec patch, which the running workflow stores for every node: size.py).
"""

from __future__ import annotations

from .. import stages
from ..errors import ConfigError


def step_functions() -> dict:
    """{name: function} of every step a compiled spec runs with `prmflow pipeline step` (pipeline.STEP_COMMAND)."""
    from . import kfp_components as components, lineage

    fns = [getattr(components, stages.component(s)) for s in stages.PIPELINE_STAGES] + [
        components.locate, components.chain_resume, components.chain_next, lineage.init_tracking, lineage.finish_tracking]
    return {f.__name__: f for f in fns}


def run(args) -> int:
    """One step of a KFP run, in its pod: KFP's executor runs the function from the installed prmflow, as
    `python -m kfp.dsl.executor_main` runs it from the source a lightweight component ships in the spec."""
    import json as json_lib

    from kfp.dsl import executor

    fn = step_functions().get(args.function_to_execute)
    if fn is None:
        raise ConfigError(f"--function_to_execute {args.function_to_execute!r} is no prmflow step; the steps are "
                          f"{', '.join(sorted(step_functions()))}. The pod's image may be older than the compiled spec.")
    try:
        executor_input = json_lib.loads(args.executor_input)
    except ValueError as e:
        raise ConfigError(f"--executor_input is not JSON ({e}); it is KFP's executor input, passed by the launcher.") from None
    executor.Executor(executor_input=executor_input, function_to_execute=fn).execute()
    return 0
