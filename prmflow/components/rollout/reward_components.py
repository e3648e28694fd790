"""Reward components: the kinds of term a reward recipe (outcome_rewards.py) adds up, registered by name.

A component turns a batch of sampled responses into one float each. The kinds:
- arithmetic: the built-in task's exact verifier (1 or 0): the last `answer: N` line holds N.
- math: the final-answer verifier of datasets (GSM8K, MATH, ...): the tasks package's grader
  (`grader.grade_math` in the row source's convention, gsm8k / math / default: last \\boxed{...},
  else an `answer:` line, else `####`, else the last number; plain numbers compared exactly,
  LaTeX by math-verify). It is the grader `tasks.verify`
  uses for the same rows, so rollout's reward and every reported accuracy agree.
- http: a remote reward model. POST {"prompts", "responses", "answers", "prompt_ids", "sources"}
  (lists, one entry per response) -> {"rewards": [float, ...]}; retried with exponential backoff
  on connection errors, timeouts, 429 and 5xx; other 4xx fail at once.
- function: a user function `module:function`, called per response with the keyword arguments
  it accepts among prompt, response, answer, prompt_id, source; returns a float.
"""

from __future__ import annotations

import inspect
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from ...errors import ConfigError, PrmflowError
from ...tasks import arithmetic, grader
from .. import config as config_lib


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


@register("math", verifier=True)
def math_verifier() -> Component:
    """1.0 when the response's final answer equals the reference (the tasks grader, as in every accuracy)."""
    return lambda items: [grader.grade_math(it.response, _need_answer(it, "math"), it.source) for it in items]


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
    return config_lib.import_callable(spec, f"function reward {spec!r}")


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
