"""schema's vectorized row scans against the obvious Python loop over rows."""

import math

import numpy as np
import pyarrow as pa
import pytest

from prmflow.components.data import schema


def slow_null_entry_rows(col: pa.ChunkedArray) -> list[bool]:
    return [row is not None and None in row for row in col.to_pylist()]


def slow_nonfinite_rows(col: pa.ChunkedArray) -> list[bool]:
    def numbers(value):
        if value is None:
            return []
        if isinstance(value, float):
            return [value]
        return [v[1] if isinstance(v, tuple) else v for v in value]  # a map row is a list of (key, value)
    return [any(x is not None and not math.isfinite(x) for x in numbers(row)) for row in col.to_pylist()]


def random_rows(rng, n=200):
    choices = [0.5, -1.0, None, float("nan"), float("inf")]
    rows = []
    for _ in range(n):
        if rng.random() < 0.1:
            rows.append(None)
        else:
            rows.append([choices[i] for i in rng.choice(len(choices), size=rng.integers(0, 4),
                                                            p=[0.5, 0.3, 0.1, 0.05, 0.05])])
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_list_scans_match_the_python_loop(seed):
    rows = random_rows(np.random.default_rng(seed))
    col = pa.chunked_array([pa.array(rows[:90], pa.list_(pa.float32())), pa.array(rows[90:], pa.list_(pa.float32()))])
    assert schema.null_entry_rows(col).tolist() == slow_null_entry_rows(col)
    assert schema.nonfinite_rows(col).tolist() == slow_nonfinite_rows(col)


def test_float_and_map_columns():
    floats = pa.chunked_array([pa.array([1.0, None, float("nan"), -float("inf")], pa.float32())])
    assert schema.nonfinite_rows(floats).tolist() == slow_nonfinite_rows(floats) == [False, False, True, True]
    maps = pa.chunked_array([pa.array([[("a", 1.0)], None, [("a", 0.0), ("b", float("nan"))]],
                                      pa.map_(pa.string(), pa.float32()))])
    assert schema.nonfinite_rows(maps).tolist() == slow_nonfinite_rows(maps) == [False, False, True]


def test_columns_that_cannot_hold_such_values_are_skipped():
    assert schema.nonfinite_rows(pa.chunked_array([pa.array(["x"])])) is None
    assert schema.null_entry_rows(pa.chunked_array([pa.array([["x", None]])])) is None
    assert schema.null_entry_rows(pa.chunked_array([pa.array([[1, 2]], pa.list_(pa.int32()))])) is None  # no nulls
