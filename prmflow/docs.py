"""Stage README config tables, generated from the stages' Config docstrings.

    python -m prmflow.docs            # rewrite the table in every stage README (and docs/submitting.md's)
    python -m prmflow.docs --check    # exit 1, naming each README whose table is out of date

The one-line docstring under each Config field is the documentation of that key: `prmflow STAGE
--help` prints it, and this module renders it, with the key's type and default, as the Markdown
table between `<!-- config-table:start STAGE -->` and `<!-- config-table:end -->` in the stage's
README (prmflow/components/<folder>/README.md); docs/submitting.md holds two sections of the pipeline: config
(PAGE_TABLES) the same way. Everything outside the markers is hand-written prose
and is left as it is. tests/test_docs.py fails when a table no longer matches its Config, so a key
added, renamed or re-documented means running the command above, never editing a table by hand.

Sits above the stages (it reads the stage registry); nothing in prmflow imports it.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path

from . import stages
from .components import config as config_lib

COMPONENTS = Path(__file__).resolve().parent / "components"
DOCS = Path(__file__).resolve().parent.parent / "docs"
#: Tables of the pipeline: config outside the stage READMEs: page -> (marker name, config class), the class
#: named by its attribute of pipelines/settings.py (imported when the tables are made).
PAGE_TABLES = {DOCS / "submitting.md": (("pipeline.images", "ImagesConfig"), ("pipeline.cluster.trainer", "TrainerConfig"))}
COMMAND = "python -m prmflow.docs"
END = "<!-- config-table:end -->"


def start_marker(stage: str) -> str:
    """The comment that opens `stage`'s generated table (a README may hold several stages: prm, prm-label)."""
    return f"<!-- config-table:start {stage} -->"


def type_name(typ: typing.Any) -> str:
    """How a key's type reads in a table: choices for a Literal, 'X or empty' for an optional X."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Literal:
        return ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kinds = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or empty" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or typ is dict:
        return "mapping"
    return getattr(typ, "__name__", str(typ))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell


def config_table(cls: type) -> str:
    """A Markdown table with one row per (dotted) key of `cls`: key, type, default, description."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, (typ, doc, default) in config_lib.flat_fields(cls).items():
        shown = "empty" if default is None else f"`{default!r}`"
        rows.append(f"| `{key}` | {_cell(type_name(typ))} | {_cell(shown)} | {_cell(doc)} |")
    return "\n".join(rows)


def readme_path(module: types.ModuleType) -> Path:
    """The README of the component folder that holds a stage module (prm and prm-label share prm/)."""
    folder = Path(module.__file__).resolve().relative_to(COMPONENTS).parts[0]
    return COMPONENTS / folder / "README.md"


def with_table(text: str, stage: str, table: str, where: str = "README.md") -> str:
    """`text` with the block between `stage`'s markers replaced by `table`; the rest is kept as it is."""
    block = re.compile(re.escape(start_marker(stage)) + r"\n.*?" + re.escape(END), re.DOTALL)
    if len(block.findall(text)) != 1:
        raise ValueError(f"{where} needs exactly one block '{start_marker(stage)}' ... '{END}' (each on its own "
                         f"line) where the config table of `{stage}` belongs; add it, then run `{COMMAND}`.")
    return block.sub(lambda _: f"{start_marker(stage)}\n{table}\n{END}", text)


def rendered() -> dict[Path, str]:
    """Every stage README as it should read: its text with each of its stages' tables regenerated."""
    out: dict[Path, str] = {}
    for name, module in stages.available().items():
        path = readme_path(module)
        if path not in out:
            if not path.is_file():
                raise ValueError(f"{path} is missing: stage `{name}` needs a README with its config table "
                                 f"between '{start_marker(name)}' and '{END}'.")
            out[path] = path.read_text(encoding="utf-8")
        out[path] = with_table(out[path], name, config_table(module.Config), where=str(path))
    from .pipelines import settings

    for path, tables in PAGE_TABLES.items():
        if path.is_file():  # an installed package has no docs/ beside it
            out[path] = path.read_text(encoding="utf-8")
            for name, cls in tables:
                out[path] = with_table(out[path], name, config_table(getattr(settings, cls)), where=str(path))
    return out


def out_of_date() -> dict[Path, str]:
    """README -> the text it should have, for each README whose tables differ from their stages' Configs."""
    return {path: text for path, text in rendered().items() if path.read_text(encoding="utf-8") != text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    try:
        stale = out_of_date()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, text in stale.items():
        if args.check:
            print(f"{path}: config table out of date; run `{COMMAND}`", file=sys.stderr)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
