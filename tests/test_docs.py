"""The docs say what the code does.

The stage READMEs' config tables are generated from the Config docstrings and kept up to date; the
README and every hand-written page (docs/, the stage READMEs, benchmarks/README.md) quote only
`prmflow` commands, options, config keys and repository paths that exist, and links that resolve;
the README stays a front door (<= 10 KB) that runs CI's own test command; docs/layout.md's tree
names every folder of the package.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from prmflow import cli, docs, stages
from prmflow.components import config
from prmflow.pipelines import settings

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


# ---------------------------------------------------------------------------------------------------
# The README and docs/: every command, config key, repository path and link they quote exists.
# ---------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every hand-written page: the README, docs/ with its experiment logs, every README in the package, the benchmarks'.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "prmflow").rglob("README.md")),
         ROOT / "benchmarks" / "README.md"]
README_LIMIT = 10 * 1024  # bytes: a front door, not a lab notebook; the rest belongs in docs/

FENCE = re.compile(r"^[ \t]*```([\w-]*)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
SHELL = {"", "bash", "sh", "shell", "console"}
UNLABELLED_COMMANDS = {"prmflow", "python", "python3", "torchrun", "docker", "podman", "pytest", "pip"}
#: Where a quoted path may live: the repository's top folders, or (for `advantage/token_rewards.py`-style
#: paths, as design.md writes them) the package and its components. A relative path with a source
#: suffix is always checked; a folder (`advantage/`) when it starts with one of the package's folders.
TOP_FOLDERS = ("configs/", "prmflow/", "tests/", "benchmarks/", "images/", "docs/", ".ci/")
PACKAGE_FOLDERS = {"sft", "prm", "rollout", "advantage", "ppo", "evaluate", "common", "tasks", "tracking", "pipelines"}
SOURCE_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".env", ".png")
#: A code span's last part with one of these is a file name (`pipeline.yaml`), not a config key.
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "parquet", "txt", "html", "png", "log", "db", "env",
                 "sh", "toml", "safetensors"}


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced code blocks (spans and links are read from the prose only)."""
    return FENCE.sub("", text)


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, dedented body) of every fenced code block, indented ones (inside a list) included."""
    return [(lang, textwrap.dedent(body)) for lang, body in FENCE.findall(text)]


def spans(text: str) -> list[str]:
    return SPAN.findall(prose(text))


def tokenize(line: str) -> list[str]:
    """Shell words of one command line; `<placeholders>` become one word, comments are dropped."""
    line = re.sub(r"<[^<>]+>", "PLACEHOLDER", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def commands(line: str) -> list[list[str]]:
    """The `prmflow ...` commands (arguments after `prmflow`) in one shell line: each `&&`/`;`/`|`
    segment that runs prmflow (directly, through `python -m prmflow.cli`, torchrun, a container's
    `-- prmflow`, or `docker run ... prmflow-cpu:TAG` whose entrypoint it is); a redirect ends the arguments, and
    `...` stands for arguments left out."""
    out, segment = [], []
    for tok in [*tokenize(line), ";"]:
        if tok and set(tok) <= set(";&|()<>"):
            image = next((i for i, t in enumerate(segment) if re.search(r"prmflow-(cpu|gpu)", t)), None)
            if "prmflow" in segment or "prmflow.cli" in segment:
                start = segment.index("prmflow" if "prmflow" in segment else "prmflow.cli") + 1
            elif segment[:2] in (["docker", "run"], ["podman", "run"]) and image is not None:
                start = image + 1  # the image's entrypoint is prmflow: the words after the image are its arguments
            else:
                start = None
            args = segment[start:] if start is not None else []
            if start is not None and not (args and args[0].endswith(":")):  # `prmflow pipeline: error: ...` is a message
                out.append([t for t in args if t != "..." and not t.startswith("[")])
            segment = [] if tok != ">" else ["REDIRECT"]
        elif segment[:1] != ["REDIRECT"]:
            segment.append(tok)
    return out


def shell_lines(text: str) -> list[str]:
    """Every command line of the page: shell code blocks (continuations joined) and inline spans that
    start with a command."""
    lines = []
    for lang, body in fenced(text):
        if lang in SHELL:
            found = [ln for ln in body.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            # a block with no language is shell only where a line starts with a command (not a file tree)
            lines += found if lang else [ln for ln in found if ln.split()[0] in UNLABELLED_COMMANDS]
    lines += [s for s in spans(text) if re.match(r"(prmflow|python -m prmflow\.cli|torchrun) ", s)]
    return lines


def quoted_commands() -> list[tuple[str, list[str]]]:
    return [(page_id(p), argv) for p in PAGES for line in shell_lines(p.read_text(encoding="utf-8"))
            for argv in commands(line)]


def is_placeholder(word: str) -> bool:
    return word == "PLACEHOLDER" or word.isupper()


def parse(argv: list[str]) -> tuple[object, str]:
    """(parsed args, '') as `prmflow` parses argv, or (None, argparse's complaint); --help parses as 'help'."""
    parser, _ = cli.build_parser(argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv), ""
        except SystemExit as e:
            return ("help", "") if e.code in (0, None) else (None, err.getvalue().strip().splitlines()[-1])


def config_classes() -> dict[str, type]:
    """Section name -> its config class: one per stage, and `pipeline`."""
    return {**{name: module.Config for name, module in STAGES.items()}, "pipeline": settings.PipelineConfig}


def is_mapping(typ: typing.Any) -> bool:
    """A dict-typed key (`node_selector`, `tags`): any sub-key inside it is the user's own."""
    return typ is dict or typing.get_origin(typ) is dict or any(is_mapping(a) for a in typing.get_args(typ))


def key_problem(cls: type, key: str) -> str | None:
    """None when `key` is a key of `cls`, a section of it (`optim`), or inside a mapping-typed key; else why not."""
    fields = config.flat_fields(cls)
    if key in fields or any(k.startswith(key + ".") for k in fields):
        return None
    if any(key.startswith(k + ".") and is_mapping(typ) for k, (typ, _, _) in fields.items()):
        return None
    return f"`{key}` is not a key of {cls.__name__}"


def repo_path_problem(word: str) -> str | None:
    """None when `word` is not a repository path or names one that exists, else what is missing."""
    word = word.rstrip(".,;:")
    if any(c in word for c in "<>$~*{}[] ") or "://" in word or word.startswith("/"):
        return None
    if word.startswith(TOP_FOLDERS):
        candidates = [ROOT / word]
    elif "/" in word and (word.endswith(SOURCE_SUFFIXES) or (word.endswith("/") and word.split("/")[0] in PACKAGE_FOLDERS)):
        candidates = [ROOT / "prmflow" / word, ROOT / "prmflow" / "components" / word]
    else:
        return None
    return None if any(c.exists() for c in candidates) else f"`{word}` does not exist"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_quoted_command_parses(page):
    """Each `prmflow ...` line a page quotes is accepted by prmflow's own parser: the subcommand, every
    option, and every `--set KEY=...` key of that stage (or of the pipeline: section)."""
    problems = []
    for line in shell_lines(page.read_text(encoding="utf-8")):
        for argv in commands(line):
            command = next((a for a in argv if not a.startswith("-")), None)
            if command is None or is_placeholder(command):
                continue  # `prmflow <stage> --help`: a pattern, not a command
            args, complaint = parse(argv)
            if args is None and "arguments are required" in complaint and line in spans(page.read_text(encoding="utf-8")):
                continue  # prose naming a command (`prmflow stage-command` uses ...): its name exists, no full call
            if args is None:
                problems.append(f"`prmflow {' '.join(argv)}`: {complaint}")
                continue
            if args == "help":
                continue
            cls = config_classes().get(getattr(args, "stage", None) or "")
            if cls is None and getattr(args, "handler", None) and argv[0] == "pipeline":
                cls = settings.PipelineConfig  # pipeline compile/submit/run-local --set: the pipeline: section
            for item in getattr(args, "set_", None) or getattr(args, "set", None) or []:
                key = item.split("=", 1)[0]
                stage, _, rest = key.partition(".")
                if cls is settings.PipelineConfig and stage in STAGES:  # pipeline --set STAGE.KEY=VALUE
                    why = key_problem(STAGES[stage].Config, rest)
                else:
                    why = key_problem(cls, key) if cls else None
                if why:
                    problems.append(f"`prmflow {' '.join(argv)}`: {why}")
            for word in argv:
                why = repo_path_problem(word)
                if why:
                    problems.append(f"`prmflow {' '.join(argv)}`: {why}")
    assert not problems, f"{page_id(page)} quotes commands prmflow does not accept:\n" + "\n".join(problems)


def test_the_pages_quote_the_main_commands():
    """The command finder sees the quickstart, a stage, stage-command and a pipeline action (so the test
    above checks something)."""
    found = {" ".join(argv[:2]) for _, argv in quoted_commands()}
    assert {"pipeline run-local", "pipeline compile", "pipeline submit", "stage-command ppo"} <= found
    assert any(argv[0] == "sft" for _, argv in quoted_commands())


def quoted_keys(text: str) -> list[str]:
    """Dotted config keys quoted in the prose: `ppo.optim.lr`, `engine.zero_stage`, `head.kind=lm_tokens`
    (the part before a value), `engine.*` (a section)."""
    keys = []
    for span in spans(text):
        m = re.match(r"^([a-z_][\w-]*(?:\.[\w*]+)+)(?:[\s=:].*)?$", span)
        if m and m.group(1).rsplit(".", 1)[-1] not in FILE_SUFFIXES:
            keys.append(m.group(1).removesuffix(".*"))
    return keys


def any_key_problem(key: str) -> str | None:
    """For a key quoted without its stage (`engine.zero_stage`): a key, section or key path of some config."""
    for cls in config_classes().values():
        fields = config.flat_fields(cls)
        if key_problem(cls, key) is None or any(k.endswith("." + key) or (".%s." % key) in f".{k}." for k in fields):
            return None
    return f"`{key}` is not a key of any stage's config or of the pipeline: section"


def nested_sections() -> set[str]:
    """Names that start a dotted key in some config (engine, optim, sampling, cluster, ...)."""
    return {k.split(".")[0] for cls in config_classes().values() for k in config.flat_fields(cls) if "." in k}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_quoted_config_key_exists(page):
    """`stage.key` spans name a key of that stage's Config (or of the pipeline: section); `section.key`
    spans (engine.*, optim.*, cluster.*, ...) a key of some config; YAML blocks made of stage and
    pipeline sections hold only real keys."""
    text = page.read_text(encoding="utf-8")
    classes, sections, problems = config_classes(), nested_sections(), []
    for key in quoted_keys(text):
        first, _, rest = key.partition(".")
        if first in classes:
            why = key_problem(classes[first], rest)
        elif first in sections:
            why = any_key_problem(key)
        else:
            continue  # `prmflow.uri`, `mlflow.parentRunId`, `dsl.importer`: not config keys
        if why:
            problems.append(why)
    for lang, body in fenced(text):
        if lang not in ("yaml", "yml"):
            continue
        data = yaml.safe_load(body)
        if not isinstance(data, dict) or not set(data) <= set(classes):
            continue
        for section, values in data.items():
            for key, value in config.flatten(values or {}).items():
                why = key_problem(classes[section], key)
                if why and not (isinstance(value, dict) and any(k.startswith(key + ".") for k in config.flatten(values))):
                    problems.append(f"YAML [{section}]: {why}")
    assert not problems, f"{page_id(page)} quotes config keys that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_quoted_repository_path_exists(page):
    """`configs/quickstart.yaml`, `prmflow/pipelines/trainjob.py`, `advantage/token_rewards.py`: every path a
    page quotes (in prose or a command) is in the repository."""
    text = page.read_text(encoding="utf-8")
    words = spans(text) + [w for line in shell_lines(text) for w in tokenize(line)]
    problems = sorted({why for w in words if (why := repo_path_problem(w))})
    assert not problems, f"{page_id(page)} quotes paths that do not exist:\n" + "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # `_` stays, as on GitHub
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose(path.read_text(encoding="utf-8")), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    """Every relative link (and image) of a page names a file that exists, and a #fragment names a
    heading of that file."""
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z+.-]*:", target):
            continue  # https:, mailto:
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"({target}): {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"({target}): no heading '#{fragment}' in {dest.relative_to(ROOT)}")
    assert not problems, f"{page_id(page)} has broken links:\n" + "\n".join(problems)


