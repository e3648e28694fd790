"""Step-level PRM metrics: ROC AUC, accuracy, first-error recall (no sklearn)."""

from __future__ import annotations

import math


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative), ties 1/2.

    Computed from average ranks (Mann-Whitney U) in O(n log n) with numpy; equivalent to the O(n^2)
    count over all (positive, negative) pairs. NaN when either class is absent.
    """
    import numpy as np
    from scipy.stats import rankdata

    y = np.asarray(labels, dtype=bool) if len(labels) else np.zeros(0, bool)
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(np.asarray(scores, dtype=np.float64))  # average 1-based rank of each tie group
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def first_below(values: list[float], threshold: float = 0.5) -> int | None:
    """Index of the first value below `threshold`, None if there is none."""
    return next((k for k, v in enumerate(values) if v < threshold), None)


def step_metrics(labels: list[list[float]], scores: list[list[float]], threshold: float = 0.5, prefix: str = "eval/") -> dict:
    """PRM quality on held-out solutions (one list of step labels and of step scores per solution).

    Labels >= 0.5 count as correct steps. step_auc: ROC AUC over all steps; step_accuracy: fraction
    of steps with (score >= threshold) == label; first_error_recall: of the solutions that contain a
    wrong step, the fraction whose first step scored below threshold is exactly the first wrong one;
    loss: mean BCE against the (possibly soft) labels.
    """
    flat_y = [y for ys in labels for y in ys]
    flat_s = [s for ss in scores for s in ss]
    hard = [1 if y >= 0.5 else 0 for y in flat_y]
    correct = sum(1 for s, y in zip(flat_s, hard) if (s >= threshold) == bool(y))
    eps = 1e-7
    bce = [-(y * math.log(min(max(s, eps), 1 - eps)) + (1 - y) * math.log(1 - min(max(s, eps), 1 - eps)))
           for s, y in zip(flat_s, flat_y)]
    with_error = [(ys, ss) for ys, ss in zip(labels, scores) if any(y < 0.5 for y in ys)]
    found = sum(1 for ys, ss in with_error if first_below(ss, threshold) == first_below(ys, 0.5))
    return {
        f"{prefix}step_auc": roc_auc(flat_s, hard),
        f"{prefix}step_accuracy": correct / max(len(flat_s), 1),
        f"{prefix}first_error_recall": found / len(with_error) if with_error else float("nan"),
        f"{prefix}loss": sum(bce) / max(len(bce), 1),
        f"{prefix}steps": float(len(flat_s)),
    }
