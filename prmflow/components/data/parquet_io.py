"""Parquet plumbing that knows nothing of hand-off kinds: opening and streaming a file with errors
that name it, and threads that overlap reading and writing with computing.

schema.py builds the hand-off readers and writers on top of this; a stage that streams a large
hand-off (advantage) wraps its batches in `read_ahead` and its writes in `write_behind`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ...errors import DataError


def open_parquet(path: Path) -> pq.ParquetFile:
    """The file with its footer decoded; an unreadable file is a DataError naming it."""
    # pre_buffer=False: the default keeps every column chunk read so far until the file is closed,
    # so memory would grow with the shard (750 MB to stream a 700 MB shard; 50 MB without)
    try:
        pf = pq.ParquetFile(path, pre_buffer=False)
        pf.schema_arrow, pf.reader.column_paths  # noqa: B018 - decode the footer now, inside the try
        return pf
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: undecodable names in a damaged footer
        raise DataError(f"'{path}' is not a readable Parquet file ({e}). Re-run the stage that wrote it.") from None


def read_tables(pf: pq.ParquetFile, path: Path, batch_size: int, columns: list[str] | None) -> Iterator[pa.Table]:
    """The file's record batches as tables; a corrupt page or footer is a DataError naming the file."""
    try:
        batches = pf.iter_batches(batch_size=batch_size, columns=columns)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield pa.Table.from_batches([batch])
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"'{path}' cannot be read: it is damaged or not the Parquet file its manifest describes "
                        f"({e}). Re-run the stage that wrote it.") from None


def read_ahead(it: Iterator[pa.Table], depth: int = 1) -> Iterator[pa.Table]:
    """Yield from `it` while a thread reads, decompresses and validates the next `depth` batches.

    Arrow releases the GIL while decoding, so reading overlaps the computing and compressing of
    the batch before it: on 2 cores this is most of the gap to a bare read + write. An error in
    the reader is re-raised here; closing the generator early stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in it:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as e:  # handed to the consumer, which re-raises it
            q.put(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()


@contextlib.contextmanager
def write_behind(write: Callable[[pa.Table], None]) -> Iterator[Callable[[pa.Table], None]]:
    """Yield a function that hands a table to a thread calling `write(table)` while the caller computes the next.

    Parquet encoding and compression release the GIL, so on 2 cores writing batch i overlaps
    reading batch i+2 and computing batch i+1. A write error surfaces at the next call or at the
    end of the block; on any error in the block the thread skips what is still queued and is
    stopped before the block is left, so a writer's cleanup (schema.DatasetWriter removing its
    temporary directory) never races a write.
    """
    tables: queue.Queue = queue.Queue(maxsize=1)
    errors: list[BaseException] = []
    cancelled = threading.Event()

    def work():
        while (t := tables.get()) is not None:
            if not errors and not cancelled.is_set():
                try:
                    write(t)
                except BaseException as e:  # re-raised in the caller's thread
                    errors.append(e)

    def put(t: pa.Table) -> None:
        if errors:
            raise errors[0]
        tables.put(t)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield put
    except BaseException:
        cancelled.set()  # the output is abandoned: skip what is still queued
        raise
    finally:
        tables.put(None)
        thread.join()
    if errors:
        raise errors[0]
