"""Outcome rewards: a recipe is a weighted sum of named components, chosen per row by its source.

    rewards:                      # config: one entry per (source, component)
      - {source: arithmetic, component: arithmetic}
      - {source: gsm8k, component: math, weight: 1.0}
      - {source: gsm8k, component: http, weight: 0.5, name: rm, url: "http://rm:8000/score", timeout_s: 10}
      - {source: gsm8k, component: function, weight: 0.1, function: "mypkg.rewards:brevity"}
      - {source: default, component: math}   # rows whose source has no recipe of its own

A row's recipe is every entry with its `source` (else the `default` entries).
outcome_reward = sum(weight * value); every component's unweighted value is kept in the row's
reward_components under its name (default: the component type). Components, registered by name:
- arithmetic: the built-in task's exact verifier (1 or 0).
- math: final-answer verifier: takes the last \\boxed{...} (else an `answer:` line, else `####`,
  else the last number), normalizes numbers and simple LaTeX (\\frac{a}{b}, \\dfrac, \\left/\\right,
  $...$, thousands commas, %, degrees) and compares with the reference numerically (exact
  fractions), else as normalized text.
- http: a remote reward model. POST {"prompts", "responses", "answers", "prompt_ids", "sources"}
  (lists, one entry per response) -> {"rewards": [float, ...]}; retried with exponential backoff
  on connection errors, timeouts, 429 and 5xx; other 4xx fail at once.
- function: a user function `module:function`, called per response with the keyword arguments
  it accepts among prompt, response, answer, prompt_id, source; returns a float.

A component that raises or returns NaN/inf is a RewardError naming the component and the row's
prompt_id: a reward is never written silently wrong.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from ..common.errors import ConfigError, PrmflowError
from ..common.tasks import arithmetic

log = logging.getLogger(__name__)


class RewardError(PrmflowError):
    """A reward component failed or produced a non-finite reward."""


@dataclass
class RewardInput:
    """What a reward component sees of one sampled response."""

    prompt_id: str
    sample_idx: int
    prompt: str
    response: str
    answer: str | None
    source: str


Component = Callable[[list[RewardInput]], list[float]]  # a batch of responses -> one reward each

#: component type -> (factory(**params) -> Component, is_verifier)
COMPONENTS: dict[str, tuple[Callable[..., Component], bool]] = {}


def register(name: str, verifier: bool = False):
    """Register a component factory under `name`; verifiers (exact correctness) feed rollout/accuracy."""
    def deco(factory):
        COMPONENTS[name] = (factory, verifier)
        return factory
    return deco


# --- verifiers -----------------------------------------------------------------------------------

def _need_answer(item: RewardInput, what: str) -> str:
    if item.answer is None:
        raise RewardError(f"prompt_id={item.prompt_id!r} (source {item.source!r}) has no reference answer, but the "
                          f"{what} verifier needs one. Add an answer to the dataset or use another reward component.")
    return item.answer


@register("arithmetic", verifier=True)
def arithmetic_verifier() -> Component:
    """1.0 when the `answer: N` line equals the reference (the built-in task's verifier), else 0.0."""
    return lambda items: [arithmetic.verify(it.response, _need_answer(it, "arithmetic")) for it in items]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, with nested braces; None if none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


def extract_final_answer(response: str) -> str | None:
    """The final answer of a response: last \\boxed{}, else an `answer:` line, else `#### x`, else the last number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    for line in reversed(response.strip().splitlines()):
        m = re.match(r"^\s*(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*(.+?)\s*$", line, re.IGNORECASE)
        if m:
            return m.group(1)
    m = re.search(r"####\s*(.+?)\s*$", response.strip())
    if m:
        return m.group(1)
    numbers = re.findall(_NUMBER, response)
    return numbers[-1] if numbers else None


def _strip_braces(s: str) -> str:
    while s.startswith("{") and s.endswith("}") and last_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1]
    return s


def normalize_answer(s: str) -> str:
    """Canonical text of an answer: LaTeX wrappers, spacing, units of form removed; \\frac{a}{b} -> (a)/(b)."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ ", "", s)
    s = re.sub(r"\^\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    for _ in range(8):  # innermost first, so nested fractions resolve
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
        new = re.sub(r"\\frac(\d)(\d)", r"(\1)/(\2)", new)
        if new == s:
            break
        s = new
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = re.sub(r"\s+", "", s)
    s = _strip_braces(s)
    return s.rstrip(".")


def as_number(s: str) -> Fraction | None:
    """The exact value of a normalized answer made of numbers, + - * / and parentheses; None otherwise."""
    if not s or not re.fullmatch(r"[\d.()+\-*/]+", s) or not re.search(r"\d", s):
        return None
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval(node.left), _eval(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Div):
            return None if b == 0 else a / b
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    return None


def answers_match(given: str, reference: str) -> bool:
    """True when two answers are equal as exact numbers, else as normalized text."""
    a, b = normalize_answer(given), normalize_answer(reference)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b and a != ""


@register("math", verifier=True)
def math_verifier() -> Component:
    """1.0 when the response's final answer equals the reference (numbers and simple LaTeX normalized)."""
    def score(items):
        out = []
        for it in items:
            ref = _need_answer(it, "math")
            got = extract_final_answer(it.response)
            out.append(1.0 if got is not None and answers_match(got, ref) else 0.0)
        return out
    return score


# --- remote reward model -------------------------------------------------------------------------

@register("http")
def http_reward_model(url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5,
                      batch_size: int = 64, headers: dict | None = None) -> Component:
    """POST batches of responses to a reward-model server; see the module docstring for the protocol."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"http reward component: url {url!r} must start with http:// or https://.")

    def post(batch: list[RewardInput]) -> list[float]:
        body = json.dumps({"prompts": [b.prompt for b in batch], "responses": [b.response for b in batch],
                           "answers": [b.answer for b in batch], "prompt_ids": [b.prompt_id for b in batch],
                           "sources": [b.source for b in batch]}).encode()
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    payload = json.loads(resp.read().decode())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
                if e.code == 429 or e.code >= 500:
                    continue
                raise RewardError(f"reward model {url} refused the request ({last}); check the url and the protocol.") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            except json.JSONDecodeError as e:
                raise RewardError(f"reward model {url} did not answer JSON ({e}).") from None
            rewards = payload.get("rewards") if isinstance(payload, dict) else None
            if not isinstance(rewards, list) or len(rewards) != len(batch):
                raise RewardError(f"reward model {url} answered {str(payload)[:200]!r}; expected "
                                  f"{{\"rewards\": [{len(batch)} numbers]}}.")
            return [float(r) if r is not None else math.nan for r in rewards]
        raise RewardError(f"reward model {url} failed {retries + 1} time(s) (timeout {timeout_s}s); last error: {last}. "
                          f"Check that the server is up, or raise timeout_s/retries.")

    def score(items):
        out: list[float] = []
        for i in range(0, len(items), batch_size):
            out += post(items[i:i + batch_size])
        return out
    return score


# --- user function -------------------------------------------------------------------------------

def import_function(spec: str) -> Callable:
    """The callable named by 'package.module:function'."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"function reward {spec!r} must look like 'package.module:function'.")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"function reward {spec!r}: cannot import module {module!r} ({e}). Is it installed or on PYTHONPATH?") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"function reward {spec!r}: module {module!r} has no function {name!r}.")
    return fn


@register("function")
def function_reward(function: str) -> Component:
    """Call a user function per response with the keywords it accepts (prompt, response, answer, prompt_id, source)."""
    fn = import_function(function)
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    fields = ("prompt", "response", "answer", "prompt_id", "source")
    wanted = [f for f in fields if takes_all or f in params]

    def score(items):
        return [float(fn(**{f: getattr(it, f) for f in wanted})) for it in items]
    return score


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
        terms.setdefault(str(e.get("source", "default")), []).append(f"{e.get('weight', 1.0)}*{e.get('name', e.get('component'))}")
    return "; ".join(f"{source} = " + " + ".join(t) for source, t in terms.items())
