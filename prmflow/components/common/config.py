"""Stage configs: dataclasses loaded from YAML, overridable from the command line.

Each stage has one `Config` dataclass with a one-line docstring under every field. Those docstrings
are the documentation: `--help` shows them, and `describe(cls)` renders them for READMEs. A config
comes from (lowest to highest precedence) the dataclass defaults, a YAML file (`--config`), and
`--set key=value` / `--key value` overrides. Nested dataclasses take dotted keys
(`--set engine.zero_stage=2`). Unknown keys and values of the wrong type fail with a `ConfigError`
naming the key, the file and the closest valid key. A key that was renamed keeps working for one
release under its old name, with a warning (`renamed_keys`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import textwrap
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .config_values import coerce
from .errors import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")


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


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def flat_fields(cls: type, prefix: str = "") -> dict[str, tuple[Any, str, Any]]:
    """{dotted key: (type, doc, default)} for every leaf field of a (nested) config dataclass: the
    keys a user can set (`engine.zero_stage`), as `--help`, `describe` and `build` know them."""
    out: dict[str, tuple[Any, str, Any]] = {}
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(typ):
            out.update(flat_fields(typ, key + "."))
        else:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            else:
                default = None
            out[key] = (typ, docs.get(f.name, ""), default)
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


# --- renamed keys ------------------------------------------------------------------------------

_MISSING = object()


@functools.lru_cache(maxsize=None)
def renamed_keys(cls: type) -> dict[str, str]:
    """{old dotted key: new dotted key} that `cls` and its nested sections still accept.

    A config that renames a key keeps reading the old one for one release: it declares
    `renamed: ClassVar[dict[str, str]] = {"old_key": "new.key"}` (a key or a whole section; in a
    nested section's dataclass, relative to that section), and `build` reads the old key as the new
    one with a deprecation warning."""
    out: dict[str, str] = {}

    def collect(klass: type, prefix: str) -> None:
        for old, new in getattr(klass, "renamed", {}).items():
            out[prefix + old] = prefix + new
        hints = _hints(klass)
        for f in dataclasses.fields(klass):
            if dataclasses.is_dataclass(hints[f.name]):
                collect(hints[f.name], f"{prefix}{f.name}.")

    collect(cls, "")
    leaves = flat_fields(cls)
    sections = {".".join(k.split(".")[:i]) for k in leaves for i in range(1, k.count(".") + 1)}
    for old, new in out.items():  # a wrong mapping is a bug in prmflow: fail where it is declared
        if new not in leaves and new not in sections:
            raise TypeError(f"{cls.__name__}.renamed maps '{old}' to '{new}', which is not a key of {cls.__name__}.")
        if old in leaves or old in sections:
            raise TypeError(f"{cls.__name__}.renamed maps '{old}', which is still a key of {cls.__name__}.")
    return out


def _lookup(mapping: Any, path: str) -> Any:
    """mapping[a][b] for path 'a.b', or _MISSING."""
    for part in path.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return _MISSING
        mapping = mapping[part]
    return mapping


def _overlap(a: Any, b: Any) -> bool:
    """Whether two values given for the same key set some setting twice (two sections: a shared key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return any(k in b and _overlap(v, b[k]) for k, v in a.items())
    return True


def _same_setting(key: str, value: Any, other: str, other_value: Any) -> bool:
    """Whether `key` and `other` (either may be a section holding a mapping) set the same setting."""
    if key == other:
        return _overlap(value, other_value)
    if key.startswith(other + "."):
        inner = _lookup(other_value, key[len(other) + 1:])
        return inner is not _MISSING and _overlap(value, inner)
    if other.startswith(key + "."):
        inner = _lookup(value, other[len(key) + 1:])
        return inner is not _MISSING and _overlap(inner, other_value)
    return False


def upgrade_keys(cls: type, values: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """`values` ({dotted key: value}, sections may hold nested mappings) with every key `cls` renamed
    under its new name. Each old key in use logs a warning (and a FutureWarning) naming the new key;
    an old key given together with its new one is a ConfigError naming both."""
    renames = renamed_keys(cls)
    if not renames:
        return values
    holders = {".".join(k.split(".")[:i]) for k in renames for i in range(1, k.count(".") + 1)}
    given: dict[str, Any] = {}
    upgraded: dict[str, tuple[str, Any]] = {}  # new key -> (the old key as written, value)
    used: dict[str, str] = {}  # declared old -> new, one warning each

    def put(key: str, value: Any, written: str | None) -> None:
        if isinstance(value, dict) and key in holders:  # a section that holds an old key: look inside
            for k, v in value.items():
                put(f"{key}.{k}", v, written and f"{written}.{k}")
            return
        for old, new in renames.items():
            if key == old or key.startswith(old + "."):
                used.setdefault(old, new)
                put(new + key[len(old):], value, written or key)  # again: a renamed section may hold a renamed key
                return
        if written is None:
            given[key] = value
        else:
            upgraded[key] = (written, value)

    # sections given as mappings first, so that a dotted key wins over the same key inside one (as in `build`)
    for key, value in sorted(values.items(), key=lambda kv: not (isinstance(kv[1], dict) and kv[0] in holders)):
        put(key, value, None)
    for key, (written, value) in upgraded.items():
        clash = next((k for k, v in given.items() if _same_setting(key, value, k, v)), None)
        if clash is not None:
            raise ConfigError(f"{where}: both '{written}' and '{clash}' are set; '{written}' is the old name of "
                              f"'{key}'. Keep only '{key}'.")
    for old, new in used.items():
        message = (f"{where}: config key '{old}' is deprecated, use '{new}' instead; "
                   f"'{old}' will be removed in the next release.")
        log.warning(message)
        warnings.warn(message, FutureWarning, stacklevel=3)
    out = dict(given)
    for key, (_, value) in upgraded.items():  # an old and a new section may each set some keys
        out[key] = _merged(out[key], value) if key in out else value
    return out


def _merged(a: Any, b: Any) -> Any:
    """Two mappings that set different keys, as one (else `b`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merged(a[k], v) if k in a else v for k, v in b.items()}}
    return b


def _unknown_key(key: str, valid: typing.Iterable[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{where}: '{key}' is not a config key.{hint} `--help` lists the keys.")


def build(cls: type[C], values: dict[str, Any], where: str = "config") -> C:
    """Make a `cls` from a flat {dotted key: value} mapping, coercing and checking every value.
    Renamed keys (`renamed_keys`) are read as their new names, with a deprecation warning."""
    values = upgrade_keys(cls, values, where)
    leaves = flat_fields(cls)
    prefixes = {".".join(k.split(".")[:i]) for k in leaves for i in range(1, k.count(".") + 1)}  # every section
    mappings = [k for k, (t, _, _) in leaves.items() if t is dict or typing.get_origin(t) is dict]

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
        hints = _hints(klass)
        kwargs = {}
        for f in dataclasses.fields(klass):
            key = prefix + f.name
            typ = hints[f.name]
            if dataclasses.is_dataclass(typ):
                if defaults is not None and isinstance(defaults.get(f.name), dict):
                    sub = defaults[f.name]
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    sub = dataclasses.asdict(f.default_factory())  # type: ignore[misc]
                else:
                    sub = None
                kwargs[f.name] = make(typ, key + ".", sub)
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


def load(cls: type[C], path: str | Path | None = None, overrides: dict[str, Any] | None = None,
         section: str | None = None) -> C:
    """Load `cls` from a YAML file (optionally one top-level `section` of it) plus overrides."""
    values: dict[str, Any] = {}
    where = "config"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file '{p}' does not exist. Pass an existing YAML file to --config.")
        try:
            data = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"Config file '{p}' is not valid YAML: {e}") from None
        except (UnicodeDecodeError, RecursionError) as e:
            raise ConfigError(f"Config file '{p}' is not a YAML text file ({e}).") from None
        if not isinstance(data, dict):
            raise ConfigError(f"Config file '{p}' must hold a mapping of keys to values, got {type(data).__name__}.")
        if section is not None and section in data and isinstance(data[section], dict):
            data = data[section]
        values.update(flatten(data))
        where = str(p)
    cfg = build(cls, values, where)
    if overrides:
        merged = {**flatten(to_dict(cfg)), **upgrade_keys(cls, overrides, "command line")}
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

def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add `--config`, `--set key=value` and one `--key` flag per config field to `parser`."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with config keys (a stage section is used if present)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="set_",
                        help="override one key, e.g. --set lr=1e-4 --set engine.zero_stage=2")
    group = parser.add_argument_group("config keys")
    fields = flat_fields(cls)
    for key, (typ, doc, default) in fields.items():
        help_text = f"{doc} (default: {default!r})" if doc else f"(default: {default!r})"
        group.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="V", default=argparse.SUPPRESS,
                           help=help_text.replace("%", "%%"))
    for old, new in renamed_keys(cls).items():  # old flags still work for a release, hidden from --help
        for key in fields:
            if key == new or key.startswith(new + "."):
                flag = old + key[len(new):]
                group.add_argument(f"--{flag}", dest=f"cfg:{flag}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def from_args(cls: type[C], args: argparse.Namespace, section: str | None = None) -> C:
    """Build the config from parsed `add_arguments` flags."""
    overrides: dict[str, Any] = {}
    for item in args.set_:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=1e-4.")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    for name, value in vars(args).items():
        if name.startswith("cfg:"):
            overrides[name[4:]] = value
    return load(cls, args.config, overrides, section=section)
