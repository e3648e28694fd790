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
import dataclasses
import difflib
import logging
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .config_keys import (field_docs, flat_fields, flatten, hints, looks_boolean, renamed_keys, renamed_values,
                          upgrade_keys, upgrade_stored)
from .config_values import coerce
from ...errors import ConfigError

__all__ = ["field_docs", "flat_fields", "flatten", "hints", "looks_boolean", "renamed_keys", "renamed_values",
           "upgrade_keys", "upgrade_stored", "build", "load", "to_dict", "flat_dict", "describe", "add_arguments",
           "from_args"]

log = logging.getLogger(__name__)

C = TypeVar("C")


def _unknown_key(key: str, valid: typing.Iterable[str], where: str, renames: dict[str, str] | None = None) -> ConfigError:
    """The error for a key that is not in `valid`; a near miss of a key's old name (`renames`: old
    -> new, e.g. 'lrr' for the old 'lr') suggests the new name ('optim.lr')."""
    names = {k: k for k in valid}
    names.update({old: new for old, new in (renames or {}).items() if old not in names})
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f" Did you mean '{names[close[0]]}'?" if close else ""
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
            raise _unknown_key(key, leaves, where, renamed_keys(cls))
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
                        help="override one key, e.g. --set optim.lr=1e-4 --set engine.zero_stage=2")
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
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=1e-4.")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    for name, value in vars(args).items():
        if name.startswith("cfg:"):
            overrides[name[4:]] = value
    return load(cls, args.config, overrides, section=section)
