"""Environments for multi-turn episodes: the interface a tool-using agent's world implements.

An episode alternates the policy's turns and the environment's observations:

    env = make_environment(cfg.environment)           # one instance per episode (it keeps state)
    messages = env.reset(prompt_row)                   # the opening chat messages [{"role", "content"}]
    obs = env.step(action_text)                        # the policy's turn, decoded, parsed as data
    ... obs.text goes back to the policy in the chat template's tool role, until obs.done or max_turns
    env.outcome()                                      # episode-level reward components

The action is the policy's turn decoded for parsing only: the trained tokens are the sampled ids
(rollout keeps them; the environment never re-encodes them). Model text is data: an environment
parses it (JSON tool calls) and answers a malformed call, an unknown tool or wrong arguments with an
error observation and a zero reward component; it never evaluates or executes the text.

Rewards: step_rewards[t] = sum_c step_reward_weights[c] * obs_t.rewards[c] (action t's process
reward, placed at the end of policy turn t), outcome_reward = sum_c outcome_weights[c] *
outcome()[c]. Every component is written to the row's `reward_components`: the outcome ones as
returned, the per-action ones as their mean over the episode's actions (so `tool_success` reads as
the fraction of successful calls whatever the number of turns). A component a weight names but the
environment did not return counts 0 and is written as 0.

A user environment is a factory named `package.module:attr` (a class or a function) called once per
episode with `environment.config` (a dict); docs/agents.md has a small example.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from ...errors import ConfigError, DataError
from .. import config as config_lib
from ..models import chat
from .episodes import Episode, Limits, run_episodes


@dataclass(frozen=True)
class Observation:
    """What the environment answers to one action."""

    text: str
    """Appended to the episode in the chat template's tool role ("" when done: nothing is appended)."""
    rewards: dict[str, float]
    """This action's reward components, e.g. {"tool_success": 1.0, "content_quality": 0.5}."""
    done: bool
    """The episode ends after this action (the policy gets no further turn)."""


class Environment(Protocol):
    """One episode's world. A fresh instance per episode (the factory is called per episode)."""

    def reset(self, prompt: dict) -> list[dict]:
        """A task prompt row (keys prompt_id, prompt, answer, response, messages, source) -> the episode's opening chat
        messages [{"role": ..., "content": ...}] (system / user), rendered with the policy's chat template."""
        ...

    def step(self, action: str) -> Observation:
        """The policy's turn (decoded text, for parsing only) -> the observation and this action's rewards."""
        ...

    def outcome(self) -> dict[str, float]:
        """After the episode (done or max_turns): episode-level components, e.g. {"qa_accuracy": .., "compression": ..}."""
        ...


