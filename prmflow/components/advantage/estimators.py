"""Advantage estimators on ragged batches, one small function each, registered by name.

Every per-token quantity lives in a flat (N,) array holding the B responses of a batch end to end
(no padding, so nothing has to be masked); `Ragged` says where each response starts. Per-response
quantities are (B,) arrays, per-step ones (S,) arrays. All math is float64; the stage casts to
float32 when it writes.

    ESTIMATORS["gae"].compute(available) -> (advantages (N,), returns (N,))

Each estimator is one function whose arguments name exactly what it reads (veRL's model,
volcengine/verl verl/trainer/ppo/core_algos.py: `compute_grpo_outcome_advantage(token_level_rewards,
response_mask, index, epsilon, ...)`, registered by name); `Estimator.compute` passes it those
entries of the batch's `available` inputs (INPUTS says what each one is) and nothing else.

The definitions are those of docs/design.md "Token rewards" and "Advantage estimators"; each
docstring names the slow loop it equals, and tests/advantage compares the two on random ragged batches.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from .moments import Moments, group_moments, merge_group_moments  # noqa: F401 - the estimators' statistics
from .scan import blocked_reverse_scan


# --- ragged layout -------------------------------------------------------------------------------

@dataclass
class Ragged:
    """Layout of B variable-length responses packed end to end into flat (N,) arrays."""

    lengths: np.ndarray
    """(B,) int64 number of response tokens of each row."""
    offsets: np.ndarray
    """(B+1,) int64 flat index where each row starts; offsets[B] = N."""

    @classmethod
    def from_lengths(cls, lengths: np.ndarray) -> "Ragged":
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(lengths, offsets)

    @property
    def n_rows(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @cached_property
    def nonempty(self) -> np.ndarray:
        """(B,) bool: the row has at least one token."""
        return self.lengths > 0

    @cached_property
    def starts(self) -> np.ndarray:
        """(B',) flat index of the first token of each non-empty row."""
        return self.offsets[:-1][self.nonempty]

    @cached_property
    def last(self) -> np.ndarray:
        """(B',) flat index of the last token of each non-empty row."""
        return self.offsets[1:][self.nonempty] - 1

    @cached_property
    def pos(self) -> np.ndarray:
        """(N,) int64 index of each token within its row (0 = first response token)."""
        return np.arange(self.n_tokens, dtype=np.int64) - np.repeat(self.offsets[:-1], self.lengths)

    def broadcast(self, per_row: np.ndarray) -> np.ndarray:
        """(B,) -> (N,): every token gets its row's value."""
        return np.repeat(per_row, self.lengths)

    def row_sums(self, flat: np.ndarray) -> np.ndarray:
        """(N,) -> (B,) sum over each row's tokens (0 for empty rows)."""
        out = np.zeros(self.n_rows, dtype=np.float64)
        if self.n_tokens:
            out[self.nonempty] = np.add.reduceat(flat, self.starts)
        return out


def discounted_reverse_cumsum(x: np.ndarray, layout: Ragged, discount: float, overwrite_x: bool = False) -> np.ndarray:
    """y[t] = sum over k >= t in t's row of discount**(k - t) * x[k].    x, y: (N,) float64.

    Slow equivalent, per row: `for t in reversed(range(L)): y[t] = x[t] + discount * y[t + 1]`
    (y[L] = 0). For 0 < discount < 1 this is scan.blocked_reverse_scan (a blocked matrix product; its
    docstring says how). For discount 1 it is numpy's cumsum run backwards over the whole flat array
    as if it were one row: what would leak from row i+1 into row i is y[first token of row i+1], the
    row's sum; subtracting it at row i's last token beforehand cancels the leak exactly.
    overwrite_x: x is a float64 temporary the caller gives up, so no copy is made.
    """
    if layout.n_tokens == 0 or discount == 0.0:
        return x if overwrite_x and x.dtype == np.float64 else np.array(x, dtype=np.float64)
    if discount != 1.0:
        return blocked_reverse_scan(np.asarray(x, dtype=np.float64), layout.starts[1:], discount)
    y = x if overwrite_x and x.dtype == np.float64 else np.array(x, dtype=np.float64)
    head = np.add.reduceat(y, layout.starts)  # (B',) y at each row's first token
    y[layout.last[:-1]] -= head[1:]
    out = np.empty_like(y)  # the same recurrence y[t] = x[t] + y[t+1], summed in the same order: bit-identical
    np.cumsum(y[::-1], out=out[::-1])  # into a reversed view: no reversed copy, a contiguous result
    return out


def step_suffix_sums(token: np.ndarray, row: np.ndarray, layout: Ragged, *per_step: np.ndarray) -> list[np.ndarray]:
    """For each (S,) array v of per-step values: the (N,) array y with y[t] = the sum of v over the steps
    of t's row that end at or after token t (0 after a row's last step).

    The same numbers as discounted_reverse_cumsum(np.bincount(token, v, N), layout, 1.0), up to float
    rounding, without a pass over the N tokens but the one that writes y: a step reward is constant
    between two step ends, so the suffix sums are taken over the S steps (S << N) and each is repeated
    over the tokens up to its step's end. token: (S,) flat index of each step's last token; row: (S,)
    its row.
    """
    if len(token) > 1 and (np.diff(token) < 0).any():  # steps are normally in order already
        order = np.argsort(token, kind="stable")
        token, row, per_step = token[order], row[order], tuple(v[order] for v in per_step)
    n_steps, n_rows = len(token), layout.n_rows
    by_row = Ragged.from_lengths(np.bincount(row, minlength=n_rows))
    # segments, in token order: each step's (up to and including its end), then its row's tail
    at_step = np.arange(n_steps) + row  # steps before it + tails of the rows before it
    at_tail = by_row.offsets[1:] + np.arange(n_rows)
    ends = np.empty(n_steps + n_rows, dtype=np.int64)
    ends[at_step] = token + 1
    ends[at_tail] = layout.offsets[1:]
    counts = np.diff(ends, prepend=0)  # tokens per segment
    if (counts < 0).any():
        raise ValueError("step_suffix_sums: a step's token lies outside its row")
    out = []
    seg = np.zeros(n_steps + n_rows, dtype=np.float64)  # tails stay 0
    for v in per_step:
        seg[at_step] = discounted_reverse_cumsum(v, by_row, 1.0)
        out.append(np.repeat(seg, counts))
    return out


# --- estimator inputs and registry ------------------------------------------------------------

@dataclass
class Steps:
    """The step rewards of a batch as they enter the token rewards, one entry per step."""

    token: np.ndarray
    """(S,) int64 flat token index of the step's last token (offsets[row] + step_end)."""
    row: np.ndarray
    """(S,) int64 row of the step."""
    value: np.ndarray
    """(S,) float64 step reward after step_reward_mode and reward_clip."""


INPUTS = {
    "layout": "Ragged: where each of the B rows starts in the flat (N,) arrays",
    "token_rewards": "(N,) r_t = -beta*kl_t + step rewards at step ends + outcome at the last token",
    "gamma": "discount per token", "lam": "GAE lambda",
    "eps": "added to every std divided by, so equal-reward groups give 0, not NaN",
    "values": "(N,) critic value V_t",
    "outcome": "(B,) outcome reward R_i after reward_clip",
    "steps": "Steps: the step rewards at their tokens (the step estimators': the last step runs to the last token)",
    "group_n": "(B,) samples in the row's group",
    "group_mean": "(B,) mean of the group signal (the outcome, or every step reward when outcome is off)",
    "group_std": "(B,) std (ddof=1) of the group signal; 0 for equal-reward groups",
    "group_sum": "(B,) sum of the group signal",
    "process_weight": "grpo_progress: the process weight after the evidence gate",
    "process_credit": "grpo_progress: 'step' or 'baseline'",
    "process_values": "(S,) grpo_progress: each step's process term before the weight (progress.process_credit)",
    "recorded_ends": "(S,) grpo_progress: flat index of each step's last token as step_ends records it (the last "
                     "step not run on to the row's end)",
    "boundary_lag": "grpo_progress: the most tokens the step separator can span (its UTF-8 bytes; 1 for a newline)",
}
"""What an estimator may name as an argument, and what it is."""

EstimatorFn = Callable[..., "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class Estimator:
    """A registered estimator and what it needs from the data and the config."""

    name: str
    fn: EstimatorFn
    inputs: tuple[str, ...] = ()
    """The INPUTS its arguments name (read from its signature)."""
    needs_values: bool = False
    """Reads the critic's `values` column."""
    min_group_size: int = 1
    """Fewest samples per prompt_id the estimator is defined for."""
    uses_token_rewards: bool = True
    """Advantages are built from token_rewards (so KL, step and outcome switches all count)."""
    signal: str = "any"
    """Which rewards it is defined on: 'outcome', 'steps' or 'any' (whatever the switches add)."""
    whiten: bool = False
    """Whiten the advantages unless the config says otherwise (REINFORCE++ does)."""
    process: bool = False
    """Adds a process advantage from step_reward_mode=progress step rewards to an outcome advantage."""

    def compute(self, available: dict) -> tuple[np.ndarray, np.ndarray]:
        """(advantages (N,), returns (N,)) from the entries of `available` this estimator names."""
        missing = [k for k in self.inputs if available.get(k) is None]
        if missing:
            raise ValueError(f"estimator {self.name} needs {missing}, which this batch does not provide")
        return self.fn(**{k: available[k] for k in self.inputs})


ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, **props) -> Callable[[EstimatorFn], EstimatorFn]:
    """Add the decorated function to ESTIMATORS under `name`; its argument names must be INPUTS."""
    def wrap(fn: EstimatorFn) -> EstimatorFn:
        inputs = tuple(inspect.signature(fn).parameters)
        unknown = set(inputs) - set(INPUTS)
        if unknown:
            raise TypeError(f"estimator {name} names {sorted(unknown)}, which are not INPUTS")
        ESTIMATORS[name] = Estimator(name, fn, inputs, **props)
        return fn
    return wrap


def returns_to_go(token_rewards: np.ndarray, layout: Ragged, gamma: float) -> np.ndarray:
    """(N,) G_t = r_t + gamma * G_{t+1}: the `returns` column of every estimator but gae."""
    return discounted_reverse_cumsum(token_rewards, layout, gamma)


# --- the estimators -------------------------------------------------------------------------------

@register("gae", needs_values=True)
def gae(token_rewards: np.ndarray, values: np.ndarray, layout: Ragged, gamma: float,
        lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE with a critic: A_t = delta_t + gamma*lambda*A_{t+1}, returns = A + V.

    delta_t = r_t + gamma*V_{t+1} - V_t with V = 0 after the last token (Schulman et al. 2015,
    https://arxiv.org/abs/1506.02438). Slow equivalent: the per-token reverse loop.
    """
    v = values
    delta = token_rewards - v  # (N,) a fresh array, finished in place below
    delta[:-1] += gamma * v[1:] if gamma != 1.0 else v[1:]
    ends = layout.last[:-1]  # the episode ends with the response: no V from the next row
    delta[ends] -= gamma * v[ends + 1]
    adv = discounted_reverse_cumsum(delta, layout, gamma * lam, overwrite_x=True)
    # delta is spent: its memory takes the returns (a fresh (N,) array costs its page faults again)
    return adv, np.add(adv, v, out=delta if adv is not delta else None)


@register("reinforce")
def reinforce(token_rewards: np.ndarray, layout: Ragged, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """REINFORCE returns-to-go A_t = G_t (REINFORCE++ when whitened, whiten=true)."""
    g = returns_to_go(token_rewards, layout, gamma)
    return g, g


@register("reinforce_baseline", min_group_size=2, signal="outcome", whiten=True)
def reinforce_baseline(token_rewards: np.ndarray, group_mean: np.ndarray, layout: Ragged,
                       gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """REINFORCE++-baseline: returns-to-go after subtracting the group-mean outcome, whitened.

    The baseline replaces R_i by R_i - mean_group(R) at the last token before the discounted sum
    (Hu et al., https://arxiv.org/abs/2501.03262); `returns` stay those of the raw token rewards.
    """
    shifted = token_rewards.copy()
    shifted[layout.last] -= group_mean[layout.nonempty]
    adv = discounted_reverse_cumsum(shifted, layout, gamma)
    return adv, returns_to_go(token_rewards, layout, gamma)


@register("grpo", min_group_size=2, uses_token_rewards=False, signal="outcome")
def grpo(outcome: np.ndarray, group_mean: np.ndarray, group_std: np.ndarray, eps: float, layout: Ragged,
         token_rewards: np.ndarray, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """GRPO: A_i = (R_i - mean_group) / (std_group + eps) on every token of sample i."""
    per_row = (outcome - group_mean) / (group_std + eps)
    return layout.broadcast(per_row), returns_to_go(token_rewards, layout, gamma)


@register("dr_grpo", min_group_size=2, uses_token_rewards=False, signal="outcome")
def dr_grpo(outcome: np.ndarray, group_mean: np.ndarray, layout: Ragged, token_rewards: np.ndarray,
            gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Dr. GRPO: A_i = R_i - mean_group, no division by the std (https://arxiv.org/abs/2503.20783)."""
    return layout.broadcast(outcome - group_mean), returns_to_go(token_rewards, layout, gamma)


@register("rloo", min_group_size=2, uses_token_rewards=False, signal="outcome")
def rloo(outcome: np.ndarray, group_sum: np.ndarray, group_n: np.ndarray, layout: Ragged,
         token_rewards: np.ndarray, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """RLOO: A_i = R_i - mean of the other samples' rewards in the group."""
    others = (group_sum - outcome) / (group_n - 1)
    return layout.broadcast(outcome - others), returns_to_go(token_rewards, layout, gamma)


@register("grpo_process", min_group_size=2, uses_token_rewards=False, signal="steps")
def grpo_process(steps: Steps, group_mean: np.ndarray, group_std: np.ndarray, eps: float, layout: Ragged,
                 token_rewards: np.ndarray, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Process-supervised GRPO: A_t = sum of group-normalized rewards of steps ending at or after t.

    Every step reward is normalized by the mean and std of all step rewards in its group
    (DeepSeekMath, https://arxiv.org/abs/2402.03300, section 4.1.3); the sum is undiscounted.
    The last step runs to the row's last token; a row with no step end is one step scored
    rewards.STEPLESS_SCORE (rewards.make_steps). Slow equivalent: for each token, loop over the row's
    steps and add those with end >= t.
    """
    st = steps
    normalized = (st.value - group_mean[st.row]) / (group_std[st.row] + eps)
    if gamma != 1.0:
        return step_suffix_sums(st.token, st.row, layout, normalized)[0], returns_to_go(token_rewards, layout, gamma)
    # undiscounted, and the token rewards are the step rewards alone (the stage refuses an outcome or a KL
    # penalty here): the returns are their suffix sums too
    advantages, returns = step_suffix_sums(st.token, st.row, layout, normalized, st.value)
    return advantages, returns


def per_step_token_values(steps: Steps, layout: Ragged, per_step: np.ndarray) -> np.ndarray:
    """(N,) every token carries the value of the step it belongs to: tokens after step k-1's end up to
    and including step k's end get per_step[k]; steps that end in the same token add up there; tokens
    after a row's last step end get 0. Slow equivalent, per row: walk the tokens, advancing to the next
    step end at or after each token."""
    at_end = np.bincount(steps.token, weights=per_step, minlength=layout.n_tokens)
    ends = np.unique(steps.token)  # (S',) sorted flat end tokens
    out = np.zeros(layout.n_tokens, dtype=np.float64)
    if not len(ends):
        return out
    tok = np.arange(layout.n_tokens)
    j = np.searchsorted(ends, tok, side="left")  # (N,) the first step end at or after each token
    inside = j < len(ends)
    row_of_token = np.repeat(np.arange(layout.n_rows), layout.lengths)
    row_of_end = row_of_token[ends]
    ok = inside.copy()
    ok[inside] = row_of_end[j[inside]] == row_of_token[inside]
    out[ok] = at_end[ends[j[ok]]]
    return out


def closed_step_values(recorded_ends: np.ndarray, row: np.ndarray, layout: Ragged, per_step: np.ndarray,
                       lag: int = 1) -> np.ndarray:
    """(N,) token t gets per_step[j] of the last step j of its row whose recorded last token is before t - lag
    (<= t - lag - 1), 0 while there is none; lag: the most tokens the separator can span (its bytes: 1 for a
    newline). The tokens right after a step's last token are where the policy chooses whether the step ends
    (a separator token, one that opens the next step with the separator, or anything else), so they still get
    the value of the step before. Each token holds at least one byte, so once step j's last token is before
    t - lag the whole separator lies in tokens before t: which steps have closed is read from the tokens before
    t alone, and a term built from it is a baseline that does not depend on the action it scores.
    recorded_ends: (S,) flat index of each step's last token, row: (S,) its row. Slow equivalent, per row:
    `closed = [j for j, e in enumerate(ends) if e < t - lag]; out[t] = per_step[closed[-1]] if closed else 0`."""
    out = np.zeros(layout.n_tokens, dtype=np.float64)
    if not len(recorded_ends) or not layout.n_tokens:
        return out
    order = np.argsort(recorded_ends, kind="stable")  # steps are normally in order already
    ends, rows, values = recorded_ends[order], row[order], per_step[order]
    tok = np.arange(layout.n_tokens)
    j = np.searchsorted(ends, tok - lag, side="left") - 1  # (N,) the last step ending before t - lag, any row
    row_of_token = np.repeat(np.arange(layout.n_rows), layout.lengths)
    ok = j >= 0
    ok[ok] = rows[j[ok]] == row_of_token[ok]
    out[ok] = values[j[ok]]
    return out


def balanced_token_values(steps: Steps, layout: Ragged, per_step: np.ndarray) -> np.ndarray:
    """(N,) per_step spread over the tokens of each step, balanced per token: a token of step k gets
    per_step[k] x Lbar / L_k, L_k the step's tokens, Lbar the mean of L over the row's steps (steps that end
    in the same token are one span and add up). A row's tokens then sum to Lbar x the sum of its per_step
    values: 0 for centered values, whatever the steps' lengths. Slow equivalent:
    tests/advantage/advantage_reference.py `grpo_progress`."""
    ends = np.unique(steps.token)  # (S',) sorted flat end token of each span
    if not len(ends):
        return np.zeros(layout.n_tokens)
    at_end = np.bincount(steps.token, weights=per_step, minlength=layout.n_tokens)[ends]
    row = np.searchsorted(layout.offsets, ends, side="right") - 1  # (S',) the span's row
    before = np.empty_like(ends)  # the token before the span starts
    before[1:] = ends[:-1]
    starts_row = np.r_[True, row[1:] != row[:-1]]
    before[starts_row] = layout.offsets[row[starts_row]] - 1
    length = (ends - before).astype(np.float64)
    spans = np.bincount(row, minlength=layout.n_rows).astype(np.float64)
    mean_length = np.divide(np.bincount(row, length, layout.n_rows), spans, out=np.zeros(layout.n_rows),
                            where=spans > 0)
    scaled = at_end * mean_length[row] / length
    return per_step_token_values(Steps(ends, row, scaled), layout, scaled)


PROCESS_BOUND = 2.0
"""grpo_progress's step credit: no token's process credit exceeds PROCESS_BOUND x |A^out_i| in size (x w, the gated
weight, in a row whose A^out_i is 0). Balancing per token (z_k x Lbar / L_k) has no bound of its own: a 1-token
step of a 100-token response gets ~50x its z."""


def shrink_to_bounds(outcome_adv: np.ndarray, process: np.ndarray, layout: Ragged, weight: float) -> np.ndarray:
    """(N,) outcome_adv (B,) on every token of its row plus process (N,), the row's process term scaled down as a
    whole by the largest factor in [0, 1] that meets both bounds: (1) no token's advantage has the sign opposite
    to its row's outcome advantage (the factor that takes the most opposed token to 0); (2) no token's process
    credit exceeds PROCESS_BOUND x |A^out_i| in size (x weight in a row with A^out_i = 0, a group whose
    responses all ended alike: (1) leaves its term whole). One factor per row keeps the row's sum (0 for a
    balanced term): a response the outcome rewards never has a token pushed down, nor one it punishes pushed
    up, the credit moved between its tokens still adds up to nothing, and a token's advantage lies within
    (1 + PROCESS_BOUND) x |A^out_i|. Slow equivalent: tests/advantage/advantage_reference.py `grpo_progress`."""
    a = layout.broadcast(outcome_adv)
    against = np.where(a > 0, -process, np.where(a < 0, process, 0.0))  # > 0 where the term opposes
    worst, largest = np.zeros(layout.n_rows), np.zeros(layout.n_rows)
    if layout.n_tokens:
        worst[layout.nonempty] = np.maximum.reduceat(against, layout.starts)
        largest[layout.nonempty] = np.maximum.reduceat(np.abs(process), layout.starts)
    room = np.abs(outcome_adv)
    cap = PROCESS_BOUND * np.where(outcome_adv != 0, room, weight)
    factor = np.minimum(np.where(worst > room, room / np.where(worst > 0, worst, 1.0), 1.0),
                        np.where(largest > cap, cap / np.where(largest > 0, largest, 1.0), 1.0))
    adv = a + layout.broadcast(factor) * process
    return np.where(a > 0, np.maximum(adv, 0.0), np.where(a < 0, np.minimum(adv, 0.0), adv))  # rounding only


@register("grpo_progress", min_group_size=2, uses_token_rewards=False, signal="outcome", process=True)
def grpo_progress(outcome: np.ndarray, group_mean: np.ndarray, group_std: np.ndarray, eps: float, layout: Ragged,
                  steps: Steps, recorded_ends: np.ndarray, boundary_lag: int, process_values: np.ndarray,
                  process_weight: float, process_credit: str, token_rewards: np.ndarray,
                  gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Outcome GRPO plus a gated, outcome-anchored process advantage from the PRM's step progress.

    A^out_i = (R_i - mean_group) / (std_group + eps); the process term per step, process_values, comes from
    progress.process_credit (computed once by the progress pass). process_credit=step: z_k (the PRM's
    progress centered within its response, at unit RMS over the input's steps), spread over step k's tokens
    balanced per token (`balanced_token_values`: z_k x Lbar / L_k, so a response's credit moves between its
    tokens and sums to 0 however long its steps are), times w = the weight after the evidence gate, then
    shrunk per response so no token's sign opposes A^out_i and no token's process credit exceeds
    PROCESS_BOUND x |A^out_i| (`shrink_to_bounds`); a row's last step runs to its last token.
    process_credit=baseline: A_t = A^out_i + w * (start_{-i} - Phi_j), j the last step closed before t
    (`closed_step_values`: its last token is before t - boundary_lag), start_{-i} the mean first-step Phi of the group's
    other responses, no shrink: the PRM's value of the prefix as a baseline, unbiased, and
    |A_t - A^out_i| <= w for Phi in [0, 1].
    Slow equivalent: tests/advantage/advantage_reference.py `grpo_progress`.
    """
    out = (outcome - group_mean) / (group_std + eps)  # (B,)
    adv = layout.broadcast(out)
    returns = returns_to_go(token_rewards, layout, gamma)
    st = steps
    if not len(st.value) or process_weight == 0.0:
        return adv, returns
    if process_credit == "baseline":
        term = closed_step_values(recorded_ends, st.row, layout, process_values, boundary_lag)
        return adv + process_weight * term, returns
    process = process_weight * balanced_token_values(st, layout, process_values)
    return shrink_to_bounds(out, process, layout, process_weight), returns
