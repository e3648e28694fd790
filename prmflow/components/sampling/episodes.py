"""Multi-turn episodes: the policy and an environment take turns, batched across episodes.

    episodes = run_episodes(generate, tokenizer, envs, opening, params, limits)
    episodes[i].response_ids, .policy_mask, .logprobs, .step_ends, .step_components, .outcome

Turn-synchronous: every live episode's context (its opening ids and every turn so far) goes to the engine as
one prompt, one sample each; `generate` wraps HFEngine's or VLLMEngine's (one engine for all turns; vLLM's prefix
cache, on by default in its V1 engine (vllm-project/vllm tests/v1/engine/test_engine_args.py `test_defaults`),
keeps a context's KV from one turn to the next; the HF engine prefills each context again). A policy turn ends at
the engine's stop ids (EOS, the chat template's end of turn), a stop string or max_new_tokens. Its sampled ids
are appended as they are (policy tokens); the environment gets the turn decoded, for parsing only, and its
observation is rendered once as a chat-template fragment (`chat.observation_ids`) and appended as ids
(environment tokens, logprob 0). Nothing is decoded and re-encoded: the row's ids are the ids sampled plus the
ids appended.

An episode ends when the environment says done, after max_turns policy turns, when a turn is cut by
max_new_tokens (finish_reason 'length': its action still goes to the environment, whose answer is not
appended), or when the next turn would not fit max_total_tokens (on_limit: 'truncate' ends it with finish_reason
'length', 'fail' raises a DataError naming the row). Opening messages that leave no room for one turn, and an
observation longer than max_observation_tokens, are always errors naming the row.

Seeds: turn k's generation draws from `turn_seed(params.seed, k)`, so an episode's samples are fixed by the
seed, its prompt and the engine's batching, as single-turn sampling is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...errors import DataError
from ..models import chat
from .engines import LENGTH, STOP, SamplingParams


@dataclass
class Limits:
    """How long an episode may grow (the environment section's keys, named in errors)."""

    max_turns: int = 4
    max_observation_tokens: int = 256
    max_total_tokens: int = 1024
    on_limit: str = "fail"


@dataclass
class Episode:
    """One episode: the opening ids and everything after them, token by token."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)     # 1: sampled by the policy, 0: appended by the environment
    logprobs: list[float] = field(default_factory=list)      # the sampler's log-prob of each policy token, 0.0 elsewhere
    step_ends: list[int] = field(default_factory=list)       # last token of each policy turn
    actions: list[str] = field(default_factory=list)         # each policy turn decoded (what the environment parsed)
    observations: list[str] = field(default_factory=list)    # each observation text appended
    step_components: list[dict] = field(default_factory=list)  # each action's reward components
    outcome: dict = field(default_factory=dict)               # the episode-level components
    finish_reason: str = STOP
    done: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (turn 0 keeps `seed`: a one-turn episode draws as single-turn sampling)."""
    return (seed + turn * 998_244_353) % (2**63)


def run_episodes(generate: Callable[[list[list[int]], SamplingParams], list], tokenizer, envs: Sequence,
                 opening: Sequence[list[int]], params: SamplingParams, limits: Limits, templated: bool = True,
                 names: Sequence[str] | None = None, check: Callable[[str, dict], dict] | None = None,
                 progress: Callable[[int], None] | None = None) -> list[Episode]:
    """Run one episode per env, turn-synchronously. `generate(contexts, params)` returns one engine
    Completion per context (params.n is 1). `opening[i]` are episode i's opening ids (env i already reset).
    `names[i]` names the episode in errors; `check(where, components)` validates reward components."""
    names = list(names) if names is not None else [f"episode {i}" for i in range(len(envs))]
    check = check or (lambda where, c: dict(c))
    episodes = [Episode(list(ids)) for ids in opening]
    eot = chat.end_of_turn_id(tokenizer, templated)
    for i, ep in enumerate(episodes):
        if len(ep.prompt_ids) + params.max_new_tokens > limits.max_total_tokens:  # not even one turn: always an error
            raise DataError(f"{names[i]}: its opening messages are {len(ep.prompt_ids)} tokens; with a turn of "
                            f"sampling.max_new_tokens={params.max_new_tokens} that passes environment.max_total_tokens="
                            f"{limits.max_total_tokens}. Raise it, or lower sampling.max_new_tokens.")
    for turn in range(limits.max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            break
        turn_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": turn_seed(params.seed, turn)})
        completions = generate([episodes[i].context for i in live], turn_params)
        for i, c in zip(live, completions):
            ep = episodes[i]
            ep.response_ids += list(c.token_ids)
            ep.policy_mask += [1] * len(c.token_ids)
            ep.logprobs += list(c.logprobs)
            ep.step_ends.append(len(ep.response_ids) - 1)
            action = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            ep.actions.append(action)
            obs = envs[i].step(action)
            ep.step_components.append(check(f"{names[i]}, turn {turn}", obs.rewards))
            if obs.done or turn == limits.max_turns - 1:
                ep.done = True
                continue
            if c.finish_reason == LENGTH:  # the turn has no end-of-turn token: no tool turn can follow it
                ep.done, ep.finish_reason = True, LENGTH
                continue
            closed = bool(c.token_ids) and c.token_ids[-1] == eot  # else a stop string ended the turn
            ids = chat.observation_ids(tokenizer, obs.text, templated, closed)
            if len(ids) > limits.max_observation_tokens:
                raise DataError(f"{names[i]}, turn {turn}: the environment's observation is {len(ids)} tokens, more "
                                f"than environment.max_observation_tokens={limits.max_observation_tokens}. Raise the "
                                f"limit, or make the environment answer shorter (cut its tool results).")
            if len(ep.context) + len(ids) + params.max_new_tokens > limits.max_total_tokens:
                _limit(ep, names[i], limits, f"after turn {turn} it is {len(ep.context)} tokens, and the "
                                             f"observation ({len(ids)}) and a turn of sampling.max_new_tokens="
                                             f"{params.max_new_tokens} more")
                continue
            ep.response_ids += ids
            ep.policy_mask += [0] * len(ids)
            ep.logprobs += [0.0] * len(ids)
            ep.observations.append(obs.text)
        if progress is not None:
            progress(len(live))
    for i, ep in enumerate(episodes):
        ep.outcome = check(f"{names[i]}, outcome", envs[i].outcome())
    return episodes


def _limit(ep: Episode, name: str, limits: Limits, what: str) -> None:
    """An episode that would pass max_total_tokens: fail (naming it) or end it here (finish_reason 'length')."""
    if limits.on_limit == "fail":
        raise DataError(f"{name}: {what} would pass environment.max_total_tokens={limits.max_total_tokens}. Raise it, "
                        f"lower environment.max_turns or sampling.max_new_tokens, or set environment.on_limit=truncate "
                        f"to end such episodes early.")
    ep.done, ep.finish_reason = True, LENGTH
