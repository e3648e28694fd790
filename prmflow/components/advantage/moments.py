"""Group statistics of the advantage stage: per-group moments (two-pass, and merged from parts) and
streaming moments over many arrays, float64 throughout (estimators.py reads them; streaming_passes.py streams them)."""

from __future__ import annotations

import numpy as np


# --- statistics ---------------------------------------------------------------------------------

def group_moments(codes: np.ndarray, x: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """Per-group moments of the values x (K,) whose groups are codes (K,), each entry (n_groups,).

    count, sum, mean, m2 (sum of squared deviations), std (ddof=1), min, max, equal (every value
    the same). Two-pass (mean first, then squared deviations), so equal values give std exactly 0.
    Groups with fewer than two values get std 0; groups with none get mean 0 and min = max = 0.
    """
    count = np.bincount(codes, minlength=n_groups).astype(np.float64)
    total = np.bincount(codes, weights=x, minlength=n_groups)
    mean = np.divide(total, count, out=np.zeros(n_groups), where=count > 0)
    m2 = np.bincount(codes, weights=(x - mean[codes]) ** 2, minlength=n_groups)
    lo, hi = _extremes(codes, x, x, n_groups)
    return _finish_moments(count, total, m2, lo, hi)


def merge_group_moments(codes: np.ndarray, parts: dict[str, np.ndarray], n_groups: int) -> dict[str, np.ndarray]:
    """Moments of groups pieced together from parts: parts holds (P,) group_moments entries of P
    partial groups (e.g. each batch's share of a group), codes (P,) the group each part belongs to.

    Chan et al.'s pairwise update, vectorized: m2 = sum of the parts' m2 + sum of
    count_p * (mean_p - mean)^2, as stable as the two-pass formula.
    """
    count = np.bincount(codes, weights=parts["count"], minlength=n_groups)
    total = np.bincount(codes, weights=parts["sum"], minlength=n_groups)
    mean = np.divide(total, count, out=np.zeros(n_groups), where=count > 0)
    spread = parts["count"] * (parts["mean"] - mean[codes]) ** 2
    m2 = np.bincount(codes, weights=parts["m2"] + spread, minlength=n_groups)
    has = parts["count"] > 0  # an empty part's min/max are placeholders
    lo, hi = _extremes(codes[has], parts["min"][has], parts["max"][has], n_groups)
    return _finish_moments(count, total, m2, lo, hi)


def _extremes(codes: np.ndarray, lows: np.ndarray, highs: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, codes, lows)
    np.maximum.at(hi, codes, highs)
    return lo, hi


def _finish_moments(count: np.ndarray, total: np.ndarray, m2: np.ndarray, lo: np.ndarray,
                    hi: np.ndarray) -> dict[str, np.ndarray]:
    empty = count == 0
    lo[empty] = hi[empty] = 0.0
    equal = lo == hi
    mean = np.divide(total, count, out=np.zeros(len(count)), where=~empty)
    mean[equal] = lo[equal]  # exact, so R_i - mean is exactly 0 in an equal-reward group
    m2[equal] = 0.0
    std = np.sqrt(np.divide(m2, count - 1, out=np.zeros(len(count)), where=count > 1))
    return {"count": count, "sum": total, "mean": mean, "m2": m2, "std": std, "min": lo, "max": hi, "equal": equal}


class Moments:
    """Streaming mean and std of many arrays (Chan et al.'s pairwise merge, float64)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, x: np.ndarray) -> None:
        n = x.size
        if n == 0:
            return
        mean = float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.n + n
        d = mean - self.mean
        self.mean += d * n / total
        self.m2 += m2 + d * d * self.n * n / total
        self.n = total

    @property
    def std(self) -> float:
        """Population std (ddof=0) over everything added."""
        return float(np.sqrt(self.m2 / self.n)) if self.n else 0.0
