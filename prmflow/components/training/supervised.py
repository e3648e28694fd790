"""The supervised training loop that sft and prm share: resume, data order, the step, eval, save, SIGTERM.

A stage supplies an `Objective` (its examples, their order, its loss and its held-out evaluation);
this module owns everything around it, written once:

- Resume: `resume` picks up `.OUTPUT.work/latest` when it was written by the same identity (config and,
  for prm, inputs), restoring the engine and the trainer state {"step", "consumed"}. The data order
  is a pure function of (seed, epoch) and `consumed` says where in it the run stopped, so a resumed
  run replays the uninterrupted one bit for bit.
- The step: `grad_accum` micro-batches of `micro_batch_size` examples; each micro-batch's loss is its
  summed loss divided by the loss units (response tokens, steps) of the *whole* optimizer step, so the
  step's loss is a mean over all its units and gradient accumulation does not change the objective.
  So a step's examples are sorted by length before they are cut into micro-batches: each micro-batch
  pads to a length near its own examples' (on the quickstart's old-prompt data 1.31x -> 1.12x the real tokens at
  2 x 16), while the step's loss and gradient stay the same sums (up to float rounding).
- N ranks (runtime/distributed.py): every rank forms the same global step and takes its `shard` of
  each micro-batch; the loss units are counted over the whole global step (every rank holds the
  data, so no collective is needed) and the engine undoes DeepSpeed's averaging over ranks, so the
  update is that of one process up to float rounding. Only rank 0 tracks and writes; eval runs on
  every rank (ZeRO-3 forward passes are collective); a SIGTERM is agreed on by all ranks each step.
- Eval every `eval_every` steps and at the end; a resume checkpoint every `save_every` steps.
- SIGTERM (runtime/preemption.py): the step in progress finishes, the checkpoint is saved (remembering
  an eval that step was due for) and `Preempted` exits 143; the last step always finishes.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from tqdm.auto import tqdm

from . import checkpoint
from ..runtime import distributed, preemption
from ..models import vision
from .engine import TrainEngine
from ...errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    """The loop's knobs; sft's and prm's Config carry fields of the same names (`Schedule.of(cfg)`)."""

    micro_batch_size: int
    grad_accum: int
    max_steps: int
    log_every: int
    eval_every: int
    save_every: int

    @classmethod
    def of(cls, cfg: Any) -> "Schedule":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def per_step(self) -> int:
        """Examples per optimizer step (on this rank)."""
        return self.micro_batch_size * self.grad_accum

    def check_fits(self, n_examples: int) -> None:
        """Refuse training data that cannot fill one optimizer step (the epoch would have no steps)."""
        if n_examples < self.per_step:
            raise ConfigError(f"{n_examples} training examples are fewer than one optimizer step "
                              f"(micro_batch_size*grad_accum={self.per_step}); lower them or add data.")


