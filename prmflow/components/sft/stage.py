"""SFT warm-up: teach the policy the answer format before RL.

    prmflow sft --output outputs/sft                       # tiny model, arithmetic task, CPU
    prmflow sft --config configs/quickstart-cpu.yaml --set max_steps=100
    prmflow sft --model_path /models/Qwen2.5-Math-1.5B --task data/train.jsonl --engine.zero_stage 2

Choices: loss on response tokens only (prompt tokens masked), token-mean over every response token
of the optimizer step (so gradient accumulation does not change the objective), right padding to
the longest example of a micro-batch, AdamW with linear warm-up then cosine/linear decay, gradient
clipping, DeepSpeed (ZeRO 0-3) or plain PyTorch, optional LoRA through peft (saved merged). Held-out
evaluation: loss, and greedy-decoding accuracy checked by the task's verifier. Resume: a checkpoint
beside the output (`.OUTPUT.work/latest`) is picked up on restart with the same config, continuing
the step count, LR schedule and data order. On SIGTERM (Kubernetes stopping the pod) the step in
progress finishes, the resume checkpoint is saved and the process exits with status 143
(common/preemption.py); running the same command again continues bit-for-bit.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..common import checkpoint, config as config_lib, io, modeling, preemption, tasks, tracking, vision
from ..common.engine import EngineConfig, OptimSettings, TrainEngine
from ..common.errors import ConfigError, OutputExistsError
from ..common.generation import generate_texts
from ..common.tasks.arithmetic import ArithmeticConfig
from ..lib import supervised_data as data

log = logging.getLogger(__name__)


@dataclass
class Config:
    model_path: str = "tiny-llama"
    """HF model directory to start from, or a tiny preset (tiny-llama, tiny-qwen2; tiny-llava for images) built from a config."""
    output: str = "outputs/sft"
    """Directory the trained policy is written to (HF format), atomically at the end."""
    task: str = "arithmetic"
    """Training data: 'arithmetic' or 'visual' (built-in tasks; visual needs a vision-language model) or a .jsonl/.parquet file with prompt/messages + response/answer (+ images)."""
    eval_task: str = ""
    """Held-out data: empty = the built-in task's 'eval' split, or the last eval_size rows of a dataset file."""
    train_size: int = 6000
    """Training examples drawn from the task (for a dataset file: at most this many rows)."""
    eval_size: int = 200
    """Held-out examples for eval loss and accuracy."""
    seed: int = 0
    """Seed for model init (tiny presets), data order and sampling."""
    max_seq_len: int = 256
    """Examples longer than this (prompt + response tokens) are dropped with a logged count."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (the tiny tokenizer has none)."""
    micro_batch_size: int = 32
    """Examples per forward/backward pass."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (effective batch = micro_batch_size * grad_accum * GPUs)."""
    max_steps: int = 700
    """Optimizer steps to train for."""
    lr: float = 3e-3
    """Peak learning rate (tiny models like a high one; use ~1e-5 for billion-parameter models)."""
    warmup_steps: int = 30
    """Linear warm-up steps from 0 to lr."""
    lr_schedule: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    """Decay after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on norms and biases)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    log_every: int = 10
    """Log train/* and perf/* metrics every this many steps."""
    eval_every: int = 250
    """Evaluate every this many steps (and at the end)."""
    save_every: int = 250
    """Write a resume checkpoint every this many steps (0 = only at the end)."""
    eval_max_new_tokens: int = 64
    """Greedy decoding budget for held-out accuracy."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes kept frozen, e.g. model.vision_tower: a vision-language model then trains its projector and language model only (LLaVA's recipe)."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights. LoRA is saved merged into the base weights."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters."""
    resume: bool = True
    """Continue from the checkpoint beside the output when one with the same config exists."""
    overwrite: bool = False
    """Replace an existing output written with a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the built-in arithmetic task."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("train_size", "eval_size", "micro_batch_size", "grad_accum", "max_steps", "max_seq_len", "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.lr <= 0:
            raise ConfigError(f"lr is {self.lr}; it must be positive.")
        if self.warmup_steps >= self.max_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps}).")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r is {self.lora_r}; use 0 (off) or a positive rank.")


def _load_data(cfg: Config) -> tuple[list[tasks.PromptRecord], list[tasks.PromptRecord]]:
    akw = config_lib.to_dict(cfg.arithmetic)
    if cfg.task in tasks.TASKS:
        train = tasks.load(cfg.task, "train", cfg.train_size, cfg.seed, **akw)
    else:
        train = tasks.load(cfg.task, n=None)
    if cfg.eval_task:
        held_out = tasks.load(cfg.eval_task, "eval", cfg.eval_size, cfg.seed, **akw)
    elif cfg.task in tasks.TASKS:
        held_out = tasks.load(cfg.task, "eval", cfg.eval_size, cfg.seed, **akw)
    else:
        if len(train) <= cfg.eval_size:
            raise ConfigError(f"{cfg.task} has {len(train)} rows, not more than eval_size={cfg.eval_size}; "
                              f"lower eval_size or pass eval_task.")
        train, held_out = train[:-cfg.eval_size], train[-cfg.eval_size:]
    return train[:cfg.train_size], held_out


def _apply_lora(model, cfg: Config):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[data.Example], records: list[tasks.PromptRecord], cfg: Config) -> dict:
    """Held-out loss (token-mean over response tokens) and greedy accuracy by the verifier."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), cfg.micro_batch_size):
        batch = data.collate(examples[i:i + cfg.micro_batch_size], tokenizer.pad_token_id)
        batch = {k: v.to(next(model.parameters()).device) for k, v in batch.items()}
        logits = model(**data.model_inputs(batch)).logits
        loss, n = data.response_loss(logits, batch["labels"])
        total, count = total + float(loss), count + n
    prompts = [tasks.render_prompt(tokenizer, r, cfg.chat_template) for r in records]
    responses = generate_texts(model, tokenizer, prompts, cfg.eval_max_new_tokens, batch_size=100,
                               add_special_tokens=not any(tasks.templated(tokenizer, r, cfg.chat_template) for r in records),
                               images=[r.images or [] for r in records] if any(r.images for r in records) else None)
    correct = [tasks.verify(r, resp) for r, resp in zip(records, responses)]
    model.train()
    return {"eval/loss": total / max(count, 1), "eval/accuracy": sum(correct) / len(correct)}


def _existing_output(cfg: Config) -> dict | None:
    """Metrics of a finished output written by the same config (nothing to do), else None."""
    out = Path(cfg.output)
    if not out.exists():
        return None
    if (out / io.MANIFEST).is_file():
        manifest = io.read_manifest(out)
        if manifest.get("config") == checkpoint.identity(config_lib.to_dict(cfg)):
            return manifest.get("metrics", {})
    if cfg.overwrite:
        return None
    raise OutputExistsError(
        f"Output '{out}' already exists and was not written by this config. Pass --overwrite true to replace it, "
        f"or choose another --output."
    )


def run(cfg: Config) -> dict:
    """Train, evaluate and write the policy to `cfg.output`. Returns the final metrics."""
    done = _existing_output(cfg)
    if done is not None:
        log.info("%s already holds a finished SFT policy from this config; nothing to do.", cfg.output)
        print(f"sft: '{cfg.output}' is already complete for this config; nothing to do.")
        checkpoint.clear(checkpoint.work_dir_for(cfg.output))  # left if killed between commit and cleanup
        return done
    with preemption.Preemption() as stop:
        return _run(cfg, stop)


def _run(cfg: Config, stop: preemption.Preemption) -> dict:
    cfg_dict = config_lib.to_dict(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer = modeling.load_causal_lm(cfg.model_path, cfg.engine.dtype, seed=cfg.seed)
    vis = vision.Vision.of(tokenizer, model.config)
    train_records, eval_records = _load_data(cfg)
    train_ex, dropped = data.tokenize(train_records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.task)
    eval_ex, _ = data.tokenize(eval_records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.eval_task or cfg.task)
    per_step = cfg.micro_batch_size * cfg.grad_accum
    if len(train_ex) < per_step:
        raise ConfigError(f"{len(train_ex)} training examples are fewer than one optimizer step "
                          f"(micro_batch_size*grad_accum={per_step}); lower them or add data.")
    modeling.freeze(model, cfg.freeze)
    if cfg.lora_r:
        model = _apply_lora(model, cfg)
    engine = TrainEngine(model, cfg.engine, OptimSettings(
        lr=cfg.lr, total_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm), cfg.micro_batch_size, cfg.grad_accum)

    work = checkpoint.work_dir_for(cfg.output)
    state = {"step": 0, "consumed": 0}
    resume_from = checkpoint.find(work, cfg_dict) if cfg.resume else None
    if resume_from is not None:
        state = engine.load_state(resume_from / "state")
        log.info("resuming from %s at step %d", resume_from, state["step"])
        print(f"sft: resuming from step {state['step']} ({resume_from})")

    tracker = tracking.start_stage_run(cfg.tracking, "sft", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker:
        tracker.log_metrics({"data/train_examples": len(train_ex), "data/dropped_too_long": dropped}, step=state["step"])
        metrics = _train(cfg, engine, tokenizer, train_ex, eval_ex, eval_records, state, work, tracker, cfg_dict, stop, vis)
        with io.atomic_output_dir(cfg.output, "policy", overwrite=True,
                                  manifest={"config": checkpoint.identity(cfg_dict), "metrics": metrics,
                                            "parents": [cfg.model_path]}) as tmp:
            modeling.save_pretrained(engine.module, tokenizer, tmp, extra={"stage": "sft", "metrics": metrics})
        checkpoint.clear(work)
    print(f"sft: held-out accuracy {metrics['eval/accuracy']:.3f}, eval loss {metrics['eval/loss']:.4f} -> {cfg.output}")
    return metrics


def _preempted(step: int, work: Path) -> preemption.Preempted:
    stopped = preemption.Preempted("sft", step, str(work / "latest"))
    log.warning("%s", stopped)
    print(stopped, file=sys.stderr)
    return stopped


def _train(cfg, engine, tokenizer, train_ex, eval_ex, eval_records, state, work, tracker, cfg_dict,
           stop: preemption.Preemption = preemption.NEVER, vis: "vision.Vision | None" = None) -> dict:
    engine.train()
    n = len(train_ex)
    per_step = cfg.micro_batch_size * cfg.grad_accum
    steps_per_epoch = n // per_step
    metrics: dict = {}
    if state.pop("eval_pending", False):  # stopped right after an eval step, before evaluating it
        tracker.log_metrics(evaluate(engine.module, tokenizer, eval_ex, eval_records, cfg), step=state["step"])
    if stop.requested:  # asked to stop before the first step: the checkpoint on disk (if any) is current
        raise _preempted(state["step"], work)
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="sft", unit="step", dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 10.0)
    t0, tokens = time.perf_counter(), 0
    guard = vision.BatchGuard(vis, "sft", steps_per_epoch)
    while state["step"] < cfg.max_steps:
        epoch, offset = divmod(state["consumed"] // per_step, steps_per_epoch)
        order = data.epoch_order(n, cfg.seed, epoch)
        chosen = order[offset * per_step:(offset + 1) * per_step]
        if guard.skips([train_ex[i] for i in chosen], state, tracker):  # image tokens that do not match the images
            state["consumed"] += per_step
            continue
        micro = [data.collate([train_ex[i] for i in chosen[j:j + cfg.micro_batch_size]], tokenizer.pad_token_id)
                 for j in range(0, per_step, cfg.micro_batch_size)]
        n_tokens = sum(int((b["labels"][:, 1:] != data.IGNORE).sum()) for b in micro)
        loss_total = 0.0
        for b in micro:
            b = {k: v.to(engine.device) for k, v in b.items()}
            logits = engine(**data.model_inputs(b)).logits
            loss_sum, _ = data.response_loss(logits, b["labels"])
            loss = loss_sum / n_tokens  # this micro-batch's share of the step's token-mean
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
            elapsed = time.perf_counter() - t0
            tracker.log_metrics({"train/loss": loss_total, "train/lr": lr, "train/grad_norm": grad_norm,
                                 "train/epoch": state["consumed"] / n, "perf/tokens_per_s": tokens / elapsed}, step=step)
        if not math.isfinite(loss_total):
            log.warning("non-finite loss at step %d", step)
        if stop.requested and step < cfg.max_steps:  # preempted: save now (the last step always finishes)
            eval_due = bool(cfg.eval_every) and step % cfg.eval_every == 0
            checkpoint.save(engine, tokenizer, work, {**state, "eval_pending": eval_due}, cfg_dict)
            bar.close()
            raise _preempted(step, work)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
            metrics = evaluate(engine.module, tokenizer, eval_ex, eval_records, cfg)
            tracker.log_metrics(metrics, step=step)
            bar.write(f"step {step}: eval loss {metrics['eval/loss']:.4f}, accuracy {metrics['eval/accuracy']:.3f}")
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            checkpoint.save(engine, tokenizer, work, dict(state), cfg_dict)
    bar.close()
    metrics["train/loss"] = loss_total if cfg.max_steps > 0 else float("nan")
    return metrics
