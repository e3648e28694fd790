"""The stage registry: every stage prmflow runs, in pipeline order, and the module that implements it.

The one list of stages: the `prmflow` command makes one subcommand per available stage, the docs
generator one README table per stage, the pipeline checks each stage section of its YAML against the
stage's Config and finds each task's KFP component by the stage's name. Adding a stage takes its line
in `STAGES` and these parts (tests/test_stage_registry.py fails, naming the part, when one is missing):

1. The module named there: a `Config` dataclass with a one-line docstring under every field (they
   are `prmflow NAME --help` and the README table), `run(config)`, and a module docstring whose first
   paragraph is the one-line summary `prmflow --help` shows and whose `prmflow NAME ...` commands
   parse (tests/test_cli.py). The command line then needs nothing more.
2. The README.md of its folder under prmflow/components/ (a new folder: a new stage package; the
   layering test reads the packages from here) with the markers `<!-- config-table:start NAME -->`
   and `<!-- config-table:end -->`; `python -m prmflow.docs` writes the table between them.
3. For a pipeline stage (`pipeline=True`): its KFP component in pipelines/kfp_components.py, a function
   named `component(NAME)` (the name with '_' for '-') that calls `kfp_shim.run_stage("NAME", ...)`;
   its task in pipelines/pipeline.py's `build` (its image, inputs, and its GPUs in `gpu_counts`
   with a `pipeline.cluster.gpus` key in pipelines/settings.py when it runs on a GPU); and, when it
   writes weights to the workspace, its name in pipelines/compat.py (LOCATION_PRODUCERS,
   WORKSPACE_WRITERS) and pipelines/plan.py (bytes moved), and in settings.TRAINJOB_STAGES when it
   may run as a Kubeflow Trainer TrainJob.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Stage:
    """Where a stage lives and whether the KFP pipeline runs it."""

    module: str
    """The module with `Config` and `run(config)`."""
    pipeline: bool = True
    """A task of the KFP pipeline, configured by its section of a pipeline YAML."""


#: Stage name (the subcommand and the pipeline YAML section) -> where it lives, in the order the pipeline
#: runs them (prm-update only with pipeline.prm_update). prm-label is no pipeline task: it relabels
#: rollouts offline, by hand, when a PRM needs labels without a checker.
STAGES = {
    "sft": Stage("prmflow.components.sft.stage"),
    "prm": Stage("prmflow.components.prm.stage"),
    "prm-label": Stage("prmflow.components.prm.label", pipeline=False),
    "rollout": Stage("prmflow.components.rollout.stage"),
    "prm-update": Stage("prmflow.components.prm.online_update"),
    "advantage": Stage("prmflow.components.advantage.stage"),
    "ppo": Stage("prmflow.components.ppo.stage"),
    "evaluate": Stage("prmflow.components.evaluate.stage"),
}

#: The stages the KFP pipeline runs, each configured by its section of a pipeline YAML.
PIPELINE_STAGES = tuple(name for name, stage in STAGES.items() if stage.pipeline)


def component(name: str) -> str:
    """The name of pipeline stage `name`'s KFP component function in pipelines/kfp_components.py."""
    return name.replace("-", "_")


def available() -> dict[str, ModuleType]:
    """{name: imported stage module} for the stages this build has, in pipeline order.

    A stage whose module is absent (a build without it) is left out; any other import error, such
    as a missing dependency inside a stage that is present, is raised."""
    return {name: module for name in STAGES if (module := load(name)) is not None}


def load(name: str) -> ModuleType | None:
    """The imported module of stage `name`, or None when this build lacks it (see `available`)."""
    module = STAGES[name].module
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            return None
        raise
