"""PRM training: learn P(step is correct) for every reasoning step of a solution.

    prmflow prm --output outputs/prm                          # tiny model, exact arithmetic labels, CPU
    prmflow prm --output outputs/prm --bon.policy outputs/sft   # + best-of-8 reranking at the end
    prmflow prm --task outputs/prm-labels/labels.jsonl --output outputs/prm-ms   # Math-Shepherd labels
    prmflow prm --backbone /models/Qwen2.5-Math-1.5B --engine.zero_stage 2 --task data/steps.parquet

Choices: a causal-LM backbone with a scalar head read at the last token of each step (or
Math-Shepherd's good/bad-token readout, `head.kind=lm_tokens`); binary cross-entropy with logits,
on step positions only, against hard (0/1) or soft ([0, 1]) labels, averaged over every step of
the optimizer step (so gradient accumulation does not change the objective); AdamW, warm-up then
cosine decay, gradient clipping, DeepSpeed or plain PyTorch, in the training loop sft uses too
(training/supervised.py; this module supplies the loss and the evaluation). Evaluated every
eval_every steps on held-out solutions: step AUC, step accuracy and first-error recall. With
bon.policy, the finished PRM reranks N sampled solutions per held-out prompt (best-of-N)
against majority vote, a random pick and greedy pass@1. Resume: a checkpoint beside the output
(`.OUTPUT.work/latest`) is picked up on restart with the same config and inputs; SIGTERM (a pod
being stopped) finishes the step in progress, saves that checkpoint and exits 143
(runtime/preemption.py). Re-running a finished config on the same inputs does nothing, except
adding best-of-N results when bon.* asks for new ones; an existing output from another config or
other inputs is an error unless overwrite=true.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..training import checkpoint
from .. import config as config_lib
from ..runtime import distributed, preemption
from ..data import io
from ..models import modeling, vision
from ... import tasks, tracking
from ..training.engine import OptimSettings, TrainEngine, init_distributed
from ..scoring import bestofn
from ..training import supervised
from ..scoring.prm_metrics import step_metrics
from ..models.prm_model import PRM, append_identity_layers, freeze_below, saved_head
from . import step_examples as data
from .config import Config, input_fingerprints, training_identity

log = logging.getLogger(__name__)


# --- evaluation ------------------------------------------------------------------------------

@torch.no_grad()
def predict(prm: PRM, examples: list[data.Tokenized], batch_size: int, model=None) -> list[list[float]]:
    """sigmoid(step logit) at every step of every example (the training-time twin of PRMScorer)."""
    model = model or prm.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        b = data.collate(chunk, prm.tokenizer.pad_token_id)
        pixels = {k: v.to(device) for k, v in data.model_inputs(b).items()}
        probs = torch.sigmoid(prm(b["input_ids"].to(device), b["attention_mask"].to(device), model=model, **pixels)).cpu()
        out += [probs[j, e.step_ends].tolist() for j, e in enumerate(chunk)]
    model.train(was_training)
    return out


def evaluate(prm: PRM, examples: list[data.Tokenized], batch_size: int, model=None) -> dict:
    """eval/* step metrics (scoring/prm_metrics.py) of `predict` against the examples' labels."""
    scores = predict(prm, examples, batch_size, model)
    return step_metrics([e.labels for e in examples], scores)


@dataclass
class PRMObjective:
    """The prm stage's objective for the shared loop (training/supervised.py): BCE with logits on step
    positions, a mean over every step of the optimizer step; evaluated by step AUC, step accuracy and
    first-error recall on held-out solutions (`evaluate`)."""

    cfg: Config
    prm: PRM
    examples: list[data.Tokenized]
    held_out: list[data.Tokenized]
    stage = "prm"

    def __post_init__(self):
        prompt_groups: dict[str, int] = {}
        self._groups = [prompt_groups.setdefault(e.example.prompt, len(prompt_groups)) for e in self.examples]
        self._epoch_order: tuple[int, list[int]] = (-1, [])  # (epoch, its order): computed once per epoch

    def order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, data.epoch_order(self._groups, self.cfg.seed, epoch, self.cfg.group_by_prompt))
        return self._epoch_order[1]

    def collate(self, examples: list[data.Tokenized]) -> dict[str, torch.Tensor]:
        return data.collate(examples, self.prm.tokenizer.pad_token_id)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["step_mask"].sum())  # labelled steps

    def loss_sum(self, engine: TrainEngine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        z = self.prm(batch["input_ids"], batch["attention_mask"], model=engine, **data.model_inputs(batch))  # (B, T) step logits
        return data.step_bce(z, batch["targets"], batch["step_mask"])[0]

    def evaluate(self, engine: TrainEngine) -> dict:
        return evaluate(self.prm, self.held_out, self.cfg.micro_batch_size * 4, model=engine.module)

    def summary(self, metrics: dict) -> str:
        return (f"eval step AUC {metrics['eval/step_auc']:.3f}, step accuracy {metrics['eval/step_accuracy']:.3f}, "
                f"first-error recall {metrics['eval/first_error_recall']:.3f}")


# --- the stage -------------------------------------------------------------------------------

def _bon_identity(cfg: Config) -> dict:
    return {"bon": config_lib.to_dict(cfg.bon), "arithmetic": config_lib.to_dict(cfg.arithmetic),
            "chat_template": cfg.chat_template}


def _run_best_of_n(cfg: Config, prm_dir: Path, tracker, step: int) -> dict:
    print(f"prm: best-of-{cfg.bon.n_samples} on {cfg.bon.num_prompts} prompts, sampling from {cfg.bon.policy}")
    metrics, table = bestofn.evaluate(str(prm_dir), cfg.bon, cfg.arithmetic, cfg.chat_template, cfg.step_separator, cfg.seed)
    tracker.log_metrics(metrics, step=step)
    tracker.log_table(table, "bon_samples.json")
    summary = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))
    print(f"prm: best-of-{cfg.bon.n_samples}: {summary}")
    return metrics


def _add_best_of_n(cfg: Config, manifest: dict) -> dict:
    """Best-of-N for an already trained output: recommit it (files hard-linked) with the new metrics."""
    tracker = tracking.start_stage_run(cfg.tracking, "prm", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker:
        bon = _run_best_of_n(cfg, Path(cfg.output), tracker, cfg.max_steps)
        metrics = {**manifest.get("metrics", {}), **bon}
        keep = {k: v for k, v in manifest.items() if k not in ("files", "created_at", "prmflow_version", "kind")}
        with io.atomic_output_dir(cfg.output, "prm", overwrite=True,
                                  manifest={**keep, "metrics": metrics, "bon": _bon_identity(cfg)}) as tmp:
            io.link_or_copy_tree(cfg.output, tmp, skip=(io.MANIFEST,))
    return metrics


def run(cfg: Config) -> dict:
    """Train and evaluate a PRM, write it to `cfg.output`, then best-of-N if asked. Returns the metrics."""
    if n := distributed.should_launch(cfg.engine):  # engine.nproc_per_node > 1: run as n torchrun ranks
        distributed.launch("prm", cfg, n)
        return io.read_manifest(cfg.output).get("metrics", {})
    if distributed.under_launcher():
        init_distributed(cfg.engine)  # the ranks decide together from here on
    done = io.finished_output("prm", cfg.output, training_identity(cfg), cfg.overwrite, inputs=input_fingerprints(cfg),
                              announce=False)
    if done is not None:
        if cfg.bon.policy and (done.get("bon") or {}) != _bon_identity(cfg):  # the trained PRM is; best-of-N is not
            modeling.check_model_dir(cfg.bon.policy, "bon.policy")
            return distributed.on_main(lambda: _add_best_of_n(cfg, done))  # no training: rank 0 alone
        print(f"prm: '{cfg.output}' is already complete for this config and these inputs; nothing to do.")
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, stop)


def _run(cfg: Config, stop: preemption.Preemption) -> dict:
    if not modeling.is_tiny(cfg.backbone):
        modeling.check_model_dir(cfg.backbone, "backbone")
    if cfg.bon.policy:
        modeling.check_model_dir(cfg.bon.policy, "bon.policy")  # fail before training, not after
    if cfg.policy:  # with policy_from_backbone it is the backbone, checked above
        modeling.check_model_dir(cfg.policy, "policy")
    identity = training_identity(cfg)
    inputs = input_fingerprints(cfg)
    resume_identity = {**identity, "inputs": inputs}  # a checkpoint from other inputs is not resumed
    train_examples, eval_examples = data.load_data(cfg)  # bad data fails before a model is loaded
    if modeling.is_tiny(cfg.backbone) and cfg.train_layers:
        log.warning("backbone=%s is a randomly initialized backbone, and train_layers=%d freezes most of it; "
                    "use train_layers=0 to train it all.", cfg.backbone, cfg.train_layers)
    torch.manual_seed(cfg.seed)
    prm = PRM.load(cfg.backbone, cfg.head, cfg.engine.dtype, seed=cfg.seed)
    if cfg.extra_layers and saved_head(cfg.backbone) is None:  # not on top of an already trained PRM
        append_identity_layers(prm.model, cfg.extra_layers, cfg.seed)
    if cfg.train_layers:
        freeze_below(prm.model, cfg.train_layers)
    render = lambda p, images=None: tasks.render_prompt(prm.tokenizer, tasks.PromptRecord("", p, images=images),  # noqa: E731
                                                        cfg.chat_template)
    train, dropped = data.tokenize(train_examples, prm.tokenizer, cfg.step_separator, cfg.head.step_tag, cfg.max_seq_len, render)
    held_out, _ = data.tokenize(eval_examples, prm.tokenizer, cfg.step_separator, cfg.head.step_tag, cfg.max_seq_len, render)
    schedule = supervised.Schedule.of(cfg)
    schedule.check_fits(len(train))
    engine = TrainEngine(prm.model, cfg.engine, OptimSettings.of(cfg.optim, cfg.max_steps),
                         cfg.micro_batch_size, cfg.grad_accum)

    work = checkpoint.work_dir_for(cfg.output)
    state = supervised.resume(engine, work, resume_identity, cfg.resume, "prm")

    tracker = tracking.start_stage_run(cfg.tracking, "prm", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())}) \
        if distributed.is_main() else tracking.NullTracker()  # one MLflow run, from rank 0
    with tracker:
        n_steps = sum(len(e.step_ends) for e in train)
        pos = sum(y >= 0.5 for e in train for y in e.labels)
        tracker.log_metrics({"data/train_examples": len(train), "data/train_steps": n_steps,
                             "data/positive_fraction": pos / max(n_steps, 1), "data/dropped_too_long": dropped},
                            step=state["step"])
        metrics = supervised.train(PRMObjective(cfg, prm, train, held_out), schedule, engine,
                                   prm.tokenizer, state, work, resume_identity, tracker, stop,
                                   vision.Vision.of(prm.tokenizer, prm.model.config))
        manifest = {"config": identity, "inputs": inputs, "metrics": metrics, "parents": [cfg.backbone] + (
            [cfg.task] if cfg.task not in tasks.TASKS else [])}
        with io.shared_output_dir(cfg.output, "prm", overwrite=True, manifest=manifest) as tmp:
            with engine.gathered():  # ZeRO-3 weights gathered once; rank 0 writes them
                if distributed.is_main():
                    prm.save(tmp, cfg.step_separator, model=engine.module, extra={"metrics": metrics})
            if cfg.bon.policy and distributed.is_main():  # generation from the saved PRM: no collectives
                metrics.update(_run_best_of_n(cfg, tmp, tracker, cfg.max_steps))
                manifest["bon"] = _bon_identity(cfg)
        checkpoint.clear(work)
        tracker.log_metrics(metrics, step=cfg.max_steps)
    if not distributed.is_main():
        return metrics
    print(f"prm: held-out step AUC {metrics['eval/step_auc']:.3f}, step accuracy {metrics['eval/step_accuracy']:.3f}, "
          f"first-error recall {metrics['eval/first_error_recall']:.3f} -> {cfg.output}")
    return metrics
