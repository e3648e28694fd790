"""The stage registry: every stage prmflow runs, in pipeline order, and the module that implements it.

A stage module has a `Config` dataclass and `run(config)`. The `prmflow` command makes one
subcommand per available stage, and the pipeline checks each stage section of its YAML against the
stage's Config; both read the stages from here, so adding a stage is one line in `STAGES`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Stage name (the subcommand and the pipeline YAML section) -> module with `Config` and `run(config)`.
STAGES = {
    "sft": "prmflow.components.sft.stage",
    "prm": "prmflow.components.prm.stage",
    "prm-label": "prmflow.components.prm.label",
    "prm-update": "prmflow.components.prm.online_update",
    "rollout": "prmflow.components.rollout.stage",
    "advantage": "prmflow.components.advantage.stage",
    "ppo": "prmflow.components.ppo.stage",
    "evaluate": "prmflow.components.evaluate.stage",
}

#: The stages the KFP pipeline runs, each configured by its section of a pipeline YAML (prm-update only
#: with pipeline.prm_update). prm-label is not one of them: it relabels rollouts offline, by hand, when a
#: PRM needs labels without a checker.
PIPELINE_STAGES = ("sft", "prm", "rollout", "prm-update", "advantage", "ppo", "evaluate")


def available() -> dict[str, ModuleType]:
    """{name: imported stage module} for the stages this build has, in pipeline order.

    A stage whose module is absent (a build without it) is left out; any other import error, such
    as a missing dependency inside a stage that is present, is raised."""
    return {name: module for name in STAGES if (module := load(name)) is not None}


def load(name: str) -> ModuleType | None:
    """The imported module of stage `name`, or None when this build lacks it (see `available`)."""
    module = STAGES[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            return None
        raise
