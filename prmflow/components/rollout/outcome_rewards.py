"""Outcome rewards: a recipe is a weighted sum of named components, chosen per row by its source.

    rewards:                      # config: one entry per (source, component)
      - {source: arithmetic, component: arithmetic}
      - {source: gsm8k, component: math, weight: 1.0}
      - {source: gsm8k, component: http, weight: 0.5, name: rm, url: "http://rm:8000/score", timeout_s: 10}
      - {source: gsm8k, component: function, weight: 0.1, function: "mypkg.rewards:brevity"}
      - {source: default, component: math}   # rows whose source has no recipe of its own

A row's recipe is every entry with its `source` (else the `default` entries).
outcome_reward = sum(weight * value); every component's unweighted value is kept in the row's
reward_components under its name (default: the component type). The component kinds (arithmetic,
math, http, function) are in reward_components.py.

A component that raises or returns NaN/inf is a RewardError naming the component and the row's
prompt_id: a reward is never written silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, PrmflowError
from .reward_components import COMPONENTS, Component, RewardError, RewardInput


def _function_form(function: str) -> Component:
    """A `function` entry checked for its 'module:function' form only (nothing imported)."""
    module, _, name = str(function).partition(":")
    if not module or not name:
        raise ConfigError(f"function reward {function!r} must look like 'package.module:function'.")
    return lambda items: [math.nan] * len(items)


# --- recipes -------------------------------------------------------------------------------------

@dataclass
class Part:
    name: str
    weight: float
    score: Component
    verifier: bool


#: The default recipe table: the arithmetic task's verifier, and the math verifier for every other source.
DEFAULT_RECIPES = [{"source": "arithmetic", "component": "arithmetic", "weight": 1.0},
                   {"source": "visual", "component": "arithmetic", "weight": 1.0},  # same `answer: N` line
                   {"source": "default", "component": "math", "weight": 1.0}]


def parse_table(spec: Any) -> list[dict]:
    """The recipe table as a list of entries; YAML/JSON text (from the command line) is parsed."""
    if isinstance(spec, str):
        import yaml

        try:
            spec = yaml.safe_load(spec) if spec.strip() else []
        except yaml.YAMLError as e:
            raise ConfigError(f"rewards: not valid YAML ({e}).") from None
    if isinstance(spec, dict):
        spec = [spec]
    if not isinstance(spec, list) or not spec:
        raise ConfigError("rewards must be a non-empty list of entries like {source: arithmetic, component: "
                          f"arithmetic, weight: 1.0}}; components: {sorted(COMPONENTS)}.")
    return spec


def build_recipes(spec: Any, import_functions: bool = True) -> dict[str, list[Part]]:
    """Parse the `rewards` table (entries {source, component, weight, name, ...params}) into recipes by source.

    import_functions=False checks a `function` entry's form without importing it (config validation
    on a machine that does not have the user's module, e.g. when the pipeline is compiled).
    """
    recipes: dict[str, list[Part]] = {}
    for j, entry in enumerate(parse_table(spec)):
        where = f"rewards[{j}]"
        if not isinstance(entry, dict) or "component" not in entry:
            raise ConfigError(f"{where} must be a mapping with a 'component' key (one of {sorted(COMPONENTS)}), got {entry!r}.")
        params = dict(entry)
        kind = str(params.pop("component"))
        source = str(params.pop("source", "default"))
        name = str(params.pop("name", kind))
        weight = params.pop("weight", 1.0)
        if kind not in COMPONENTS:
            raise ConfigError(f"{where}: unknown reward component {kind!r}; known: {sorted(COMPONENTS)}.")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{where}: weight {weight!r} must be a finite number.")
        parts = recipes.setdefault(source, [])
        if any(p.name == name for p in parts):
            raise ConfigError(f"{where}: source {source!r} has two components named {name!r}; give one a distinct 'name'.")
        factory, verifier = COMPONENTS[kind]
        if kind == "function" and not import_functions:
            factory = _function_form
        try:
            score = factory(**params)
        except TypeError as e:
            raise ConfigError(f"{where} ({kind}): {e}. {factory.__doc__ or ''}") from None
        parts.append(Part(name, float(weight), score, verifier))
    return recipes


def recipe_for(recipes: dict[str, list[Part]], source: str) -> list[Part]:
    if source in recipes:
        return recipes[source]
    if "default" in recipes:
        return recipes["default"]
    raise ConfigError(f"no reward recipe for source {source!r}: the rewards table has sources {sorted(recipes)}. "
                      f"Add an entry with source: {source} (or source: default).")


@dataclass
class Scored:
    outcome: list[float]  # one per item
    components: list[dict[str, float]]  # unweighted value of every component of the item's recipe
    correct: list[float | None]  # the verifier's value (None when the recipe has no verifier)


def score_items(recipes: dict[str, list[Part]], items: list[RewardInput]) -> Scored:
    """Every item scored by the recipe of its source; RewardError on an exception or a non-finite value."""
    outcome = [0.0] * len(items)
    components: list[dict[str, float]] = [{} for _ in items]
    correct: list[float | None] = [None] * len(items)
    by_source: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_source.setdefault(it.source, []).append(i)
    for source, idx in by_source.items():
        for part in recipe_for(recipes, source):
            batch = [items[i] for i in idx]
            try:
                values = list(part.score(batch))
            except PrmflowError:
                raise
            except Exception as e:
                bad = _first_failing(part, batch)
                raise RewardError(f"reward component {part.name!r} raised {type(e).__name__}: {e} on "
                                  f"prompt_id={bad.prompt_id!r} sample_idx={bad.sample_idx}. Fix the component; "
                                  f"nothing was written.") from e
            if len(values) != len(batch):
                raise RewardError(f"reward component {part.name!r} returned {len(values)} values for {len(batch)} responses.")
            for i, v in zip(idx, values):
                v = float(v)
                if not math.isfinite(v):
                    raise RewardError(f"reward component {part.name!r} returned {v} for prompt_id={items[i].prompt_id!r} "
                                      f"sample_idx={items[i].sample_idx}; rewards must be finite. Nothing was written.")
                components[i][part.name] = v
                outcome[i] += part.weight * v
                if part.verifier and correct[i] is None:
                    correct[i] = v
    return Scored(outcome, components, correct)


def _first_failing(part: Part, batch: list[RewardInput]) -> RewardInput:
    """The first response on which the component raises alone (for the error message)."""
    for it in batch:
        try:
            part.score([it])
        except Exception:
            return it
    return batch[0]


def describe_recipes(spec: Any) -> str:
    """One clause per source: 'arithmetic = 1.0*arithmetic; default = 1.0*math'."""
    terms: dict[str, list[str]] = {}
    for e in parse_table(spec):
        term = f"{e.get('weight', 1.0)}*{e.get('name', e.get('component'))}"
        terms.setdefault(str(e.get("source", "default")), []).append(term)
    return "; ".join(f"{source} = " + " + ".join(t) for source, t in terms.items())
