"""Mid-run checkpoints for resume, kept beside a stage's output until the output is committed.

A training stage writing to OUTPUT keeps its resume checkpoint in the hidden sibling
`.OUTPUT.work/latest/` (the HF model in `model/`, the engine state in `state/`), replaced
atomically at every save. When the stage commits OUTPUT it removes the work directory; a stage that
is preempted finds `latest/` on restart and continues from it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import io, modeling
from .engine import TrainEngine


def work_dir_for(output: str | Path) -> Path:
    output = Path(output)
    return output.parent / f".{output.name}.work"


#: Keys that may change between a run and its resume without changing what is computed.
NOT_IDENTITY = io.NOT_IDENTITY
identity = io.config_identity


def save(engine: TrainEngine, tokenizer, work_dir: Path, trainer_state: dict, config: dict) -> Path:
    """Write `work_dir/latest` atomically: model (HF format) + engine state + trainer state."""
    target = Path(work_dir) / "latest"
    with io.atomic_output_dir(target, "resume-checkpoint", overwrite=True,
                              manifest={"trainer_state": trainer_state, "config": identity(config)}) as tmp:
        modeling.save_pretrained(engine.module, tokenizer, tmp / "model")
        engine.save_state(tmp / "state", trainer_state)
    return target


def find(work_dir: Path, config: dict, config_cls: type | None = None) -> Path | None:
    """The committed resume checkpoint in `work_dir` written by the same config, else None. With
    `config_cls`, a checkpoint written before a config key was renamed still counts (`io.stored_identity`)."""
    target = Path(work_dir) / "latest"
    io.recover_interrupted_replace(target)  # killed between the two renames of the last save
    if not (target / io.MANIFEST).is_file():
        return None
    manifest = io.read_manifest(target)
    if io.stored_identity(manifest.get("config") or {}, config_cls) != identity(config):
        return None
    return target


def clear(work_dir: Path) -> None:
    shutil.rmtree(work_dir, ignore_errors=True)
