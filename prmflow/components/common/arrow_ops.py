"""Vectorized row scans over Arrow columns: which rows hold a bad value (no Python loop over rows).

schema.validate uses them to name the first offending row of a hand-off; each returns a (B,)
boolean mask over the column's rows, or None when there is nothing to look for (a type that cannot
hold such a value; for null entries also a column without any).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def null_entry_rows(col: pa.ChunkedArray) -> np.ndarray | None:
    """(B,) bool: rows whose numeric list (token ids, per-token floats) holds a null element.

    Equivalent to `[row is not None and None in row for row in col.to_pylist()]`.
    """
    t = col.type
    if not (pa.types.is_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))):
        return None
    flat = pc.list_flatten(col)
    if not flat.null_count:
        return None
    parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
    out = np.zeros(len(col), bool)
    out[parents[pc.is_null(flat).to_numpy(zero_copy_only=False)]] = True
    return out


def nonfinite_rows(col: pa.ChunkedArray) -> np.ndarray | None:
    """(B,) bool: rows holding a NaN/inf anywhere in a float, list<float> or map<_, float> column.

    Equivalent to testing `math.isfinite` on every non-null number of every row's Python value.
    """
    t = col.type
    if pa.types.is_floating(t):
        return ~pc.fill_null(pc.is_finite(col), True).to_numpy(zero_copy_only=False)
    if pa.types.is_map(t) and pa.types.is_floating(t.item_type):
        col = pa.chunked_array([pa.ListArray.from_arrays(c.offsets, c.items) for c in col.chunks],
                               type=pa.list_(t.item_type))
    elif not (pa.types.is_list(t) and pa.types.is_floating(t.value_type)):
        return None
    flat = pc.list_flatten(col)
    finite = pc.fill_null(pc.is_finite(flat), True).to_numpy(zero_copy_only=False)
    out = np.zeros(len(col), bool)
    if not finite.all():
        parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
        out[parents[~finite]] = True
    return out
