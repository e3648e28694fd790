"""The stage READMEs' config tables are generated from the Config docstrings and kept up to date."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Literal

import pytest

from prmflow import docs, stages
from prmflow.components.common import config

STAGES = stages.available()


@pytest.mark.parametrize("name", list(STAGES))
def test_readme_table_matches_the_config(name):
    module = STAGES[name]
    path = docs.readme_path(module)
    assert path.is_file(), f"stage `{name}` has no README at {path}"
    text = path.read_text(encoding="utf-8")
    expected = docs.with_table(text, name, docs.config_table(module.Config), where=str(path))
    assert text == expected, f"{path}: the config table of `{name}` is out of date; run `python -m prmflow.docs`"


@pytest.mark.parametrize("name", list(STAGES))
def test_every_key_has_a_described_row(name):
    table = docs.config_table(STAGES[name].Config)
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ")[-1].rstrip(" |") for line in table.splitlines()[2:]}
    assert set(rows) == set(config.flat_dict(STAGES[name].Config()))  # the keys as MLflow params log them
    undocumented = [key for key, description in rows.items() if not description]
    assert not undocumented, f"{name}: give these Config fields a docstring: {undocumented}"


@dataclass
class Inner:
    depth: int = 2
    """How deep."""


@dataclass
class Example:
    mode: Literal["fast", "exact"] = "fast"
    """Speed or exactness."""
    switch: bool | None = None
    """On, off, or empty: decided at run time."""
    names: list[str] = field(default_factory=lambda: ["a"])
    """Names a | b."""
    inner: Inner = field(default_factory=Inner)
    """Nested section."""


def test_table_rows():
    assert docs.config_table(Example).splitlines() == [
        "| key | type | default | description |",
        "|---|---|---|---|",
        "| `mode` | fast, exact | `'fast'` | Speed or exactness. |",
        "| `switch` | bool or empty | empty | On, off, or empty: decided at run time. |",
        "| `names` | list of str | `['a']` | Names a \\| b. |",  # a bare | would split the cell
        "| `inner.depth` | int | `2` | How deep. |",
    ]


def test_only_the_marked_block_changes():
    text = "# s\nprose\n<!-- config-table:start s -->\nold table\n<!-- config-table:end -->\nmore prose\n"
    assert docs.with_table(text, "s", "| new |") == (
        "# s\nprose\n<!-- config-table:start s -->\n| new |\n<!-- config-table:end -->\nmore prose\n")
    with pytest.raises(ValueError, match="config-table:start other.*python -m prmflow.docs"):
        docs.with_table(text, "other", "| new |", where="x/README.md")


def test_check_names_the_stale_readme_and_the_write_fixes_it(tmp_path, monkeypatch, capsys):
    module = STAGES["advantage"]
    original = docs.readme_path(module)
    readme = tmp_path / "README.md"
    shutil.copy(original, readme)
    drifted = readme.read_text(encoding="utf-8").replace("| `lam` |", "| `lambda` |")
    readme.write_text(drifted, encoding="utf-8")
    monkeypatch.setattr(stages, "available", lambda: {"advantage": module})
    monkeypatch.setattr(docs, "readme_path", lambda m: readme)

    assert docs.main(["--check"]) == 1
    assert f"{readme}: config table out of date; run `python -m prmflow.docs`" in capsys.readouterr().err
    assert readme.read_text(encoding="utf-8") == drifted  # --check writes nothing
    assert docs.main([]) == 0
    assert readme.read_text(encoding="utf-8") == original.read_text(encoding="utf-8")  # prose kept, table fixed
    assert docs.main(["--check"]) == 0