#: A page (and maybe a heading) that code, configs or scripts name in their text: `docs/process-rewards.md#2c-...`.
DOC_MENTION = re.compile(r"(?<![\w./-])((?:docs|benchmarks|prmflow)/[\w./-]*?\.md)(?:#([\w-]+))?")
#: Where such mentions live: the package (docstrings feed --help and the stage READMEs), the benchmarks, the configs.
MENTIONING = [*sorted((ROOT / "prmflow").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py")),
              *sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "benchmarks").rglob("*.json"))]


def mention_problems(path: Path) -> list[str]:
    """Each `docs/X.md` or `docs/X.md#anchor` in `path`'s text that names no file, or no heading of it."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for m in DOC_MENTION.finditer(text):
        file, fragment = m.group(1), m.group(2)
        if re.search(r"\b[\w.-]+/[\w.-]+ $", text[max(0, m.start() - 80):m.start()]):
            continue  # another repository's page: `openreasoner/openr docs/datasets.md`
        dest = ROOT / file
        if not dest.exists():
            problems.append(f"{file}: no such page")
        elif fragment and fragment not in anchors(dest):
            problems.append(f"{file}#{fragment}: no such heading")
    return problems


def test_pages_that_code_names_exist():
    """A moved page or a renamed heading leaves no dangling `docs/...md#...` in a docstring, a --help text, a
    config comment or a benchmark: they are read where no Markdown renderer checks them."""
    problems = [f"{path.relative_to(ROOT)}: {p}" for path in MENTIONING for p in mention_problems(path)]
    assert not problems, "pages named in code that do not resolve:\n" + "\n".join(problems)


def test_a_dangling_mention_is_caught(tmp_path):
    """The check above reads anchors the way GitHub makes them (lower case, punctuation dropped, spaces as hyphens)."""
    text = tmp_path / "x.py"
    text.write_text("see docs/process-rewards.md#2c-calibrated-potential-process_calibration-isotonic and "
                    "docs/process-rewards.md#what-to-use, not "
                    "docs/process-rewards.md#5-measured or docs/nowhere.md (openreasoner/openr docs/datasets.md is theirs)",
                    encoding="utf-8")
    assert mention_problems(text) == ["docs/process-rewards.md#5-measured: no such heading", "docs/nowhere.md: no such page"]


DOCSTRING_LIMIT = 300  # characters: a config key's docstring is its --help line and its README table cell
#: A dated result in package code: a date, a lead or lag in points, or a pointer to an experiment log's section.
#: Results live in docs/ with the command that made them; code says what it does and links the page.
DATED_RESULT = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"
                          r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? points (?:below|above|ahead|behind)\b"
                          r"|process-rewards\.md,? (?:section )?5[a-g]?\b")


def test_config_docstrings_are_short():
    """What a key does in one or two lines and a link; the why and the measurements belong on the docs page."""
    long = [f"{section}.{key}: {len(doc)} characters" for section, cls in config_classes().items()
            for key, (_, doc, _) in config.flat_fields(cls).items() if len(doc) > DOCSTRING_LIMIT]
    assert not long, f"config docstrings over {DOCSTRING_LIMIT} characters (move the substance to docs/):\n" + "\n".join(long)


def dated_results(text: str) -> list[str]:
    return [m.group(0) for m in DATED_RESULT.finditer(text)]


def test_no_dated_result_in_package_code():
    found = [f"{path.relative_to(ROOT)}: {hit}" for path in sorted((ROOT / "prmflow").rglob("*.py"))
             for hit in dated_results(path.read_text(encoding="utf-8"))]
    assert not found, "results and dates in package code (put them in docs/, link the section):\n" + "\n".join(found)


def test_the_dated_result_pattern_is_narrow():
    """What it caught in the package before the results moved to docs/, and what it must leave alone."""
    caught = ["PRM ended 2.2 points below outcome-only with it (docs/process-rewards.md 5b)",
              "took this credit 10-18 points below outcome-only (docs/process-rewards.md, 5d-5e)",
              "(one thread, 2026-11-25)", "(docs/process-rewards.md, section 5)"]
    assert [len(dated_results(s)) > 0 for s in caught] == [True] * len(caught)
    kept = ["model.dropout.p = 0.0", "docs/process-rewards.md#5-the-evidence", "beta x the log-ratio over 5 steps",
            "2 points of the grid", "version 2026.1", "top 5 points"]
    assert [dated_results(s) for s in kept] == [[]] * len(kept)


def test_readme_stays_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, (f"README.md is {size} bytes, over {README_LIMIT}: move the detail to a page "
                                  f"under docs/ and link it")


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=page_id)
def test_pages_describe_today_not_history(page):
    """History lives in git: the README and docs/ name no commit and no issue."""
    text = page.read_text(encoding="utf-8")
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    issues = re.findall(r"\bissues? #?\d+|(?<![\w/])#\d+\b", text, re.I)
    assert not hashes and not issues, f"{page_id(page)}: say what the code does today, not when: {hashes + issues}"


def test_readme_test_command_is_what_ci_runs():
    """.ci/run installs, lints and tests exactly as the README says (less its `time` and `|| exit`)."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    line = next(ln for ln in ci.splitlines() if ln.startswith("python3 -m venv")).replace("time ", "").removesuffix(" || exit")
    blocks = [body for lang, body in fenced(README.read_text(encoding="utf-8")) if lang in SHELL]
    assert any(line in body.splitlines() for body in blocks), f"README: no code block runs .ci/run's `{line}`"


