"""A quick interpreter exit for processes that have loaded torch, transformers and MLflow.

When such a process ends, CPython's shutdown runs full garbage collections over every object those
libraries created (hundreds of thousands of classes, functions and dicts): measured here, 1.5 s from
the last line of a script to the end of the process, against 0.17 s when the objects are frozen
first. Every pipeline task is such a process, and the pipeline waits for each to end, so the
quickstart's 15 tasks in sequence spent ~20 s in nothing but this.

`freeze_objects_at_exit` registers `gc.freeze` as an exit handler: at exit, the objects alive are
moved to the collector's permanent generation, which the shutdown collections skip; the operating
system takes the memory back, as it does for every process. Nothing else changes: the other exit
handlers (MLflow's, logging's flush) still run, objects freed by reference counting are still
freed, the exit status is the same. What is skipped is running `__del__` on objects in reference
cycles at exit, which CPython does not promise anyway (the data model's note on `__del__`).
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_objects_at_exit() -> None:
    """Register gc.freeze to run at interpreter exit (once per process; later calls do nothing)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
