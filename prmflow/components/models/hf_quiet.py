"""transformers and accelerate, quieter around one checkpoint load or save.

A stage's console shows its own progress bar and results. transformers adds a progress bar per
checkpoint loaded or written, and a load report (a warning) that lists the PRM's new `score` head as
MISSING every time a PRM starts from the SFT policy; accelerate imports DeepSpeed at every save to
check whether the model is wrapped in its engine (1-2.5 s on a CPU, and DeepSpeed's warning that it
found no GPU). modeling.py wraps its loads and saves in these.
"""

from __future__ import annotations

import contextlib
import logging
import sys


@contextlib.contextmanager
def transformers_quiet(hold: list[logging.LogRecord] | None = None):
    """Around one from_pretrained / save_pretrained: transformers' own progress bars ('Loading weights',
    'Writing model shards', one per checkpoint, beside the stage's bar) are off. With a `hold` list,
    the records of transformers' loader (its load report, a warning) go into it instead of the console:
    printed if the load raises, else `release(hold)` prints them when the caller finds something unexpected."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    loader = logging.getLogger("transformers.modeling_utils")

    def keep(record: logging.LogRecord) -> bool:
        hold.append(record)
        return False

    if bars:
        hf_logging.disable_progress_bar()
    if hold is not None:
        loader.addFilter(keep)
    try:
        yield
    except BaseException:
        loader.removeFilter(keep)
        if hold:
            release(hold)  # the report says why the load failed
        raise
    finally:
        loader.removeFilter(keep)
        if bars:
            hf_logging.enable_progress_bar()


def release(held: list[logging.LogRecord]) -> None:
    """Print warnings `transformers_quiet` held back, as transformers would have."""
    for record in held:
        logging.getLogger(record.name).handle(record)
    held.clear()


@contextlib.contextmanager
def no_deepspeed_import():
    """transformers' save_pretrained unwraps the model through accelerate, which imports DeepSpeed
    whenever it is installed, to test for its engine wrapper: 1-2.5 s per save on a CPU and a warning
    that it found no GPU. A model can only be inside a DeepSpeed engine if DeepSpeed was imported, so
    while it was not, accelerate is told it is absent."""
    try:
        from accelerate.utils import other
    except ImportError:
        other = None
    if "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    original = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = original
