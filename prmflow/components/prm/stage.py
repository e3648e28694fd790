"""PRM training: learn P(step is correct) for every reasoning step of a solution.

    prmflow prm --output outputs/prm                          # tiny model, exact arithmetic labels, CPU
    prmflow prm --output outputs/prm --bon.policy_path outputs/sft   # + best-of-8 reranking at the end
    prmflow prm --task outputs/prm-labels/labels.jsonl --output outputs/prm-ms   # Math-Shepherd labels
    prmflow prm --model_path /models/Qwen2.5-Math-1.5B --engine.zero_stage 2 --task data/steps.parquet

Choices: a causal-LM backbone with a scalar head read at the last token of each step (or
Math-Shepherd's good/bad-token readout, `head.kind=lm_tokens`); binary cross-entropy with logits,
on step positions only, against hard (0/1) or soft ([0, 1]) labels, averaged over every step of
the optimizer step (so gradient accumulation does not change the objective); AdamW, warm-up then
cosine decay, gradient clipping, DeepSpeed or plain PyTorch (the SFT engine). Evaluated every
eval_every steps on held-out solutions: step AUC, step accuracy and first-error recall. With
bon.policy_path, the finished PRM reranks N sampled solutions per held-out prompt (best-of-N)
against majority vote, a random pick and greedy pass@1. Resume: a checkpoint beside the output
(`.OUTPUT.work/latest`) is picked up on restart with the same config and inputs; SIGTERM (a pod
being stopped) finishes the step in progress, saves that checkpoint and exits 143
(common/preemption.py). Re-running a finished config on the same inputs does nothing, except
adding best-of-N results when bon.* asks for new ones; an existing output from another config or
other inputs is an error unless overwrite=true.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..common import checkpoint, config as config_lib, io, modeling, preemption, tasks, tracking, vision
from ..common.engine import EngineConfig, OptimSettings, TrainEngine
from ..common.errors import ConfigError
from ..common.tasks.arithmetic import ArithmeticConfig
from ..lib import bestofn
from ..lib.prm_metrics import step_metrics
from ..lib.prm_model import PRM, HeadConfig, append_identity_layers, freeze_below, saved_head
from . import data

log = logging.getLogger(__name__)


@dataclass
class Config:
    model_path: str = "outputs/sft"
    """Backbone: a causal-LM HF directory (default: the sft stage's output), an existing PRM directory, or a tiny preset (random init: then use train_layers=0 and extra_layers=0)."""
    extra_layers: int = 2
    """Decoder layers appended to a causal-LM backbone, starting as the identity: room to compare the backbone's next-token predictions with the tokens actually written (what a verifier does). Costs (layers+extra)/layers compute."""
    train_layers: int = 2
    """Train only the last train_layers decoder layers (plus the final norm and the head); the rest of the backbone stays frozen. 0 = train everything. With extra_layers = train_layers the verifier reads a frozen policy's own predictions, and a step costs about a third."""
    output: str = "outputs/prm"
    """Directory the trained PRM is written to (HF format + prmflow.json with its head), atomically at the end."""
    task: str = "arithmetic"
    """Training data: 'arithmetic' or 'visual' (built-in tasks, exact step labels, incl. deliberately wrong steps; visual needs a vision-language backbone and head.kind=lm_tokens) or a stepwise .jsonl/.parquet file (prompt, steps, labels, optional images)."""
    eval_task: str = ""
    """Held-out step data: a stepwise file, or 'arithmetic' (its 'eval' split, exact labels: how to judge a PRM trained on prm-label output against the checker). Empty = the arithmetic 'eval' split for task=arithmetic, else the last eval_size rows of the task file."""
    train_size: int = 6000
    """Arithmetic: problems (each gives its reference solution and negatives_per_problem wrong ones); a file: at most this many rows."""
    eval_size: int = 300
    """Held-out arithmetic problems (or file rows) for step AUC / accuracy / first-error recall."""
    negatives_per_problem: int = 2
    """Arithmetic: wrong solutions per problem (mostly arithmetic.corrupt); more negatives, more error patterns seen."""
    policy_samples_path: str = ""
    """Arithmetic: a policy whose own sampled solutions, labelled by the exact checker, join the training data (matches the errors the PRM will judge). Empty = reference + corrupted solutions only."""
    policy_samples_from_backbone: bool = False
    """Arithmetic: sample those solutions from the backbone itself (model_path, the SFT policy), as if policy_samples_path named it. The pipeline's switch: the SFT policy's path is only known at run time. Measured on the quickstart: a PRM trained so ranks the RL policy's own right and wrong solutions apart (weakest step 0.42 vs 0.28); one trained on corrupted references only does not (0.46 vs 0.45 mean step score)."""
    policy_samples: int = 2
    """Arithmetic with policy_samples_path: solutions sampled per training problem."""
    step_separator: str = "\n"
    """Text between steps; the readout is each step's last token (steps.step_spans)."""
    head: HeadConfig = field(default_factory=HeadConfig)
    """How a step is read out of the model."""
    seed: int = 0
    """Seed for model init (tiny presets), data and data order."""
    max_seq_len: int = 256
    """Examples longer than this (prompt + response tokens) are dropped with a logged count."""
    chat_template: bool = True
    """Wrap prompts in the PRM tokenizer's chat template when it has one (the tiny tokenizer has none)."""
    micro_batch_size: int = 32
    """Solutions per forward/backward pass."""
    group_by_prompt: bool = True
    """Keep the solutions of one prompt in the same batch (shuffling prompts, not solutions): right and wrong solutions of a problem side by side."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (effective batch = micro_batch_size * grad_accum * GPUs)."""
    max_steps: int = 6000
    """Optimizer steps to train for. Measured on the SFT test policy's backbone (tiny model, CPU): held-out step AUC 0.883 after 3000 steps, 0.931 after 6000 (0.912 already at step 3500 of the 6000-step schedule)."""
    lr: float = 1e-3
    """Peak learning rate (tiny models like a high one; use ~1e-5 for billion-parameter models)."""
    warmup_steps: int = 50
    """Linear warm-up steps from 0 to lr."""
    lr_schedule: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    """Decay after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on norms and biases)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    log_every: int = 10
    """Log train/* and perf/* metrics every this many steps."""
    eval_every: int = 500
    """Evaluate every this many steps (and at the end)."""
    save_every: int = 500
    """Write a resume checkpoint every this many steps (0 = only at the end)."""
    resume: bool = True
    """Continue from the checkpoint beside the output when one with the same config exists."""
    overwrite: bool = False
    """Replace an existing output written with a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the built-in arithmetic task."""
    bon: bestofn.BestOfNConfig = field(default_factory=bestofn.BestOfNConfig)
    """Best-of-N reranking after training (needs bon.policy_path)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("train_size", "eval_size", "micro_batch_size", "grad_accum", "max_steps", "max_seq_len",
                    "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.extra_layers < 0 or self.train_layers < 0:
            raise ConfigError(f"extra_layers ({self.extra_layers}) and train_layers ({self.train_layers}) must be 0 or more.")
        if self.negatives_per_problem < 0:
            raise ConfigError(f"negatives_per_problem is {self.negatives_per_problem}; use 0 or more.")
        if self.lr <= 0:
            raise ConfigError(f"lr is {self.lr}; it must be positive.")
        if self.warmup_steps >= self.max_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps}).")
        if self.policy_samples_from_backbone and self.policy_samples_path:
            raise ConfigError("policy_samples_from_backbone=true and policy_samples_path both name the policy to sample; "
                              "set one of them.")
        if self.samples_policy and self.task not in tasks.TASKS:
            raise ConfigError("policy_samples_path / policy_samples_from_backbone need a built-in task (arithmetic or visual: its checker labels the samples); "
                              "for other data, label samples with `prmflow prm-label` and pass them as task.")
        if not self.step_separator:
            raise ConfigError("step_separator is empty; steps need a separator (the default is a newline).")
        if self.policy_samples_from_backbone and modeling.is_tiny(self.model_path):
            raise ConfigError(f"policy_samples_from_backbone=true samples model_path, but '{self.model_path}' is an "
                              f"untrained preset; point model_path at a trained policy (e.g. the sft output).")

    @property
    def samples_policy(self) -> str:
        """The policy whose own solutions join the training data ('' = none)."""
        return self.model_path if self.policy_samples_from_backbone else self.policy_samples_path


def training_identity(cfg: Config) -> dict:
    """The keys that decide the trained weights (best-of-N settings only decide extra metrics)."""
    d = config_lib.to_dict(cfg)
    d.pop("bon")
    return checkpoint.identity(d)


def input_fingerprints(cfg: Config) -> dict[str, str]:
    """What the weights are trained from besides the config: {path: digest} of the backbone and the
    policy-samples model when they are prmflow outputs (their manifests' file digests) and of the
    step data files (their bytes). The same config on a retrained SFT policy or edited labels is a
    different result: a re-run is refused, a resume checkpoint is not picked up."""
    out: dict[str, str] = {}
    for p in (cfg.model_path, cfg.samples_policy, *(t for t in (cfg.task, cfg.eval_task) if t not in tasks.TASKS)):
        path = Path(p) if p else None
        if path is None:
            continue
        if (path / io.MANIFEST).is_file():
            out.update(io.fingerprint([path]))
        elif path.is_file():
            out[str(path)] = io.sha256_file(path)
    return out


# --- data ------------------------------------------------------------------------------------

def load_data(cfg: Config) -> tuple[list[data.StepExample], list[data.StepExample]]:
    """(train, held-out) step-labelled examples."""
    if cfg.task in tasks.TASKS:
        train = (data.arithmetic_examples(cfg.train_size, cfg.seed, "train", cfg.arithmetic, cfg.negatives_per_problem)
                 if cfg.task == "arithmetic" else data.visual_examples(cfg.train_size, cfg.seed, "train", cfg.negatives_per_problem))
        if cfg.samples_policy:
            records = tasks.load(cfg.task, "train", cfg.train_size, cfg.seed, **config_lib.to_dict(cfg.arithmetic))
            train += data.policy_examples(cfg.samples_policy, records, cfg.policy_samples, cfg.step_separator,
                                          seed=cfg.seed, chat_template=cfg.chat_template)
    else:
        train = data.load_stepwise(cfg.task, cfg.step_separator)
    if cfg.eval_task and cfg.eval_task not in tasks.TASKS:
        held_out = data.load_stepwise(cfg.eval_task, cfg.step_separator, n=cfg.eval_size)
    elif "visual" in (cfg.task, cfg.eval_task) and cfg.eval_task != "arithmetic":
        held_out = data.visual_examples(cfg.eval_size, cfg.seed, "eval", cfg.negatives_per_problem)
    elif cfg.task == "arithmetic" or cfg.eval_task == "arithmetic":
        held_out = data.arithmetic_examples(cfg.eval_size, cfg.seed, "eval", cfg.arithmetic, cfg.negatives_per_problem)
    else:
        if len(train) <= cfg.eval_size:
            raise ConfigError(f"{cfg.task} has {len(train)} rows, not more than eval_size={cfg.eval_size}; "
                              f"lower eval_size or pass eval_task.")
        train, held_out = train[:-cfg.eval_size], train[-cfg.eval_size:]
    if cfg.task not in tasks.TASKS:
        train = train[:cfg.train_size]
    return train, held_out


def epoch_order(groups: list[int], seed: int, epoch: int, by_group: bool = True) -> list[int]:
    """The example order of one epoch, fixed by (seed, epoch) so resume replays it.

    groups[i]: the prompt group of example i. by_group shuffles the prompts and keeps each prompt's
    solutions together, so a batch holds right and wrong solutions of the same problem: their
    gradients differ only where the solutions differ, at the wrong step.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if not by_group:
        return torch.randperm(len(groups), generator=g).tolist()
    members: dict[int, list[int]] = {}
    for i, grp in enumerate(groups):
        members.setdefault(grp, []).append(i)
    keys = list(members)
    return [i for k in torch.randperm(len(keys), generator=g).tolist() for i in members[keys[k]]]


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
    scores = predict(prm, examples, batch_size, model)
    return step_metrics([e.labels for e in examples], scores)


# --- the stage -------------------------------------------------------------------------------

def _existing_output(cfg: Config) -> dict | None:
    """The manifest of a finished, intact output trained by the same config from the same inputs, else
    None (or an error)."""
    return io.completed_output(cfg.output, {"config": training_identity(cfg), "inputs": input_fingerprints(cfg)},
                               cfg.overwrite, "prm")


def _bon_identity(cfg: Config) -> dict:
    return {"bon": config_lib.to_dict(cfg.bon), "arithmetic": config_lib.to_dict(cfg.arithmetic),
            "chat_template": cfg.chat_template}


def _run_best_of_n(cfg: Config, prm_dir: Path, tracker, step: int) -> dict:
    print(f"prm: best-of-{cfg.bon.n} on {cfg.bon.prompts} prompts, sampling from {cfg.bon.policy_path}")
    metrics, table = bestofn.evaluate(str(prm_dir), cfg.bon, cfg.arithmetic, cfg.chat_template, cfg.step_separator, cfg.seed)
    tracker.log_metrics(metrics, step=step)
    tracker.log_table(table, "bon_samples.json")
    summary = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))
    print(f"prm: best-of-{cfg.bon.n}: {summary}")
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
            for src in Path(cfg.output).rglob("*"):
                if src.is_file() and src.name != io.MANIFEST:
                    dst = tmp / src.relative_to(cfg.output)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.link(src, dst)
                    except OSError:
                        shutil.copy2(src, dst)
    return metrics


def run(cfg: Config) -> dict:
    """Train and evaluate a PRM, write it to `cfg.output`, then best-of-N if asked. Returns the metrics."""
    done = _existing_output(cfg)
    if done is not None:
        if cfg.bon.policy_path and done.get("bon") != _bon_identity(cfg):
            modeling.check_model_dir(cfg.bon.policy_path, "bon.policy_path")
            return _add_best_of_n(cfg, done)
        print(f"prm: '{cfg.output}' is already complete for this config and these inputs; nothing to do.")
        checkpoint.clear(checkpoint.work_dir_for(cfg.output))  # left if killed between commit and cleanup
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, stop)


def _run(cfg: Config, stop: preemption.Preemption) -> dict:
    if not modeling.is_tiny(cfg.model_path):
        modeling.check_model_dir(cfg.model_path)
    if cfg.bon.policy_path:
        modeling.check_model_dir(cfg.bon.policy_path, "bon.policy_path")  # fail before training, not after
    if cfg.policy_samples_path:  # with policy_samples_from_backbone it is model_path, checked above
        modeling.check_model_dir(cfg.policy_samples_path, "policy_samples_path")
    identity = training_identity(cfg)
    inputs = input_fingerprints(cfg)
    resume_identity = {**identity, "inputs": inputs}  # a checkpoint from other inputs is not resumed
    train_examples, eval_examples = load_data(cfg)  # bad data fails before a model is loaded
    if modeling.is_tiny(cfg.model_path) and cfg.train_layers:
        log.warning("model_path=%s is a randomly initialized backbone, and train_layers=%d freezes most of it; "
                    "use train_layers=0 to train it all.", cfg.model_path, cfg.train_layers)
    torch.manual_seed(cfg.seed)
    prm = PRM.load(cfg.model_path, cfg.head, cfg.engine.dtype, seed=cfg.seed)
    if cfg.extra_layers and saved_head(cfg.model_path) is None:  # not on top of an already trained PRM
        append_identity_layers(prm.model, cfg.extra_layers, cfg.seed)
    if cfg.train_layers:
        freeze_below(prm.model, cfg.train_layers)
    render = lambda p, images=None: tasks.render_prompt(prm.tokenizer, tasks.PromptRecord("", p, images=images),  # noqa: E731
                                                        cfg.chat_template)
    train, dropped = data.tokenize(train_examples, prm.tokenizer, cfg.step_separator, cfg.head.step_tag, cfg.max_seq_len, render)
    held_out, _ = data.tokenize(eval_examples, prm.tokenizer, cfg.step_separator, cfg.head.step_tag, cfg.max_seq_len, render)
    per_step = cfg.micro_batch_size * cfg.grad_accum
    if len(train) < per_step:
        raise ConfigError(f"{len(train)} training examples are fewer than one optimizer step "
                          f"(micro_batch_size*grad_accum={per_step}); lower them or add data.")
    engine = TrainEngine(prm.model, cfg.engine, OptimSettings(
        lr=cfg.lr, total_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm), cfg.micro_batch_size, cfg.grad_accum)

    work = checkpoint.work_dir_for(cfg.output)
    state = {"step": 0, "consumed": 0}
    resume_from = checkpoint.find(work, resume_identity) if cfg.resume else None
    if resume_from is not None:
        state = engine.load_state(resume_from / "state")
        print(f"prm: resuming from step {state['step']} ({resume_from})")

    tracker = tracking.start_stage_run(cfg.tracking, "prm", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker:
        n_steps = sum(len(e.step_ends) for e in train)
        pos = sum(y >= 0.5 for e in train for y in e.labels)
        tracker.log_metrics({"data/train_examples": len(train), "data/train_steps": n_steps,
                             "data/positive_fraction": pos / max(n_steps, 1), "data/dropped_too_long": dropped},
                            step=state["step"])
        metrics = _train(cfg, prm, engine, train, held_out, state, work, tracker, resume_identity, stop,
                         vision.Vision.of(prm.tokenizer, prm.model.config))
        manifest = {"config": identity, "inputs": inputs, "metrics": metrics, "parents": [cfg.model_path] + (
            [cfg.task] if cfg.task not in tasks.TASKS else [])}
        with io.atomic_output_dir(cfg.output, "prm", overwrite=True, manifest=manifest) as tmp:
            modeling.save_pretrained(engine.module, prm.tokenizer, tmp,
                                     extra={**prm.metadata(cfg.step_separator), "metrics": metrics})
            if cfg.bon.policy_path:
                metrics.update(_run_best_of_n(cfg, tmp, tracker, cfg.max_steps))
                manifest["bon"] = _bon_identity(cfg)
        checkpoint.clear(work)
        tracker.log_metrics(metrics, step=cfg.max_steps)
    print(f"prm: held-out step AUC {metrics['eval/step_auc']:.3f}, step accuracy {metrics['eval/step_accuracy']:.3f}, "
          f"first-error recall {metrics['eval/first_error_recall']:.3f} -> {cfg.output}")
    return metrics


def _preempted(step: int, work: Path) -> preemption.Preempted:
    stopped = preemption.Preempted("prm", step, str(work / "latest"))
    log.warning("%s", stopped)
    print(stopped, file=sys.stderr)
    return stopped


def _train(cfg: Config, prm: PRM, engine: TrainEngine, train, held_out, state, work, tracker, identity,
           stop: preemption.Preemption = preemption.NEVER, vis: "vision.Vision | None" = None) -> dict:
    engine.train()
    n = len(train)
    per_step = cfg.micro_batch_size * cfg.grad_accum
    steps_per_epoch = n // per_step
    metrics: dict = {}
    loss_total = float("nan")
    if state.pop("eval_pending", False):  # stopped right after an eval step, before evaluating it
        tracker.log_metrics(evaluate(prm, held_out, cfg.micro_batch_size * 4, model=engine.module), step=state["step"])
        engine.train()
    if stop.requested:  # asked to stop before the first step: the checkpoint on disk (if any) is current
        raise _preempted(state["step"], work)
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="prm", unit="step", dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 10.0)
    t0, tokens = time.perf_counter(), 0
    guard = vision.BatchGuard(vis, "prm", steps_per_epoch)
    ids = {}
    groups = [ids.setdefault(e.example.prompt, len(ids)) for e in train]
    order = functools.lru_cache(maxsize=2)(lambda epoch: epoch_order(groups, cfg.seed, epoch, cfg.group_by_prompt))
    while state["step"] < cfg.max_steps:
        epoch, offset = divmod(state["consumed"] // per_step, steps_per_epoch)
        chosen = order(epoch)[offset * per_step:(offset + 1) * per_step]
        if guard.skips([train[i] for i in chosen], state, tracker):  # image tokens that do not match the images
            state["consumed"] += per_step
            continue
        micro = [data.collate([train[i] for i in chosen[j:j + cfg.micro_batch_size]], prm.tokenizer.pad_token_id)
                 for j in range(0, per_step, cfg.micro_batch_size)]
        n_step_tokens = sum(int(b["step_mask"].sum()) for b in micro)
        loss_total = 0.0
        for b in micro:
            b = {k: v.to(engine.device) for k, v in b.items()}
            z = prm(b["input_ids"], b["attention_mask"], model=engine, **data.model_inputs(b))  # (B, T) step logits
            # BCE on step positions only; this micro-batch's share of the optimizer step's step-mean
            loss_sum, _ = data.step_bce(z, b["targets"], b["step_mask"])
            loss = loss_sum / n_step_tokens
            engine.backward(loss)
            loss_total += float(loss.detach())
            tokens += int(b["attention_mask"].sum())
        lr = engine.lr
        grad_norm = engine.step()
        state["step"] += 1
        state["consumed"] += per_step
        step = state["step"]
        bar.update(1)
        bar.set_postfix(loss=f"{loss_total:.3f}", lr=f"{lr:.2e}", refresh=False)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            tracker.log_metrics({"train/loss": loss_total, "train/lr": lr, "train/grad_norm": grad_norm,
                                 "train/epoch": state["consumed"] / n,
                                 "perf/tokens_per_s": tokens / (time.perf_counter() - t0)}, step=step)
        if not math.isfinite(loss_total):
            log.warning("non-finite loss at step %d", step)
        if stop.requested and step < cfg.max_steps:  # preempted: save now (the last step always finishes)
            eval_due = bool(cfg.eval_every) and step % cfg.eval_every == 0
            checkpoint.save(engine, prm.tokenizer, work, {**state, "eval_pending": eval_due}, identity)
            bar.close()
            raise _preempted(step, work)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
            metrics = evaluate(prm, held_out, cfg.micro_batch_size * 4, model=engine.module)
            engine.train()
            tracker.log_metrics(metrics, step=step)
            bar.write(f"step {step}: eval step AUC {metrics['eval/step_auc']:.3f}, step accuracy "
                      f"{metrics['eval/step_accuracy']:.3f}, first-error recall {metrics['eval/first_error_recall']:.3f}")
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            checkpoint.save(engine, prm.tokenizer, work, dict(state), identity)
    bar.close()
    metrics["train/loss"] = loss_total
    return metrics
