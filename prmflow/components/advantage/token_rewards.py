"""Token rewards: the KL penalty, PRM step rewards at step ends, the outcome at the last token.

    r_t = -beta * kl_t  +  step contribution k at t = step_ends[k]  +  R at t = L - 1

With step_reward_mode=progress the step contribution is the PRM's progress (`progress_rewards`),
whose last step already holds the outcome: R is then added at the last token only for a row
without steps.

Flat (N,) token arrays and (S,) step arrays as in estimators.Ragged; float64 throughout.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.optimize import isotonic_regression

from .estimators import Ragged, Steps

# --- KL estimators ------------------------------------------------------------------------------
# x = old_logprob - ref_logprob per token; k1, k2, k3 as in http://joschu.net/blog/kl-approx.html
# (k1 unbiased but noisy and can be negative, k2 low variance but biased, k3 unbiased and >= 0).

KL_ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: np.expm1(-x) + x,  # exp(-x) - 1 + x, without the cancellation near x = 0
}


def kl_per_token(old_logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: str) -> np.ndarray:
    """(N,) float64 KL estimate per token from (N,) log-probabilities of the sampled tokens."""
    x = np.subtract(old_logprobs, ref_logprobs, dtype=np.float64)
    return KL_ESTIMATORS[estimator](x)


# --- how step rewards enter ------------------------------------------------------------------------

def _raw(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return values


def _centered(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    # A PRM score is a probability that the step is right: 0.5 is "no information", so centering
    # there makes good steps push up and bad steps push down. A fixed point (not the group mean)
    # keeps the transform local to one response: no statistics across batches are needed.
    return values - 0.5


def _worst_only(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Keep each row's minimum step reward (the later step on ties), zero the others.

    Min-form credit assignment (PURE, Cheng et al. 2025, https://arxiv.org/abs/2504.15275) in its
    temperature -> 0 limit: a response is only as good as its worst step. On ties the later step
    keeps it, so every token up to the last worst step sees it in its returns-to-go.
    Slow equivalent: for each row, k = last argmin(values[row]); out[k] = values[k].
    """
    out = np.zeros_like(values)
    has = counts > 0
    if not has.any():
        return out
    starts = (np.cumsum(counts) - counts)[has]
    row_min = np.minimum.reduceat(values, starts)
    is_min = values == np.repeat(row_min, counts[has])
    index = np.where(is_min, np.arange(len(values)), -1)
    keep = np.maximum.reduceat(index, starts)
    out[keep] = values[keep]
    return out


STEP_REWARD_MODES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "raw": _raw,
    "centered": _centered,
    "min": _worst_only,
}

PROGRESS = "progress"
"""The step_reward_mode whose step reward is a potential difference (`progress_rewards`); it reads
the outcome and the prompt's value besides the scores, so it is not one of STEP_REWARD_MODES."""


def progress_rewards(values: np.ndarray, counts: np.ndarray, outcome: np.ndarray, phi_prompt: np.ndarray) -> np.ndarray:
    """(S,) d_k = Phi_k - Phi_{k-1}: the change of the PRM's estimated chance of success over step k.

    Phi_k = values[k], the PRM's score of the prefix that ends with step k of its row; Phi_{-1} =
    phi_prompt[row] (the prompt's value, the same for every response of the prompt); the last step's
    Phi is replaced by the row's checked outcome[row]. So a row's step rewards sum to
    outcome - phi_prompt whatever the PRM says and however the response is cut into steps
    (potential-based shaping, Ng et al. 1999; progress as in Setlur et al., https://arxiv.org/abs/2410.08146):
    merging two steps, or dropping a separator, replaces d_k + d_{k+1} by their sum.
    values: (S,) row after row; counts, outcome, phi_prompt: (B,).
    Slow equivalent, per row: phi = [phi0] + scores[:-1] + [R]; d = [phi[k+1] - phi[k] for k in range(K)].
    """
    values = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    has = counts > 0
    ends = np.cumsum(counts)[has] - 1  # (B',) flat index of each row's last step
    starts = ends - counts[has] + 1  # (B',) of its first step
    after = values.copy()
    after[ends] = np.asarray(outcome, dtype=np.float64)[has]
    before = np.empty_like(values)
    before[1:] = after[:-1]
    before[starts] = np.asarray(phi_prompt, dtype=np.float64)[has]
    return after - before