class Objective(Protocol):
    """What a supervised stage plugs into the loop."""

    stage: str
    """Stage name, for the progress bar and the preemption message."""
    examples: Sequence
    """Tokenized training examples (with `input_ids` and `pixels`, for the image-token check)."""

    def order(self, epoch: int) -> list[int]:
        """Indices into `examples` for one epoch, fixed by (seed, epoch) so a resumed run replays it."""

    def collate(self, examples: Sequence) -> dict[str, torch.Tensor]:
        """One micro-batch of tensors (on the CPU)."""

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """How many terms (tokens, steps) `loss_sum(batch)` adds up: the step's loss is their mean."""

    def loss_sum(self, engine: TrainEngine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed loss of a micro-batch (already on engine.device), forward through `engine`."""

    def evaluate(self, engine: TrainEngine) -> dict[str, float]:
        """Held-out eval/* metrics of the current weights."""

    def summary(self, metrics: dict[str, float]) -> str:
        """One line for the progress bar after an eval."""


def resume(engine: TrainEngine, work: Path, identity: dict, enabled: bool, stage: str) -> dict:
    """The trainer state to start from: {"step": 0, "consumed": 0}, or that of the resume checkpoint in
    `work` written by the same `identity` (its engine state is loaded into `engine`)."""
    found = checkpoint.find(work, identity) if enabled else None
    if found is None:
        return {"step": 0, "consumed": 0}
    state = engine.load_state(found / "state")
    log.info("resuming from %s at step %d", found, state["step"])
    if distributed.is_main():
        print(f"{stage}: resuming from step {state['step']} ({found})")
    return state


def train(objective: Objective, schedule: Schedule, engine: TrainEngine, tokenizer, state: dict, work: Path,
          identity: dict, tracker, stop: preemption.Preemption = preemption.NEVER,
          vis: "vision.Vision | None" = None) -> dict:
    """Train from `state` to schedule.max_steps; returns the last eval metrics plus train/loss.

    `state` ({"step", "consumed"}, from `resume`) is updated in place; checkpoints go to `work`
    tagged with `identity`; the tokenizer is saved beside each checkpoint's model.
    """
    engine.train()
    ranks = distributed.world_size()
    distributed.check_divides(schedule.micro_batch_size)
    n = len(objective.examples)
    per_step = schedule.per_step
    steps_per_epoch = n // per_step
    metrics: dict = {}
    loss_total = float("nan")
    if state.pop("eval_pending", False):  # stopped right after an eval step, before evaluating it
        tracker.log_metrics(objective.evaluate(engine), step=state["step"])
        engine.train()
    if distributed.any_rank(stop.requested):  # asked to stop before the first step: the checkpoint on disk (if any) is current
        raise preemption.stopped(objective.stage, state["step"], str(work / "latest"), stop.signum)
    bar = tqdm(total=schedule.max_steps, initial=state["step"], desc=objective.stage, unit="step",
               dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0,
               disable=not distributed.is_main())
    t0, tokens = time.perf_counter(), 0
    guard = vision.BatchGuard(vis, objective.stage, steps_per_epoch)
    while state["step"] < schedule.max_steps:
        epoch, offset = divmod(state["consumed"] // per_step, steps_per_epoch)
        chosen = objective.order(epoch)[offset * per_step:(offset + 1) * per_step]
        if guard.skips([objective.examples[i] for i in chosen], state, tracker):  # image tokens that do not match the images
            state["consumed"] += per_step
            continue
        if schedule.grad_accum > 1:  # less padding, the same step (see the module docstring); stable, so deterministic
            chosen = sorted(chosen, key=lambda i: len(objective.examples[i].input_ids))
        groups = [chosen[j:j + schedule.micro_batch_size] for j in range(0, per_step, schedule.micro_batch_size)]
        whole = [objective.collate([objective.examples[i] for i in g]) for g in groups]
        units = sum(objective.loss_units(b) for b in whole)  # of the whole global step, the same on every rank
        tokens += sum(int(b["attention_mask"].sum()) for b in whole)
        micro = whole if ranks == 1 else [objective.collate([objective.examples[i] for i in distributed.shard(g)])
                                          for g in groups]  # this rank's share of every micro-batch
        loss_total = 0.0
        for b in micro:
            b = {k: v.to(engine.device) for k, v in b.items()}
            loss = objective.loss_sum(engine, b) / units  # this micro-batch's share of the step's mean
            engine.backward(loss)
            loss_total += float(loss.detach())
        loss_total = distributed.sum_ranks(loss_total)
        lr = engine.lr
        grad_norm = engine.step()
        state["step"] += 1
        state["consumed"] += per_step
        step = state["step"]
        bar.update(1)
        bar.set_postfix(loss=f"{loss_total:.3f}", lr=f"{lr:.2e}", refresh=False)
        if step % schedule.log_every == 0 or step == schedule.max_steps:
            tracker.log_metrics({"train/loss": loss_total, "train/lr": lr, "train/grad_norm": grad_norm,
                                 "train/epoch": state["consumed"] / n,
                                 "perf/tokens_per_s": tokens / (time.perf_counter() - t0)}, step=step)
        if not math.isfinite(loss_total):
            log.warning("non-finite loss at step %d", step)
        eval_due = (bool(schedule.eval_every) and step % schedule.eval_every == 0) or step == schedule.max_steps
        stopping = distributed.any_rank(stop.requested)  # the ranks stop at the same step, or none does
        if stopping and step < schedule.max_steps:  # preempted: save now (the last step always finishes)
            checkpoint.save(engine, tokenizer, work, {**state, "eval_pending": eval_due}, identity)
            bar.close()
            raise preemption.stopped(objective.stage, step, str(work / "latest"), stop.signum)
        if eval_due:
            metrics = objective.evaluate(engine)
            engine.train()
            tracker.log_metrics(metrics, step=step)
            if distributed.is_main():
                bar.write(f"step {step}: {objective.summary(metrics)}")
        if schedule.save_every and step % schedule.save_every == 0 and step < schedule.max_steps:
            checkpoint.save(engine, tokenizer, work, dict(state), identity)
    bar.close()
    metrics["train/loss"] = loss_total
    return metrics