@dataclass
class EnvironmentConfig:
    """The `environment` section shared by rollout and evaluate: which world the policy acts in."""

    factory: str = ""
    """Environment as 'package.module:attr', called with `config` once per episode. Empty: single-turn rollouts."""
    config: dict = field(default_factory=dict)
    """Keyword settings passed to the factory as one dict (the environment's own knobs)."""
    max_turns: int = 4
    """Policy turns per episode at most; an episode not done by then ends and gets its outcome."""
    max_observation_tokens: int = 256
    """Most tokens of one observation turn (tool-role fragment); a longer one fails the stage, naming the row."""
    max_total_tokens: int = 0
    """Most tokens of one episode (opening + every turn); a turn is sampled only while the episode fits. 0 = the
    policy's window (or vllm.max_model_len); more than it is an error."""
    on_limit: str = "fail"
    """An episode whose next observation would pass max_total_tokens: 'fail' (error naming the row) or 'truncate'
    (the episode ends there, finish_reason 'length')."""
    step_reward_weights: dict = field(default_factory=dict)
    """Weight of each per-action component in step_rewards, e.g. {tool_success: 1.0, content_quality: 0.1}."""
    outcome_weights: dict = field(default_factory=dict)
    """Weight of each episode-level component in outcome_reward, e.g. {qa_accuracy: 1.0, compression: 0.05}."""

    def __post_init__(self):
        for key in ("max_turns", "max_observation_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"environment.{key} is {getattr(self, key)}; it must be at least 1.")
        if self.max_total_tokens < 0:
            raise ConfigError(f"environment.max_total_tokens is {self.max_total_tokens}; use 0 (the policy's window) "
                              f"or a positive count.")
        if self.on_limit not in ("fail", "truncate"):
            raise ConfigError(f"environment.on_limit is {self.on_limit!r}; use 'fail' or 'truncate'.")
        if self.factory:
            module, _, attr = self.factory.partition(":")
            if not module or not attr:
                raise ConfigError(f"environment.factory {self.factory!r} must look like 'package.module:attr'.")
        for key in ("step_reward_weights", "outcome_weights"):
            weights = getattr(self, key)
            if not isinstance(weights, Mapping):
                raise ConfigError(f"environment.{key} must be a mapping component -> weight, got {weights!r}.")
            for name, w in weights.items():
                if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
                    raise ConfigError(f"environment.{key}.{name} is {w!r}; a weight is a finite number.")

    @property
    def enabled(self) -> bool:
        return bool(self.factory)


def load_factory(spec: str) -> Callable[[dict], Environment]:
    """The callable named by 'package.module:attr' (imported when the stage runs)."""
    return config_lib.import_callable(spec, f"environment.factory {spec!r}")


def make_environment(cfg: EnvironmentConfig, factory: Callable | None = None) -> Environment:
    """A fresh environment for one episode; checks it has reset, step and outcome."""
    env = (factory or load_factory(cfg.factory))(dict(cfg.config))
    missing = [m for m in ("reset", "step", "outcome") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"environment.factory {cfg.factory!r} made a {type(env).__name__} without "
                          f"{', '.join(missing)}; an environment has reset(prompt), step(action) and outcome().")
    return env


def check_components(where: str, components) -> dict[str, float]:
    """A component mapping from an environment as {name: float}; a non-number or non-finite value is an error."""
    if not isinstance(components, Mapping):
        raise DataError(f"{where}: reward components must be a mapping name -> number, got {type(components).__name__}.")
    out = {}
    for k, v in components.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise DataError(f"{where}: reward component {k!r} is {v!r}, not a number.") from None
        if not math.isfinite(f):
            raise DataError(f"{where}: reward component {k!r} is {f}; the environment must return finite rewards.")
        out[str(k)] = f
    return out


def weighted(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """sum_c weights[c] * components[c] (a weighted component the environment did not return counts 0)."""
    return float(sum(float(w) * components.get(name, 0.0) for name, w in weights.items()))


def episode_components(step_components: Sequence[Mapping[str, float]], outcome: Mapping[str, float],
                       cfg: EnvironmentConfig) -> dict[str, float]:
    """The row's reward_components: outcome components as returned, per-action ones averaged over the actions
    (every weighted name present, 0 when never returned)."""
    names = sorted({k for c in step_components for k in c} | set(cfg.step_reward_weights))
    out = {n: (sum(c.get(n, 0.0) for c in step_components) / len(step_components) if step_components else 0.0)
           for n in names}
    for n in sorted(set(outcome) | set(cfg.outcome_weights)):
        if n in out:
            raise DataError(f"environment {cfg.factory!r}: component {n!r} is both per-action and episode-level; "
                            f"give them different names.")
        out[n] = float(outcome.get(n, 0.0))
    return out


# --- playing episodes: what rollout and evaluate share ---------------------------------------------

@dataclass
class Played:
    """One episode of a prompt row."""

    prompt: int       # index of its row in the records
    sample: int       # 0 .. n_samples - 1
    episode: Episode
    opening: str      # the opening messages as rendered (the row's `prompt` text)


def check_messages(messages, where: str) -> list[dict]:
    """An environment's opening messages as [{"role", "content"}], else a DataError naming the row."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: reset() must return a non-empty list of {{'role': str, 'content': str}} messages, "
                        f"got {messages!r:.200}.")
    return messages


def limits(cfg: EnvironmentConfig, window: tuple[int | None, str]) -> Limits:
    """The episode limits, max_total_tokens resolved against `window` (modeling.context_window's (tokens, name))."""
    tokens, name = window
    total = cfg.max_total_tokens or tokens
    if total is None:
        raise ConfigError("environment.max_total_tokens is 0 (the policy's window), but the policy does not say its "
                          "window; set environment.max_total_tokens.")
    if tokens is not None and total > tokens:
        raise ConfigError(f"environment.max_total_tokens={total} is more than {name}; lower it to at most {tokens}.")
    return Limits(cfg.max_turns, cfg.max_observation_tokens, total, cfg.on_limit)


def play(cfg: EnvironmentConfig, engine, tokenizer, records, n_samples: int, params, chat_template: bool = True,
         window: tuple[int | None, str] = (None, ""), progress=None, where: str = "the policy") -> list[Played]:
    """n_samples episodes per record (a tasks.PromptRecord), each with a fresh environment reset on the row's fields
    (prompt_id, prompt, answer, response, messages, source), run turn-synchronously on `engine` (HFEngine or VLLMEngine: one
    sample per context and turn; `params.n` is ignored). Rows in record order, samples in order."""
    factory = load_factory(cfg.factory)
    envs, opening, texts, names, index = [], [], [], [], []
    for i, r in enumerate(records):
        row = {k: v for k, v in dataclasses.asdict(r).items() if k != "images"}
        for j in range(n_samples):
            name = f"environment {cfg.factory!r}, prompt_id={r.prompt_id!r}, sample {j}"
            env = make_environment(cfg, factory)
            text, ids = chat.opening_ids(tokenizer, check_messages(env.reset(dict(row)), name), chat_template)
            envs.append(env), opening.append(ids), texts.append(text), names.append(name), index.append((i, j))

    def generate(contexts, p):
        return [c[0] for c in engine.generate(contexts, p)]

    try:
        episodes = run_episodes(generate, tokenizer, envs, opening, params, limits(cfg, window),
                                templated=chat_template and bool(getattr(tokenizer, "chat_template", None)),
                                names=names, check=check_components, progress=progress)
    except chat.ChatTurnError as e:
        raise DataError(f"environment {cfg.factory!r}, {where}: {e}. Use a tokenizer whose chat template has a tool role "
                        f"(Qwen2.5's), or chat_template=false (plain turns).") from None
    return [Played(i, j, ep, t) for (i, j), ep, t in zip(index, episodes, texts)]


EMPTY_STEP = "(empty turn)"
"""The step text of a turn that decodes to nothing, so the response text still has one step per policy turn."""


def episode_text(ep: Episode, separator: str) -> str:
    """The episode as a PRM reads it, one step per policy turn: step k is the observation before turn k (none for
    the first) and turn k's text, separators inside replaced by spaces, steps joined by `separator` (rollout writes it
    as the row's response; evaluate scores it)."""
    def clean(s: str) -> str:
        return " ".join(s.replace(separator, " ").split())
    out = []
    for k, action in enumerate(ep.actions):
        before = clean(ep.observations[k - 1]) + " " if 0 < k <= len(ep.observations) else ""
        out.append((before + clean(action)).strip() or EMPTY_STEP)
    return separator.join(out)
