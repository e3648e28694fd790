"""Config values: what a YAML file or a command-line string gives, converted to a field's declared type.

`coerce` is the one place that decides what a config value may be: a number from "1e-4", a bool
from "yes", a list from "a, b" or "[a, b]", a Literal checked against its choices, None only where
the type allows it. Non-finite numbers are refused (a NaN learning rate fails here, not mid-run),
and every refusal is a ConfigError naming the key and where it came from.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import yaml

from ...errors import ConfigError


def coerce(value: Any, typ: Any, key: str, where: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to `typ`, or raise a ConfigError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
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
