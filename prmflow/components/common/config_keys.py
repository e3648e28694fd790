"""The keys of a config dataclass: their types, docs and defaults, and the keys renamed since a release.

`flat_fields` lists the dotted keys a user can set (with the docstring under each field, the
documentation of the key); `flatten` turns a nested mapping (a YAML section) into dotted keys. A
Config declares `renamed` (old key -> new key) for keys renamed in this release: `upgrade_keys`
reads them under their new names with a deprecation warning, and `upgrade_stored` brings a config
an earlier release stored (a manifest, a resume checkpoint) to today's names. `config.py` builds,
loads and parses configs on top of this module.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import logging
import textwrap
import typing
import warnings
from typing import Any

from ...errors import ConfigError

log = logging.getLogger("prmflow.components.common.config")  # the warnings read as the config loader's


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


# --- renamed keys ------------------------------------------------------------------------------

_MISSING = object()


@functools.lru_cache(maxsize=None)
def renamed_keys(cls: type) -> dict[str, str]:
    """{old dotted key: new dotted key} that `cls` and its nested sections still accept.

    A config that renames a key keeps reading the old one for one release: it declares
    `renamed: ClassVar[dict[str, str]] = {"old_key": "new.key"}` (a key or a whole section; in a
    nested section's dataclass, relative to that section), and `build` reads the old key as the new
    one with a deprecation warning."""
    out = {old: new for old, (new, _) in declared(cls, "renamed").items()}
    leaves = flat_fields(cls)
    sections = {".".join(k.split(".")[:i]) for k in leaves for i in range(1, k.count(".") + 1)}
    for old, new in out.items():  # a wrong mapping is a bug in prmflow: fail where it is declared
        if new not in leaves and new not in sections:
            raise TypeError(f"{cls.__name__}.renamed maps '{old}' to '{new}', which is not a key of {cls.__name__}.")
        if old in leaves or old in sections:
            raise TypeError(f"{cls.__name__}.renamed maps '{old}', which is still a key of {cls.__name__}.")
    return out


def declared(cls: type, attr: str) -> dict[str, tuple[str, Any]]:
    """{old dotted key: (new dotted key, test or None)} from the `attr` mapping ("renamed" or
    "renamed_when") of `cls` and of every nested section's dataclass, each prefixed with its section."""
    out: dict[str, tuple[str, Any]] = {}

    def collect(klass: type, prefix: str) -> None:
        for old, new in getattr(klass, attr, {}).items():
            new, test = new if isinstance(new, tuple) else (new, None)
            out[prefix + old] = (prefix + new, test)
        types = hints(klass)
        for f in dataclasses.fields(klass):
            if dataclasses.is_dataclass(types[f.name]):
                collect(types[f.name], f"{prefix}{f.name}.")

    collect(cls, "")
    return out


def looks_boolean(value: Any) -> bool:
    """Whether `value` is a bool as YAML or the command line writes one (true, false, yes, no, on, off)."""
    return isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"))


@functools.lru_cache(maxsize=None)
def renamed_values(cls: type) -> dict[str, tuple[str, Any]]:
    """{old dotted key: (new dotted key, test)} for keys whose old name is still a key, with another meaning.

    A config declares `renamed_when: ClassVar[dict[str, tuple[str, Callable]]] = {"critic":
    ("train_critic", looks_boolean)}` when a name was given to a new setting in the same release as its
    old setting moved: a value for which `test` holds is the old setting's, read under its new name
    with a deprecation warning (as `renamed`); any other value is the key's own."""
    out = declared(cls, "renamed_when")
    leaves = flat_fields(cls)
    for old, (new, _) in out.items():
        if new not in leaves or old not in leaves:
            raise TypeError(f"{cls.__name__}.renamed_when maps '{old}' to '{new}'; both must be keys of {cls.__name__}.")
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
    by_value = renamed_values(cls)
    if not renames and not by_value:
        return values
    holders = {".".join(k.split(".")[:i]) for k in renames for i in range(1, k.count(".") + 1)}
    given: dict[str, Any] = {}
    upgraded: dict[str, tuple[str, Any]] = {}  # new key -> (the old key as written, value)
    used: dict[str, str] = {}  # declared old -> new, one warning each

    def put(key: str, value: Any, written: str | None) -> None:
        if written is None and key in by_value and by_value[key][1](value):  # the old meaning of a reused name
            used.setdefault(key, by_value[key][0])
            upgraded[by_value[key][0]] = (key, value)
            return
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
        if old in by_value:  # the name stays, with another meaning
            message = (f"{where}: config key '{old}' with a true/false value is deprecated, use '{new}' instead; "
                       f"'{old}' now takes another kind of value and will read true/false as '{new}' only "
                       f"until the next release.")
        else:
            message = (f"{where}: config key '{old}' is deprecated, use '{new}' instead; "
                       f"'{old}' will be removed in the next release.")
        log.warning(message)
        warnings.warn(message, FutureWarning, stacklevel=3)
    out = dict(given)
    for key, (_, value) in upgraded.items():  # an old and a new section may each set some keys
        out[key] = _merged(out[key], value) if key in out else value
    return out


def upgrade_stored(cls: type, stored: dict, fill: bool = True) -> dict:
    """A config that an earlier release stored (a manifest's or a resume checkpoint's `config`, nested
    as `to_dict` writes it, perhaps only some of its sections) with every renamed key under its new
    name, and (`fill`) every key this release added to a section it holds at its default: what
    `to_dict` of the same settings gives today, so that an output or checkpoint written before a
    rename is still recognised. Keys `cls` does not know are kept as they are; nothing is checked or
    warned. With fill=False it turns a YAML stage section into the same section under today's keys."""
    out = copy.deepcopy(stored)

    def pop(path: str) -> Any:
        *parents, last = path.split(".")
        holder = _lookup(out, ".".join(parents)) if parents else out
        return holder.pop(last) if isinstance(holder, dict) and last in holder else _MISSING

    def place(path: str, value: Any) -> None:
        *parents, last = path.split(".")
        holder = out
        for part in parents:
            holder = holder.setdefault(part, {})
        holder[last] = _merged(holder[last], value) if last in holder else value

    for old, (new, test) in renamed_values(cls).items():
        value = _lookup(out, old)
        if value is not _MISSING and test(value):
            pop(old)
            place(new, value)
    for old, new in renamed_keys(cls).items():
        value = pop(old)
        if value is not _MISSING:
            place(new, value)
    if fill and out != stored:  # a stored config from before a rename: sections it holds get this release's new keys
        for key, (_, _, default) in flat_fields(cls).items():
            section = key.rsplit(".", 1)[0] if "." in key else None
            if section is not None and isinstance(_lookup(out, section), dict) and _lookup(out, key) is _MISSING:
                place(key, copy.deepcopy(default))
    return out


def _merged(a: Any, b: Any) -> Any:
    """Two mappings that set different keys, as one (else `b`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merged(a[k], v) if k in a else v for k, v in b.items()}}
    return b
