"""grpo_progress's step credit, computed once over the whole input by the progress pass (streaming_passes.py).

Everything here is per step of the whole input, rows in reading order: scores (S,) the PRM's score of
the prefix that ends with each step, counts (R,) steps per row, outcome (R,), group (R,) its group.
`process_credit` returns, per step, the token reward `progress` (what the `token_rewards` column holds)
and the process term `credit` (before the gated weight); the write pass slices both per batch and the
estimator (estimators.grpo_progress) spreads them over the tokens. Nothing is computed twice.

Calibration (process_calibration=isotonic) is cross-fitted: the prompts are dealt into
CALIBRATION_FOLDS folds, and the scores of a prompt's responses are read through a fit made on the
other folds' prompts only, on their intermediate prefixes only (every step but a response's last, as
the evidence gate). So (1) a PRM that judges final answers well earns nothing from it: its answer
line never enters a fit, and its steps are worth what its ranking of steps is worth; (2) a response's
Phi never depends on its own outcome (nor on its group's), so the baseline credit, whose Phi_j
depends on the prefix alone, leaves the expected policy gradient GRPO's with calibration on too.

A fold's fitted map is a model choice against the flat map (every prefix the mean outcome of the fit's
data), made on held-out data the fold's own outcomes do not enter (`map_beats_flat`): the other folds
cross-validate among themselves, and the map is used only where it predicts held-out prompts' outcomes
better than flat by more than one standard error (the one-standard-error rule of cross-validated model
choice, Hastie, Tibshirani & Friedman, The Elements of Statistical Learning, 2nd ed., sec. 7.10);
otherwise Phi is flat, the process term 0, and the advantages are outcome-only GRPO's. Why: an isotonic
fit can only lean the PRM's way, so a map fitted to a PRM of pure noise still has a spread and moves
credit towards whatever the PRM likes. No threshold on the PRM's quality is set: the flat map wins
whenever the PRM's ranking does not carry to prompts it was not fitted on. What this costs and gains is
measured in docs/process-rewards.md#2c-calibrated-potential-process_calibration-isotonic.

calibration_labels=shared_prefix fits the same maps against each prefix's shared-prefix label instead of its
response's outcome (`shared_prefix_labels`: 1 when a right response of its group starts with the same steps), on
the groups that hold a right response: where right answers are rare, a right prefix still fails most of the time,
so its outcome says little of it, while its label says whether it is on a path that reached the answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..scoring.prm_metrics import roc_auc
from .token_rewards import calibrate, fit_calibration, prm_progress, progress_rewards

CALIBRATION_FOLDS = 5
"""Folds of prompts the calibration is cross-fitted over: each fold is read through a fit on the others
(4/5 of the batch's prompts). Leave-one-prompt-out would cost one fit per prompt for the same property."""

NO_EVIDENCE_PHI = 0.5
"""Phi of every prefix of a fold whose fit has no data (a batch of one prompt): flat, so it moves no credit."""

CALIBRATION_REVISION = 3
"""Raised whenever a change alters what process_calibration=isotonic computes (2: the map chosen against a flat
one, a flat group's credit exactly 0; 3: the baseline credit's start_{-i} and its lagged step boundary, the step
credit's one scale and bound). benchmarks/experiments/prm_vs_outcome.py puts it in the digest of every calibrated run, so a
finished run made by earlier code is not taken for one of today's."""

SELECTION_SE = 1.0
"""A fold reads the fitted map only where its held-out gain over the flat map (mean over held-out prompts of
the flat map's squared error minus the map's) exceeds this many standard errors of that mean."""


def prefix_keys(response_ids: list, step_ends: list, group: np.ndarray) -> np.ndarray:
    """(S,) uint64 per step of every row: a hash of (the row's group, the step's index, the token ids up to and
    including the step's last token), rows in order. Two steps share a key when they end the same prefix of two
    responses of one group: the same first k+1 steps, token for token (a collision of the 64-bit hash is as
    likely as 1 in 2^64 per pair). response_ids, step_ends: per row, as the rollouts hold them; group (R,).
    Slow equivalent: tuple(response_ids[:step_ends[k] + 1]) with the group and k."""
    keys = []
    for ids, ends, g in zip(response_ids, step_ends, group.tolist()):
        ids = np.asarray(ids if ids is not None else [], dtype=np.int64)
        h = hashlib.blake2b(int(g).to_bytes(8, "little"), digest_size=8)
        start = 0
        for k, end in enumerate(ends or []):
            h.update(ids[start:int(end) + 1].tobytes())
            start = int(end) + 1
            step = h.copy()
            step.update(k.to_bytes(4, "little"))
            keys.append(int.from_bytes(step.digest(), "little"))
    return np.array(keys, dtype=np.uint64)


def shared_prefix_labels(keys: np.ndarray, row: np.ndarray, outcome: np.ndarray,
                         group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels (S,), informative (S,) bool): a step's label is 1 when some response of its group that succeeded
    (outcome >= 0.5) starts with the same steps up to and including it (`prefix_keys`), else 0: Math-Shepherd's
    hard label (arXiv 2312.08935) with the group's own responses as the prefix's completions, so no sampling
    beyond the rollout's. informative: the step's group holds a success (elsewhere every label is 0 whatever
    the steps are, which says nothing of the PRM's ranking). keys, row: (S,); outcome, group: (R,).
    Slow equivalent: tests/advantage/advantage_reference.py `shared_prefix_labels`."""
    success = np.asarray(outcome) >= 0.5
    won = np.unique(keys[success[row]])
    labels = np.isin(keys, won).astype(np.float64)
    n_groups = int(group.max()) + 1 if len(group) else 0
    has_success = np.bincount(group[success], minlength=n_groups) > 0
    return labels, has_success[group[row]]


@dataclass
class ProcessCredit:
    """grpo_progress's per-step values for the whole input, rows in reading order."""

    progress: np.ndarray
    """(S,) d_k = Phi_k - Phi_{k-1}, Phi_{-1} = the group's mean outcome, the last Phi the outcome: the token reward."""
    credit: np.ndarray
    """(S,) the process term of each step before the gated weight: z_k (step) or start_{-i} - Phi_k (baseline:
    the term of the tokens after step k, `baseline_credit`)."""
    step_auc: float
    """The PRM's raw scores of every step but a row's last against the row's outcome (>= 0.5 a success)."""
    steps: int
    """Steps that entered step_auc."""
    spread: float | None
    """Calibration on: the mean over folds of the range (max - min) of the map read (0 where flat); None: off."""
    label_auc: float | None = None
    """calibration_labels=shared_prefix: the PRM's raw scores of the intermediate prefixes of groups with a success
    against their shared-prefix labels (what the map is fitted on); None: outcome labels."""
    labelled: float | None = None
    """calibration_labels=shared_prefix: the share of intermediate prefixes whose group holds a success (the data the
    map is fitted on); None: outcome labels."""


def prompt_ranks(prompt_ids: list[str]) -> np.ndarray:
    """(G,) each group's prompt: the rank of its prompt_id among the sorted distinct prompt ids. A prompt's
    fold is its rank mod CALIBRATION_FOLDS, so all iterations of one prompt share a fold (a prompt seen twice
    is not independent of itself), and the held-out gain is measured per prompt for the same reason."""
    distinct = sorted(set(prompt_ids))
    rank = {p: i for i, p in enumerate(distinct)}
    return np.array([rank[p] for p in prompt_ids], dtype=np.int64)


def map_beats_flat(scores: np.ndarray, y: np.ndarray, fold: np.ndarray, prompt: np.ndarray,
                   train: np.ndarray) -> bool:
    """Whether the isotonic map fitted on `train` (a fold's fit data: the other folds' intermediate
    prefixes) predicts the labels y better than the flat map, judged on `train` alone: each of its folds is held
    out in turn, the map and the flat map (their mean label) fitted on the rest, and each held-out
    prompt's gain is the flat map's squared error minus the map's over its prefixes. True when the mean
    gain exceeds SELECTION_SE standard errors of it (over prompts); False with fewer than two prompts.
    All arrays (S,) per step: its score, its label (its row's outcome, or its shared-prefix label), fold and
    prompt; train a mask."""
    gains = []
    for g in np.unique(fold[train]):
        inner, held = train & (fold != g), train & (fold == g)
        knots = fit_calibration(scores[inner], y[inner])
        if knots is None:
            continue
        gain = (y[inner].mean() - y[held]) ** 2 - (calibrate(scores[held], knots) - y[held]) ** 2
        _, by_prompt = np.unique(prompt[held], return_inverse=True)
        gains.append(np.bincount(by_prompt.reshape(-1), gain))
    if not gains or sum(len(x) for x in gains) < 2:
        return False
    gains = np.concatenate(gains)
    return bool(gains.mean() > SELECTION_SE * gains.std(ddof=1) / np.sqrt(len(gains)))


def cross_fitted_phi(scores: np.ndarray, row: np.ndarray, outcome: np.ndarray, intermediate: np.ndarray,
                     prompt_of_row: np.ndarray, labels: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(S,) every score read through the isotonic fit (rewards.fit_calibration) of the intermediate
    prefixes of the other folds' rows where that map beats the flat one on them (`map_beats_flat`), else
    the flat map (their mean label); and the mean over folds of the map's range (0 where flat).
    row: (S,) each step's row; prompt_of_row (R,) `prompt_ranks` per row; labels: (S,) what each prefix is
    fitted against, NaN where it is not fitted on (`shared_prefix_labels` outside groups with a success); None:
    its row's outcome."""
    prompt = prompt_of_row[row]
    fold = prompt % CALIBRATION_FOLDS
    y = outcome[row] if labels is None else np.nan_to_num(labels)
    if labels is not None:
        intermediate = intermediate & ~np.isnan(labels)
    phi = np.empty(len(scores), dtype=np.float64)
    spreads = []
    for f in np.unique(fold):
        mine = fold == f
        train = intermediate & ~mine
        knots = fit_calibration(scores[train], y[train])
        if knots is None:
            phi[mine] = NO_EVIDENCE_PHI
            spreads.append(0.0)
        elif map_beats_flat(scores, y, fold, prompt, train):
            phi[mine] = calibrate(scores[mine], knots)
            spreads.append(float(knots[1].max() - knots[1].min()))
        else:
            phi[mine] = float(y[train].mean())
            spreads.append(0.0)
    return phi, float(np.mean(spreads)) if spreads else 0.0


def centered_by_row(values: np.ndarray, row: np.ndarray, n_rows: int) -> np.ndarray:
    """(S,) each value minus the mean of its row's values: a row's entries sum to 0."""
    counts = np.bincount(row, minlength=n_rows).astype(np.float64)
    mean = np.divide(np.bincount(row, values, n_rows), counts, out=np.zeros(n_rows), where=counts > 0)
    return values - mean[row]


def pooled_scale(centered: np.ndarray) -> float:
    """The root mean square of the centered progress over every step of the input (their mean is 0, so this is
    their std); 0 without steps. One scale for all responses: a response's z keeps the size of its PRM
    differences relative to the input's. Scaled per (group, outcome) class instead, a response alone in its
    class was divided by its own RMS, so any two-step lone response got z = +-1 whatever its differences."""
    return float(np.sqrt(np.mean(centered ** 2))) if len(centered) else 0.0


def baseline_credit(phi: np.ndarray, row: np.ndarray, counts: np.ndarray, group: np.ndarray) -> np.ndarray:
    """(S,) per step j of row i: start_{-i} - Phi_j, the baseline term of the tokens that follow step j once it is
    closed (estimators.closed_step_values places it). start_{-i}: the mean first-step Phi of the other responses
    of i's group (the PRM's value of the prompt, estimated without i's own actions, in Phi's units); 0 for a row
    with no other response with a step. A flat Phi (every prefix c) gives c - c = 0 exactly: no credit moves
    and the advantages are GRPO's, an all-fail group's 0 included. Slow equivalent:
    tests/advantage/advantage_reference.py `grpo_progress` (credit=baseline)."""
    n_rows = len(counts)
    has = counts > 0
    first = (np.cumsum(counts) - counts)[has]
    n_groups = int(group.max()) + 1 if len(group) else 0
    own = np.zeros(n_rows)
    own[has] = phi[first]
    total = np.bincount(group[has], phi[first], n_groups)[group]  # (R,) over the row's group
    others = np.bincount(group[has], minlength=n_groups)[group] - has  # (R,) other rows with a step
    start = np.divide(total - own, others, out=np.zeros(n_rows), where=others > 0)
    low, high = np.full(n_groups, np.inf), np.full(n_groups, -np.inf)
    np.minimum.at(low, group[has], phi[first])
    np.maximum.at(high, group[has], phi[first])
    # a group whose first-step Phi are all equal starts at that value exactly (the mean of equal floats can be
    # 1 ulp off, which left ~1e-17 credit where GRPO's advantage is exactly 0)
    start = np.where((low == high)[group] & (others > 0), low[group], start)
    return np.where((others > 0)[row], start[row] - phi, 0.0)


def process_credit(scores: np.ndarray, counts: np.ndarray, outcome: np.ndarray, group: np.ndarray,
                   group_mean: np.ndarray, prompt_of_row: np.ndarray | None, kind: str, eps: float,
                   keys: np.ndarray | None = None) -> ProcessCredit:
    """The per-step progress and process term of grpo_progress (module docstring).

    scores (S,); counts, outcome, group (R,); group_mean (R,) the mean outcome of
    each row's group; prompt_of_row (R,) with calibration (`prompt_ranks`), None without; kind: 'step' or
    'baseline'; eps: added to the scale; keys: (S,) `prefix_keys` with calibration_labels=shared_prefix (the
    map is then fitted against `shared_prefix_labels` on the groups with a success), None: against outcomes.
    step: c_k = the process progress minus its row's mean (the raw PRM's progress d, or with calibration the
    calibrated PRM's own progress, from the group's mean first-step Phi through the last step's: no
    outcome in it); z_k = c_k / (`pooled_scale` of every step's c + eps) for raw scores, and with
    calibration c_k / (the std of the batch's outcomes + eps): calibrated Phi is a chance of success, so its
    progress is read in outcome units (as GRPO's A_out is) and a nearly flat map moves nearly nothing.
    Rescaled to unit std instead, a map fitted to noise (spread 0.002) moved unit-size credit towards
    whatever the PRM likes, since a monotone fit can only lean its way.
    baseline: `baseline_credit`, start_{-i} - Phi_k per step k.
    """
    scores = np.asarray(scores, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    n_rows = len(counts)
    row = np.repeat(np.arange(n_rows), counts)
    has = counts > 0
    first = (np.cumsum(counts) - counts)[has]  # (R',) each row's first step
    intermediate = np.ones(len(scores), bool)
    intermediate[(np.cumsum(counts) - 1)[has]] = False
    auc = roc_auc(scores[intermediate], outcome[row[intermediate]] >= 0.5)
    spread = label_auc = labelled = None
    labels = None
    if keys is not None:
        y, informative = shared_prefix_labels(keys, row, outcome, group)
        labels = np.where(informative, y, np.nan)
        fitted = intermediate & informative
        label_auc = roc_auc(scores[fitted], y[fitted] >= 0.5)
        labelled = float(fitted.sum() / max(int(intermediate.sum()), 1))
    if prompt_of_row is None:
        phi = scores
    else:
        phi, spread = cross_fitted_phi(scores, row, outcome, intermediate, prompt_of_row, labels)
    progress = progress_rewards(phi, counts, outcome, group_mean)
    if kind == "baseline":
        credit = baseline_credit(phi, row, counts, group)
    else:
        if prompt_of_row is None:
            own = progress
        else:  # the calibrated PRM's own progress, from its group's mean first-step Phi
            n_groups = int(group.max()) + 1 if len(group) else 0
            total = np.bincount(group[has], phi[first], n_groups)
            seen = np.bincount(group[has], minlength=n_groups)
            start = np.divide(total, seen, out=np.zeros(n_groups), where=seen > 0)
            low, high = np.full(n_groups, np.inf), np.full(n_groups, -np.inf)
            np.minimum.at(low, group[has], phi[first])
            np.maximum.at(high, group[has], phi[first])
            # a group whose first-step Phi are all equal (a flat map) starts at that value exactly: the mean of
            # 8 equal floats can be 1 ulp off, which left ~1e-17 credit where GRPO's advantage is exactly 0
            start = np.where(low == high, low, start)[group]
            own = prm_progress(phi, counts, start)
        c = centered_by_row(own, row, n_rows)
        if prompt_of_row is None:  # raw scores: at unit RMS over the whole input's steps (`pooled_scale`)
            credit = c / (pooled_scale(c) + eps)
        else:  # calibrated Phi is in outcome units: its progress is read in them, so a weak map moves little
            credit = c / (float(np.std(outcome)) + eps)
    return ProcessCredit(progress, credit, auc, int(intermediate.sum()), spread, label_auc, labelled)
