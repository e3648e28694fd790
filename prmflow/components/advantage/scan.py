"""The discounted reverse scan of the advantage estimators, y[t] = x[t] + c * y[t+1] within each row.

Rows are packed end to end in one flat (N,) float64 array and given by `starts`: the sorted flat
indices in (0, N) where a new row begins (y[p-1] does not see y[p]). Slow equivalent, per row:
`for t in reversed(range(L)): y[t] = x[t] + c * y[t + 1]` with y[L] = 0.

The recurrence is sequential, and a sequential filter (scipy.signal.lfilter) spends ~10 ns per
token. `blocked_reverse_scan` turns most of it into one matrix product instead: the array is cut
into blocks of K tokens, each block's scan within itself is a (K,) row times the (K, K) matrix
P[j, i] = c**(j - i) (j >= i), computed for all N/K blocks at once by BLAS; what each block receives
from the blocks after it is one value per block (the scan's value at the next block's first token),
which is the same scan again, over N/K values with discount c**K, and is added back as
c**(K - i) times that value. In a block where a row starts, the tokens before the start also summed
the next row's tokens; that share, c**(q - i) times the block's own sum from the start q on, is taken
back out. Powers of c <= 1 are only multiplied and added, never divided by (a closed form dividing
by c**t underflows over long rows), and the one subtraction is of a sum over at most K tokens of
the same block, so the error stays at float64 rounding of one block's values for every c in [0, 1].
"""

from __future__ import annotations

import numpy as np

BLOCK = 16
"""Tokens per block: the scan of 2.1 M tokens took 13.3 / 10.6 / 8.9 / 10.7 ms with blocks of 4 / 8 / 16 / 32
(one thread): shorter blocks make the scan over block heads longer, longer ones cost 2K flops a token."""


def blocked_reverse_scan(x: np.ndarray, starts: np.ndarray, c: float, block: int = BLOCK) -> np.ndarray:
    """(N,) float64 y with y[t] = x[t] + c * y[t+1] inside each row (module docstring), 0 < c <= 1.

    x is not modified. starts: sorted, unique flat indices in (0, N) where rows begin.
    """
    n = len(x)
    if n <= 64 * block:  # a few thousand tokens: the sequential filter is cheaper than the blocks' set-up
        return _sequential_reverse_scan(x, starts, c)
    from scipy.linalg.blas import dger  # BLAS's rank-1 update, in place: half the memory traffic of numpy's +=

    k = block
    m = -(-n // k)  # blocks; the last one is zero-padded past N (zeros after the last row change nothing)
    d = np.subtract.outer(np.arange(k), np.arange(k))  # d[j, i] = j - i
    p = np.where(d >= 0, c ** np.maximum(d, 0).astype(np.float64), 0.0)  # (K, K) P[j, i] = c**(j - i), j >= i
    y = np.empty(m * k, dtype=np.float64)
    blocks = y.reshape(m, k)  # (M, K) each block's scan within itself, then with what flows in from after it
    full = n // k
    np.matmul(x[:full * k].reshape(full, k), p, out=blocks[:full])
    if full < m:
        tail = np.zeros(k)
        tail[:n - full * k] = x[full * k:]
        blocks[full] = tail @ p

    # blocks with a row start inside them ("mixed"): a token before the block's next row start q got
    # c**(q - i) * (the block's scan at q) from the next row; take it back out
    inner = starts[starts % k != 0]  # (S',) sorted
    mixed = np.unique(inner // k)  # (Bm,)
    begins = np.full((len(mixed), k), k)  # (Bm, K) i where a row starts at token i of the block, else K
    begins[np.searchsorted(mixed, inner // k), inner % k] = inner % k
    next_begin = np.full_like(begins, k)  # (Bm, K) the first row start after token i in its block, or K
    next_begin[:, :-1] = np.minimum.accumulate(begins[:, :0:-1], axis=1)[:, ::-1]
    leaks = next_begin < k  # (Bm, K) the token's row ends inside the block
    local = blocks[mixed]
    at_next = np.take_along_axis(local, np.minimum(next_begin, k - 1), axis=1)
    local -= np.where(leaks, c ** (next_begin - np.arange(k)).astype(np.float64), 0.0) * at_next

    # what flows into block b from after it: the scan's value at block b+1's first token (its head),
    # unless a row starts there; heads are the same scan over the blocks' first tokens, discount c**K
    begins_row = np.zeros(m, dtype=bool)  # (M,) a row starts at block b's first token
    begins_row[starts[starts % k == 0] // k] = True
    flows = ~begins_row[1:]  # (M-1,) block b's last token sees block b + 1's first
    cut = begins_row[1:].copy()  # (M-1,) block b's first token does not: a row starts at b + 1 or inside b
    cut[mixed[mixed < m - 1]] = True
    blocks[mixed] = local
    heads = blocked_reverse_scan(blocks[:, 0].copy(), np.flatnonzero(cut) + 1, c ** k, block)
    carry = np.zeros(m, dtype=np.float64)  # (M,) head of block b + 1 where b's last row goes on into it
    carry[:-1] = np.where(flows, heads[1:], 0.0)
    decay = c ** np.arange(k, 0, -1, dtype=np.float64)  # (K,) c**(K - i)
    carry_mixed = carry[mixed]
    carry[mixed] = 0.0
    dger(1.0, decay, carry, a=blocks.T, overwrite_a=True)  # blocks += carry (M,) x decay (K,), in place
    # in a mixed block it reaches only the tokens of the block's last row
    blocks[mixed] = local + ~leaks * decay * carry_mixed[:, None]
    return y[:n]


def _sequential_reverse_scan(x: np.ndarray, starts: np.ndarray, c: float) -> np.ndarray:
    """The same scan by one sequential filter pass (scipy.signal.lfilter) over the whole array as if
    it were one row. What would leak from row i+1 into row i is c * y[first token of row i+1], the
    row's discounted sum sum_j c**j * x[first + j]; subtracting it at row i's last token beforehand
    cancels the leak exactly."""
    from scipy.signal import lfilter  # imported here: scipy.signal costs ~1 s per process

    n = len(x)
    if n == 0:
        return np.zeros(0)
    first = np.r_[0, starts]
    lengths = np.diff(np.r_[first, n])
    pos = np.arange(n, dtype=np.int64) - np.repeat(first, lengths)  # (N,) index within the row
    head = np.add.reduceat(x * c ** pos.astype(np.float64), first)
    y = np.array(x, dtype=np.float64)
    y[starts - 1] -= c * head[1:]
    return lfilter([1.0], [1.0, -c], y[::-1])[::-1]
