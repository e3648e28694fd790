"""The threads that overlap Parquet reading and writing with computing: order, errors, early stop."""

import threading
import time

import pyarrow as pa
import pytest

from prmflow.components.data import parquet_io
from prmflow.errors import DataError


def tables(n):
    return [pa.table({"i": [k]}) for k in range(n)]


def test_read_ahead_yields_everything_in_order():
    assert [t["i"][0].as_py() for t in parquet_io.read_ahead(iter(tables(5)))] == list(range(5))


def test_read_ahead_reraises_the_readers_error_after_the_batches_before_it():
    def reader():
        yield from tables(2)
        raise DataError("shard 3 is damaged")

    seen = []
    with pytest.raises(DataError, match="shard 3"):
        for t in parquet_io.read_ahead(reader()):
            seen.append(t["i"][0].as_py())
    assert seen == [0, 1]


def test_read_ahead_closed_early_stops_its_thread():
    before = threading.active_count()
    batches = parquet_io.read_ahead(iter(tables(100)))
    next(batches)
    batches.close()  # the reader thread was blocked on a full queue: it must be released and joined
    assert threading.active_count() == before


def test_write_behind_writes_everything_in_order():
    written = []
    with parquet_io.write_behind(written.append) as write:
        for t in tables(4):
            write(t)
    assert [t["i"][0].as_py() for t in written] == list(range(4))  # all written when the block is left


def test_write_behind_reraises_a_write_error_in_the_callers_thread():
    def fail(t):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with parquet_io.write_behind(fail) as write:
            write(tables(1)[0])
            time.sleep(0.05)
            write(tables(1)[0])  # raises here, or at the end of the block


def test_write_behind_skips_queued_tables_when_the_block_fails():
    written, started = [], threading.Event()

    def slow(t):
        started.set()
        time.sleep(0.1)
        written.append(t)

    with pytest.raises(RuntimeError, match="compute failed"):
        with parquet_io.write_behind(slow) as write:
            write(tables(1)[0])
            started.wait()
            write(tables(1)[0])  # queued while the first is being written
            raise RuntimeError("compute failed")
    assert len(written) == 1  # the queued table was dropped, and the thread ended before the block was left


def test_a_file_that_is_not_parquet_is_a_data_error_naming_it(tmp_path):
    bad = tmp_path / "part-00000.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="part-00000.parquet"):
        parquet_io.open_parquet(bad)
