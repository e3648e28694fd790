"""Mid-run checkpoints for resume, kept beside a stage's output until the output is committed.

A training stage writing to OUTPUT keeps its resume checkpoint in the hidden sibling
`.OUTPUT.work/latest/` (the HF model in `model/`, the engine state in `state/`), replaced
atomically at every save. When the stage commits OUTPUT it removes the work directory; a stage that
is preempted finds `latest/` on restart and continues from it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..runtime import distributed
from ..data import io
from ..models import modeling
from .engine import TrainEngine


work_dir_for = io.work_dir_for


#: Keys that may change between a run and its resume without changing what is computed.
NOT_IDENTITY = io.NOT_IDENTITY
identity = io.config_identity


def save(engine: TrainEngine, tokenizer, work_dir: Path, trainer_state: dict, config: dict) -> Path:
    """Write `work_dir/latest` atomically: model (HF format) + engine state + trainer state."""
    target = Path(work_dir) / "latest"
    with io.shared_output_dir(target, "resume-checkpoint", overwrite=True,
                              manifest={"trainer_state": trainer_state, "config": identity(config)}) as tmp:
        with engine.gathered():  # ZeRO-3: the whole weights on every rank, written by rank 0
            if distributed.is_main():
                modeling.save_pretrained(engine.module, tokenizer, tmp / "model")
        engine.save_state(tmp / "state", trainer_state)  # every rank's optimizer partition and RNG
    return target


def find(work_dir: Path, config: dict) -> Path | None:
    """The committed resume checkpoint in `work_dir` written by the same config, else None.
    With N ranks, rank 0 looks (and repairs an interrupted replace) and tells the others."""
    return distributed.on_main(lambda: _find(work_dir, config))


def _find(work_dir: Path, config: dict) -> Path | None:
    target = Path(work_dir) / "latest"
    io.recover_interrupted_replace(target)  # killed between the two renames of the last save
    if not (target / io.MANIFEST).is_file():
        return None
    manifest = io.read_manifest(target)
    if io.config_identity(manifest.get("config") or {}) != identity(config):
        return None
    return target


def clear(work_dir: Path) -> None:
    """Remove the work directory (rank 0; the others wait until it is gone)."""
    if distributed.is_main():
        shutil.rmtree(work_dir, ignore_errors=True)
    distributed.barrier()
