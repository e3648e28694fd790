"""The package's shape: imports run one way, nothing reaches into another module's private names, no
module grows into a junk drawer, and no two modules share a name for different jobs.

Layers, lowest first: the foundation (errors.py, tasks/, tracking/, and components/config.py with the
subsystems the stages share: components/runtime/, data/, models/, sampling/, training/, scoring/) <- the
stages (components/<stage>/, which never import one another) <- stages.py, cli.py, docs.py, pipelines/. The
subsystems import one another without a circle (runtime <- data <- models <- sampling <- scoring, training on
runtime, data and models). Every import counts, function-level ones included (they hide cycles, they do not
remove them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import prmflow
from prmflow import stages

ROOT = Path(prmflow.__file__).parent
TESTS = Path(__file__).parent
#: A module this long usually holds two jobs: the test flags it so someone splits it by job (not by count).
MAX_LINES = 600
#: Modules allowed over MAX_LINES, with the reason. Empty: keep it that way or say why here.
LONG_MODULE_EXCEPTIONS: dict[str, str] = {}
#: The stage packages (components/<name>/), read from the stage registry: a new stage's package is a stage layer.
STAGE_PACKAGES = {stage.module.split(".")[2] for stage in stages.STAGES.values()}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full, None, node.lineno) if full in MODULES else (base, a.name, node.lineno))
    return found


def owning_module(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for target, _, _ in imports_of(path, name):
            mod = owning_module(target)
            # a package's __init__ is imported on the way to its modules: not an edge of its own
            if mod and mod != name and not name.startswith(mod + ".") and MODULES[mod].name != "__init__.py":
                edges.setdefault(name, set()).add(mod)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


FOUNDATION = {"errors", "tasks", "tracking"}


def subsystem(name: str) -> str | None:
    """The shared subsystem of components/ a module belongs to (`data`, `models`, ..., `config`), None else."""
    parts = name.split(".")
    if parts[1:2] == ["components"] and len(parts) > 2 and parts[2] not in STAGE_PACKAGES:
        return parts[2]
    return None


def layer(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if parts[1:2] == ["components"] and len(parts) > 2:
        if parts[2] in STAGE_PACKAGES:
            return 2, parts[2]
        return 0, "subsystems"
    if parts[1:2] and parts[1] in FOUNDATION:
        return 0, parts[1]
    return 3, "top"


def test_find_cycles_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert find_cycles(graph()) == []


def test_imports_run_one_way():
    wrong = []
    for name, targets in graph().items():
        (lvl, room) = layer(name)
        for t in targets:
            (tlvl, troom) = layer(t)
            if tlvl > lvl or (lvl == tlvl == 2 and troom != room):
                wrong.append(f"{name} imports {t}")
    assert wrong == [], ("imports must run foundation (errors, tasks, tracking, components.config and the subsystems "
                         "components.runtime, data, models, sampling, training, scoring) <- stages <- cli/pipelines:\n"
                         ) + "\n".join(wrong)


def subsystem_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, targets in edges.items():
        for t in targets:
            a, b = subsystem(name), subsystem(t)
            if a and b and a != b:
                out.setdefault(a, set()).add(b)
    return out


def test_subsystems_import_one_another_without_a_circle():
    """A package that imports another and is imported by it back is one subsystem in two folders: the runtime
    below data (io asks who writes), data below models, models below sampling and training, scoring on top."""
    edges = subsystem_edges(graph())
    assert find_cycles(edges) == [], f"subsystems import one another in a circle: {find_cycles(edges)} ({edges})"


#: Base names that several modules share because each holds the same job where it is.
SHARED_NAMES = {
    "__init__": "a package's own docstring and exports",
    "config": "a section's settings: each stage's Config, sampling's and tracking's sections, and components/config.py "
              "which loads them from YAML and the command line",
    "stage": "each stage's run(config), the one entry point the CLI, the KFP component and the tests call",
}


def shared_base_names(names) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for name in names:
        by_name.setdefault(name.rpartition(".")[2], []).append(name)
    return {k: sorted(v) for k, v in by_name.items() if len(v) > 1 and k not in SHARED_NAMES}


def test_shared_base_name_is_detected():
    assert shared_base_names(["prmflow.a.passes", "prmflow.b.passes", "prmflow.a.stage", "prmflow.b.stage"]) == {
        "passes": ["prmflow.a.passes", "prmflow.b.passes"]}


def test_no_two_modules_share_a_name_for_different_jobs():
    """`engine.py` next to `engines.py`, `rewards.py` in two stages meaning two things: a reader cannot tell from
    the name which one an import means. Packages count (a `data/` package and a stage module named `data.py`)."""
    shared = shared_base_names(MODULES)
    assert shared == {}, f"name these modules for what each holds (or add the name to SHARED_NAMES with why): {shared}"


def private_uses(path: Path, name: str | None) -> list[str]:
    """`from prmflow.x import _name`, and `alias._name` where alias is an imported prmflow module."""
    tree = ast.parse(path.read_text())
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and name:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if not base.startswith("prmflow"):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and owning_module(base) != name:
                    found.append(f"{path.name}:{node.lineno} imports {base}.{a.name}")
                if f"{base}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("prmflow"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_private_use_is_detected(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from prmflow.components import config\nfrom prmflow.cli import _x\nconfig._hidden\n")
    assert len(private_uses(probe, None)) == 2


def test_no_private_names_across_modules():
    found = [u for name, p in MODULES.items() for u in private_uses(p, name)]
    found += [u for p in TESTS.rglob("*.py") for u in private_uses(p, None)]
    assert found == [], "make what another module needs public (and documented):\n" + "\n".join(found)


def test_no_module_over_the_limit():
    long = {name: len(p.read_text().splitlines()) for name, p in MODULES.items()}
    long = {k: n for k, n in long.items() if n > MAX_LINES and k not in LONG_MODULE_EXCEPTIONS}
    assert long == {}, f"modules over {MAX_LINES} lines (split them by job): {long}"