def test_readme_stage_table_lists_every_stage():
    rows = re.findall(r"^\| `([\w-]+)` \|", README.read_text(encoding="utf-8"), re.M)
    assert rows == list(stages.STAGES), "README's stage table: one row per stage, in the registry's order"


LAYOUT = ROOT / "docs" / "layout.md"


def layout_tree() -> list[str]:
    """The paths of docs/layout.md's tree: two spaces of indent per level, a folder ends with '/'."""
    body = next(body for lang, body in fenced(LAYOUT.read_text(encoding="utf-8")) if "\nprmflow/" in f"\n{body}")
    paths, stack = [], []
    for line in body.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack = stack[:depth] + [name]
        paths.append("".join(stack))
    return paths


def test_layout_tree_names_real_paths_and_every_package_folder():
    paths = layout_tree()
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/layout.md's tree names paths that do not exist: {missing}"
    folders = {str(p.relative_to(ROOT)) + "/" for p in (ROOT / "prmflow").rglob("*")
               if p.is_dir() and "__pycache__" not in p.parts and any(p.glob("*.py"))}
    unlisted = sorted(folders - set(paths))
    assert not unlisted, f"docs/layout.md's tree: add one line for each package folder {unlisted}"


def test_the_command_also_regenerates_the_submitting_page_tables(tmp_path, monkeypatch, capsys):
    """docs/submitting.md's pipeline.images and pipeline.cluster.trainer tables are generated like the stage
    READMEs', but `python -m prmflow.docs` left them alone: a re-documented ImagesConfig key failed a test that
    said to regenerate the table while the command for it wrote nothing. Now the command finds and fixes them."""
    original = ROOT / "docs" / "submitting.md"
    page = tmp_path / "submitting.md"
    drifted = original.read_text(encoding="utf-8").replace("| `pull_secrets` |", "| `pull_secret` |")
    drifted = drifted.replace("| `num_nodes` |", "| `nodes` |")
    page.write_text(drifted, encoding="utf-8")
    monkeypatch.setattr(stages, "available", lambda: {})
    monkeypatch.setattr(docs, "PAGE_TABLES", {page: docs.PAGE_TABLES[original]})

    assert docs.main(["--check"]) == 1
    assert f"{page}: config table out of date; run `python -m prmflow.docs`" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == drifted
    assert docs.main([]) == 0
    assert page.read_text(encoding="utf-8") == original.read_text(encoding="utf-8")
    assert docs.main(["--check"]) == 0
