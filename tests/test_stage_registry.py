"""The stage registry (prmflow/stages.py) is the one list of stages, and every stage it names has the
parts its docstring lists: a module with a documented Config and run(), a README with its config
table, a `prmflow` subcommand, and for a pipeline stage a KFP component that runs it. (Its task in
the compiled DAG: tests/pipelines/test_prm_update_dag.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest

from prmflow import cli, docs, stages
from prmflow.components import config as config_lib
from prmflow.pipelines import kfp_components as components


def missing_parts(name: str) -> list[str]:
    """What stage `name` of the registry lacks of the parts stages.py's docstring lists, each said so."""
    module = stages.load(name)
    if module is None:
        return [f"its module {stages.STAGES[name].module} (not importable)"]
    missing = []
    cls = getattr(module, "Config", None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        missing.append("a Config dataclass")
    else:
        missing += [f"a docstring under Config key '{key}'" for key, (_, doc, _) in config_lib.flat_fields(cls).items()
                    if not doc.strip()]
    if not callable(getattr(module, "run", None)):
        missing.append("run(config)")
    if not (module.__doc__ or "").strip():
        missing.append("a module docstring (its first paragraph is the `prmflow --help` line)")
    try:
        readme = docs.readme_path(module)
    except ValueError:
        missing.append(f"a folder under {docs.COMPONENTS} (its module is {module.__name__})")
    else:
        if not readme.is_file() or docs.start_marker(name) not in readme.read_text(encoding="utf-8"):
            missing.append(f"{readme} with '{docs.start_marker(name)}'")
    _, subcommands = cli.build_parser([])
    if name not in subcommands:
        missing.append("a `prmflow` subcommand")
    if stages.STAGES[name].pipeline:
        shim = getattr(components, stages.component(name), None)
        if shim is None:
            missing.append(f"its KFP component pipelines/kfp_components.py:{stages.component(name)}")
        elif f'run_stage("{name}"' not in inspect.getsource(shim):
            missing.append(f"a call of run_stage(\"{name}\", ...) in pipelines/kfp_components.py:{stages.component(name)}")
    return missing


@pytest.mark.parametrize("name", list(stages.STAGES))
def test_every_registered_stage_has_its_parts(name):
    assert missing_parts(name) == []


def test_the_pipeline_stages_are_the_registry_in_its_order():
    assert stages.PIPELINE_STAGES == tuple(n for n in stages.STAGES if stages.STAGES[n].pipeline)
    assert stages.PIPELINE_STAGES == ("sft", "prm", "rollout", "prm-update", "advantage", "ppo", "evaluate")
    # no second list of stages beside the registry (pipelines/kfp_components.py had one, unused, with prm_update)
    assert not hasattr(components, "STAGES")


def test_a_stage_registered_without_its_parts_is_named_with_each_missing_part(tmp_path, monkeypatch):
    """A stage added with its registry line and a module only: the check names the README, the
    undocumented key and the KFP component (the CLI picks the stage up from the registry by itself)."""
    (tmp_path / "halfstage.py").write_text(
        '"""Do half a job."""\n'
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\nclass Config:\n    output: str = ''\n    \"\"\"Where it goes.\"\"\"\n    steps: int = 1\n\n\n"
        "def run(cfg):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "halfstage", raising=False)
    monkeypatch.setitem(stages.STAGES, "half-stage", stages.Stage("halfstage"))
    got = missing_parts("half-stage")
    assert got == ["a docstring under Config key 'steps'", f"a folder under {docs.COMPONENTS} (its module is halfstage)",
                   "its KFP component pipelines/kfp_components.py:half_stage"]
