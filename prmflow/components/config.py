"""Stage configs: dataclasses loaded from YAML, overridable from the command line.

Each stage has one `Config` dataclass with a one-line docstring under every field. Those docstrings
are the documentation: `--help` shows them, and `describe(cls)` renders them for READMEs. A config
comes from (lowest to highest precedence) the dataclass defaults, a YAML file (`--config`), and
`--set key=value` / `--key value` overrides. Nested dataclasses take dotted keys
(`--set engine.zero_stage=2`). Unknown keys and values of the wrong type fail with a `ConfigError`
naming the key, the file and the closest valid key.

The module reads top to bottom: the keys of a config dataclass (`flat_fields`: types, docs,
defaults), what a value may be (`coerce`: a YAML or command-line value converted to a field's
type), building and loading a config, and the command line.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import io
import logging
import math
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from ..errors import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")


# --- the keys of a config dataclass ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (and its bases), read from the source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def hints(cls: type) -> dict[str, Any]:
    """The resolved type of every field of dataclass `cls`."""
    return typing.get_type_hints(cls)


def flat_fields(cls: type, prefix: str = "", defaults: Any = None) -> dict[str, tuple[Any, str, Any]]:
    """{dotted key: (type, doc, default)} for every leaf field of a (nested) config dataclass: the
    keys a user can set (`engine.zero_stage`), as `--help`, `describe` and `build` know them.

    A section's defaults are those of the enclosing field's default_factory (a stage's
    `optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))` shows lr 3e-3), as
    `build` makes them; `defaults` is that instance, for the recursion."""
    out: dict[str, tuple[Any, str, Any]] = {}
    types = hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        typ = types[f.name]
        key = prefix + f.name
        if defaults is not None and hasattr(defaults, f.name):
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = None
        if dataclasses.is_dataclass(typ):
            out.update(flat_fields(typ, key + ".", default if dataclasses.is_dataclass(default) else None))
        else:
            out[key] = (typ, docs.get(f.name, ""), copy.deepcopy(default) if defaults is not None else default)
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping (a YAML section, a pipeline parameter) as {dotted key: value}, the form
    `build` takes. A nested mapping is also kept whole under its own key, because it may be the
    value of a dict-typed field rather than a section."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
            out.setdefault(key, v)  # dict-typed leaf fields keep the whole mapping
        else:
            out[key] = v
    return out


# --- config values --------------------------------------------------------------------------

def coerce(value: Any, typ: Any, key: str, where: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to `typ`, or raise a ConfigError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        # empty is how the help and the key tables name None ("Empty: on, except for grpo_process"), so an empty
        # string means None where no string type could take it (`--whiten ''`, `whiten: ""`)
        if optional and (value is None or (isinstance(value, str) and (
                value.lower() in ("none", "null") or (not value.strip() and str not in args)))):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        if errors and optional:
            raise ConfigError(f"{errors[0].rstrip('.')}, or empty (null) for the default its description names.")
        raise ConfigError(errors[0] if errors else f"{where}: key '{key}' cannot be None.")
    if origin is typing.Literal:
        for a in args:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        raise ConfigError(
            f"{where}: key '{key}' is {value!r}, which is not one of {list(args)}. "
            f"Set it to one of those."
        )
    if origin in (list, tuple):
        inner = args[0] if args else str
        if isinstance(value, str) and value.strip().startswith("["):  # YAML flow list: [a, b]
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: key '{key}' is not a valid list ({e}); write a, b or [a, b].") from None
        elif isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: key '{key}' must be a list, got {value!r}.")
        return [coerce(v, inner, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict or typ is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value else {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: key '{key}' must be a mapping; {value!r} is not valid YAML ({e}).") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: key '{key}' must be a mapping, got {value!r}.")
        return dict(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{where}: key '{key}' must be true or false, got {value!r}.")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: key '{key}' must be a number, got {value!r}.")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: key '{key}' must be {typ.__name__}, got {value!r}.") from None
        if not math.isfinite(number):
            raise ConfigError(f"{where}: key '{key}' must be a finite number, got {value!r}.")
        if typ is int:
            if number != int(number):
                raise ConfigError(f"{where}: key '{key}' must be an integer, got {value!r}.")
            return int(number)
        return number
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: key '{key}' must be a string, got {value!r}.")
        return "" if value is None else str(value)
    return value


# --- building and loading -----------------------------------------------------------------------

def _unknown_key(key: str, valid: typing.Iterable[str], where: str) -> ConfigError:
    """The error for a key that is not in `valid`, suggesting the closest valid key; a near miss of a
    key inside a section given without it ('lrr' for 'lr') suggests the dotted key ('optim.lr')."""
    names = {k: k for k in valid}
    for k in list(names):
        names.setdefault(k.rsplit(".", 1)[-1], k)
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f" Did you mean '{names[close[0]]}'?" if close else ""
    return ConfigError(f"{where}: '{key}' is not a config key.{hint} `--help` lists the keys.")


def _set_path(node: dict, rest: str, value: Any) -> None:
    """node[rest] = value, where `rest` is a dotted path into nested mappings; a key that itself holds dots
    (a node selector's `cloud.google.com/gke-accelerator`, a benchmark variant named `...-w0.2`) is matched
    whole: at each level the longest leading part of the path that names a mapping already there is taken."""
    while rest not in node and "." in rest:
        parts = rest.split(".")
        i = next((i for i in range(len(parts) - 1, 1, -1) if isinstance(node.get(".".join(parts[:i])), dict)), 1)
        head, rest = ".".join(parts[:i]), ".".join(parts[i:])
        if not isinstance(node.get(head), dict):
            node[head] = {}
        node = node[head]
    node[rest] = value


def build(cls: type[C], values: dict[str, Any], where: str = "config") -> C:
    """Make a `cls` from a flat {dotted key: value} mapping, coercing and checking every value."""
    leaves = flat_fields(cls)
    prefixes = {".".join(k.split(".")[:i]) for k in leaves for i in range(1, k.count(".") + 1)}  # every section
    mappings = [k for k, (t, _, _) in leaves.items() if t is dict or typing.get_origin(t) is dict]
    mapping_set = set(mappings)

    def expand(key: str, value: Any) -> dict[str, Any]:  # {"engine": {"backend": ...}} -> {"engine.backend": ...}
        if key in prefixes and key not in leaves and isinstance(value, dict):
            return {k2: v2 for k, v in value.items() for k2, v2 in expand(f"{key}.{k}", v).items()}
        return {key: value}

    nested = {k2: v2 for k, v in values.items() if k in prefixes and k not in leaves for k2, v2 in expand(k, v).items()}
    values = {**nested, **{k: v for k, v in values.items() if not (k in prefixes and k not in leaves)}}  # dotted keys win
    for key in values:
        inside_mapping = any(key.startswith(m + ".") for m in mappings)  # a dict field's own keys
        if key not in leaves and key not in prefixes and not inside_mapping:
            raise _unknown_key(key, leaves, where)
        if key in prefixes and key not in leaves and not isinstance(values[key], dict):
            raise ConfigError(f"{where}: key '{key}' is a section; give it a mapping of its keys (e.g. "
                              f"{key}.<name>: value), not {values[key]!r}.")

    def make(klass: type, prefix: str, defaults: dict[str, Any] | None) -> Any:
        # `defaults`: the values the enclosing field's default_factory gives this dataclass, which
        # may differ from the class's own defaults (e.g. a GPU node pool vs an empty NodePool)
        types = hints(klass)
        kwargs = {}
        for f in dataclasses.fields(klass):
            key = prefix + f.name
            typ = types[f.name]
            if dataclasses.is_dataclass(typ):
                if defaults is not None and isinstance(defaults.get(f.name), dict):
                    sub = defaults[f.name]
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    sub = dataclasses.asdict(f.default_factory())  # type: ignore[misc]
                else:
                    sub = None
                kwargs[f.name] = make(typ, key + ".", sub)
            elif key in mapping_set and any(k.startswith(key + ".") for k in values):
                # a dict field given dotted keys of its own (`--set ppo.optim.lr=3e-5`): laid over the mapping
                # (the one given, else the default), shallower keys first, so the most specific key wins
                base = values[key] if key in values else leaves[key][2]
                merged = copy.deepcopy(base) if isinstance(base, dict) else {}
                for k in sorted((k for k in values if k.startswith(key + ".")), key=lambda k: k.count(".")):
                    _set_path(merged, k[len(key) + 1:], copy.deepcopy(values[k]))
                kwargs[f.name] = coerce(merged, typ, key, where)
            elif key in values:
                kwargs[f.name] = coerce(values[key], typ, key, where)
            elif defaults is not None and f.name in defaults:
                kwargs[f.name] = defaults[f.name]
        try:
            return klass(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        except ConfigError as e:  # a __post_init__ check: say which file or flags it came from
            if str(e).startswith(where):
                raise
            raise ConfigError(f"{where}: {e}") from None

    return make(cls, "", None)


class UniqueKeySafeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping: PyYAML keeps the last silently, so a
    second `ppo:` section (or `lr:` key) would drop the first without a word."""


def _unique_mapping(loader: UniqueKeySafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat; the safe loader merges them
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            seen = key in first
        except TypeError:  # an unhashable key: the safe loader says so itself
            continue
        if seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is written twice in one mapping (first on line {first[key] + 1}); YAML would "
                f"keep only the last. Merge the two into one", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


UniqueKeySafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str | Path, what: str = "Config file") -> dict[str, Any]:
    """The mapping at the top of the YAML file `path` (a stage's or a pipeline's config), or a ConfigError
    saying what is wrong with the file: not there, a directory, not text, not YAML (with the line), not a
    mapping. An empty file is an empty mapping."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} '{p}' is a directory; pass the YAML file itself to --config.")
    if not p.is_file():
        raise ConfigError(f"{what} '{p}' does not exist. Pass an existing YAML file to --config.")
    try:
        text = io.StringIO(p.read_bytes().decode("utf-8"))
        text.name = str(p)  # what YAML's error marks name ('in "configs/x.yaml", line 3'), not '<unicode string>'
        data = yaml.load(text, Loader=UniqueKeySafeLoader) or {}  # a yaml.SafeLoader (tests/test_config.py)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} '{p}' is not valid YAML: {e}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{what} '{p}' is not a YAML text file ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{p}' must hold a mapping of keys to values, got {type(data).__name__}.")
    return data


def _section(cls: type, data: dict[str, Any], section: str, sections: typing.Collection[str], where: str) -> dict:
    """The keys for `cls` in a config file's `data`: its `section` when the file has one (an empty
    `section:` is the defaults), else the whole file, unless the file is made of other sections (a
    pipeline YAML with no `section:`), whose keys are not `cls`'s: that is said by name."""
    own = {f.name for f in dataclasses.fields(cls)}  # rollout's `prm` is a key of its own, not a section
    if section in data and section not in own:
        stray = [k for k in data if k != section and not (k in sections and (data[k] is None or isinstance(data[k], dict)))]
        if sections and stray:  # read from the section only, they were dropped without a word
            raise ConfigError(f"{where}: {', '.join(repr(k) for k in stray)} {'is' if len(stray) == 1 else 'are'} outside "
                              f"every section; with the section '{section}:' only the keys under it are read. Move "
                              f"{'it' if len(stray) == 1 else 'them'} under '{section}:'.")
        if data[section] is None:
            return {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping of its keys (e.g. {section}: "
                              f"{{key: value}}), not {data[section]!r}.")
        return data[section]
    others = [k for k in data if k in sections and k not in own and (data[k] is None or isinstance(data[k], dict))]
    if others:
        raise ConfigError(f"{where} has section(s) {', '.join(others)} but no '{section}:' section, so none of its "
                          f"keys are for {section}. Add the section '{section}:' (empty, it takes the defaults), "
                          f"or give {section}'s keys with --set.")
    return data


def load(cls: type[C], path: str | Path | None = None, overrides: dict[str, Any] | None = None,
         section: str | None = None, sections: typing.Collection[str] = (), fills: dict[str, Any] | None = None) -> C:
    """Load `cls` from a YAML file (optionally one top-level `section` of it) plus overrides. `sections`:
    the names of other sections such a file may hold (the other stages', `pipeline`). `fills`: values for keys
    that neither the file nor the overrides give."""
    values: dict[str, Any] = {}
    where = "config"
    if path:
        p = Path(path)
        data = read_yaml(p)
        if section is not None:
            data = _section(cls, data, section, sections, str(p))
        values.update(flatten(data))
        where = str(p)
    values.update({k: v for k, v in (fills or {}).items() if k not in values and k not in (overrides or {})})
    cfg = build(cls, values, where)
    if overrides:
        merged = {**flatten(to_dict(cfg)), **overrides}
        cfg = build(cls, merged, "command line")
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as a nested plain dict (what YAML, MLflow params and manifests store)."""
    return dataclasses.asdict(cfg)


def flat_dict(cfg: Any) -> dict[str, Any]:
    """The config as {dotted key: value}, as logged to MLflow params."""
    return {k: v for k, v in flatten(to_dict(cfg)).items() if not isinstance(v, dict) or not v}


def describe(cls: type) -> str:
    """A Markdown table of every key: name, type, default, description (for READMEs)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, (typ, doc, default) in flat_fields(cls).items():
        tname = getattr(typ, "__name__", None) or str(typ).replace("typing.", "")
        tname = tname.replace(" | ", " or ").replace("|", " or ")  # a bare | would split the table cell
        rows.append(f"| `{key}` | {tname} | `{default!r}` | {doc} |")
    return "\n".join(rows)


# --- command line ---------------------------------------------------------------------------

#: --set examples a stage's help shows when it has these keys (a training stage); others show two of their own
SET_EXAMPLES = {"optim.lr": "1e-4", "engine.zero_stage": "2"}


def set_example(fields: dict[str, tuple[Any, str, Any]]) -> str:
    """`--set KEY=VALUE` examples made of keys the config has: the advantage stage has no optim.lr to set."""
    shown = {k: v for k, v in SET_EXAMPLES.items() if k in fields}
    if not shown:  # a nested key and a top-level one, each with its default, so the line also reads as a value
        nested = next((k for k, (_, _, d) in fields.items() if "." in k and not k.startswith("tracking.")
                       and isinstance(d, (int, float)) and not isinstance(d, bool)), None)
        top = next((k for k, (_, _, d) in fields.items() if "." not in k and isinstance(d, str) and d
                    and k not in ("input", "output")), None)
        shown = {k: fields[k][2] for k in (nested, top) if k}
    return " ".join(f"--set {k}={v}" for k, v in shown.items()) or "--set KEY=VALUE"


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add `--config`, `--set key=value` and one `--key` flag per config field to `parser`."""
    fields = flat_fields(cls)
    parser.add_argument("--config", metavar="FILE", help="YAML file with config keys (a stage section is used if present)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="set_",
                        help=f"override one key, e.g. {set_example(fields)}")
    group = parser.add_argument_group("config keys")
    for key, (typ, doc, default) in fields.items():
        shown = "empty" if default is None else repr(default)  # as the key tables write it (docs.config_table)
        help_text = f"{doc} (default: {shown})" if doc else f"(default: {shown})"
        group.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="V", default=argparse.SUPPRESS,
                           help=help_text.replace("%", "%%"))


def from_args(cls: type[C], args: argparse.Namespace, section: str | None = None,
              sections: typing.Collection[str] = (), fills: dict[str, Any] | None = None) -> C:
    """Build the config from parsed `add_arguments` flags (`section`, `sections`: as `load` takes them)."""
    overrides: dict[str, Any] = {}
    for item in args.set_:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=1e-4.")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    for name, value in vars(args).items():
        if name.startswith("cfg:"):
            overrides[name[4:]] = value
    return load(cls, args.config, overrides, section=section, sections=sections, fills=fills)


def import_callable(spec: str, what: str) -> Callable:
    """The callable a config value 'package.module:attr' names, imported now; `what` names the value in errors
    (e.g. "environment.factory 'pkg.mod:Env'")."""
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{what} must look like 'package.module:attr'.")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what}: cannot import module {module!r} ({e}). Is it installed or on PYTHONPATH?") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"{what}: module {module!r} has no callable {name!r}.")
    return fn