def fit_calibration(scores: np.ndarray, outcomes: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Knots (x, y) of the non-decreasing map from a PRM score to the mean outcome that fits (scores,
    outcomes) best in least squares (isotonic regression, pool-adjacent-violators: scipy), fitted on bins
    of at least ceil(sqrt(N)) of the N prefixes; None without data.

    The distinct scores, ascending, are gathered into consecutive bins, each closed once it holds at least
    that many prefixes (equal scores never split; a short last bin joins the one before); x: each bin's
    highest score; y: the fitted mean outcome of each bin. Bins keep a handful of extreme scores from
    fitting their own outcomes (a PRM of pure noise fitted per score spans about 0.55 of the outcome
    range at N = 1500; on bins, about 0.09). Where the outcomes fall as the score rises, the fit pools
    those bins into one level, so a PRM whose ranking this data does not bear out maps to one flat value.
    Slow equivalent: tests/advantage/advantage_reference.py `isotonic`.
    """
    if not len(scores):
        return None
    x, inverse = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True)
    n = np.bincount(inverse, minlength=len(x)).astype(np.float64)
    total = np.bincount(inverse, np.asarray(outcomes, dtype=np.float64), minlength=len(x))
    size = int(np.ceil(np.sqrt(len(scores))))
    bin_of = np.empty(len(x), dtype=np.int64)
    current, filled = 0, 0
    for i, count in enumerate(n.tolist()):  # distinct scores, ascending: a bin closes once it holds `size`
        bin_of[i] = current
        filled += count
        if filled >= size:
            current, filled = current + 1, 0
    if 0 < filled and current > 0:  # a short last bin joins the one before
        bin_of[bin_of == current] = current - 1
    weight = np.bincount(bin_of, n)
    means = np.bincount(bin_of, total) / weight
    tops = x[np.flatnonzero(np.diff(bin_of, append=bin_of[-1] + 1))]  # the highest score of each bin
    return tops, isotonic_regression(means, weights=weight, increasing=True).x


def calibrate(values: np.ndarray, knots: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """values mapped through `fit_calibration`'s knots, a step function: a score gets the fitted value of
    the bin it falls in (the first bin whose highest score is >= it; above every bin, the last); unchanged
    for None. Only the scores' order decides the bins, so any increasing transform of a PRM's scores
    calibrates to the same Phi."""
    if knots is None:
        return values
    tops, fitted = knots
    i = np.searchsorted(tops, np.asarray(values, dtype=np.float64), side="left")
    return fitted[np.minimum(i, len(tops) - 1)]


def prm_progress(phi: np.ndarray, counts: np.ndarray, start: np.ndarray) -> np.ndarray:
    """(S,) the progress of the PRM's own (calibrated) potential, the process term's under process_calibration:
    Phi_{-1} = start[row], Phi_k = phi[k] for every step, the last one included (the outcome is not put in:
    it enters through the outcome advantage). A flat phi gives 0 everywhere when start is that value too.
    phi: (S,) row after row; counts, start: (B,)."""
    counts = np.asarray(counts, dtype=np.int64)
    last = np.zeros(len(counts))
    has = counts > 0
    last[has] = phi[np.cumsum(counts)[has] - 1]
    return progress_rewards(phi, counts, last, start)


def step_contributions(values: np.ndarray, counts: np.ndarray, mode: str, clip: float,
                       outcome: np.ndarray | None = None, phi_prompt: np.ndarray | None = None) -> np.ndarray:
    """(S,) what each step adds to the token reward: STEP_REWARD_MODES[mode] (or, for mode=progress,
    `progress_rewards` of the (B,) outcome and phi_prompt), then clipped to +-clip.

    values: (S,) PRM scores of all steps of a batch, row after row; counts: (B,) steps per row.
    clip <= 0 means no clipping.
    """
    if mode == PROGRESS:
        out = progress_rewards(values, counts, outcome, phi_prompt)
    else:
        out = STEP_REWARD_MODES[mode](np.asarray(values, dtype=np.float64), counts)
    return clip_rewards(out, clip)


def clip_rewards(x: np.ndarray, clip: float) -> np.ndarray:
    """x clipped to [-clip, clip]; unchanged when clip <= 0."""
    return np.clip(x, -clip, clip) if clip > 0 else x


def make_steps(layout: Ragged, step_ends: np.ndarray, counts: np.ndarray, contributions: np.ndarray,
               to_end: bool = False, stepless: float | None = None) -> Steps:
    """Steps at flat token positions: step_ends (S,) are indices within each row, counts (B,) per row.

    to_end (the step estimators, which credit each token with its step's value): a row's last step runs to
    the row's last token, so whatever follows its last step end, EOS included, is credited with it.
    stepless: a row with tokens but no step gets one step over all its tokens with this value
    (grpo_process: `STEPLESS_SCORE`); None: it gets no step.
    """
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.array(step_ends, dtype=np.int64)
    values = np.asarray(contributions, dtype=np.float64)
    has = counts > 0
    if to_end:
        ends[np.cumsum(counts)[has] - 1] = layout.lengths[has] - 1
    add = (~has & layout.nonempty) if stepless is not None else np.zeros(len(counts), bool)
    if add.any():  # insert one step per such row, in row order
        new_counts = counts + add
        first = np.cumsum(new_counts) - new_counts  # (B,) each row's first step in the new arrays
        old = np.ones(int(new_counts.sum()), bool)
        old[first[add]] = False
        ends_all, values_all = np.empty(len(old), np.int64), np.empty(len(old))
        ends_all[old], values_all[old] = ends, values
        ends_all[~old], values_all[~old] = layout.lengths[add] - 1, stepless
        counts, ends, values = new_counts, ends_all, values_all
    row = np.repeat(np.arange(layout.n_rows, dtype=np.int64), counts)
    token = layout.offsets[:-1][row] + ends
    return Steps(token=token, row=row, value=values)


STEPLESS_SCORE = 0.0
"""grpo_process's step reward of a response with no step end (empty or whitespace): a response that states
no answer cannot be right, so it is scored as a PRM sure it fails, and group normalization pushes it down."""


def token_rewards(layout: Ragged, kl: np.ndarray | None, beta: float, steps: Steps | None,
                  outcome: np.ndarray | None) -> np.ndarray:
    """(N,) r_t: -beta*kl_t, plus each step's contribution at its end, plus outcome (B,) at the last token.

    Any part may be None (switched off). Several steps ending at the same token add up.
    """
    if steps is not None:
        # float64 even with no steps at all (bincount of nothing returns int64)
        r = np.bincount(steps.token, weights=steps.value, minlength=layout.n_tokens).astype(np.float64, copy=False)
    else:
        r = np.zeros(layout.n_tokens, dtype=np.float64)
    if kl is not None and beta != 0.0:
        r -= beta * kl
    if outcome is not None:
        r[layout.last] += outcome[layout.nonempty]
    return r
