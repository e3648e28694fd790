"""SFT warm-up: teach the policy the answer format before RL.

    prmflow sft --output outputs/sft                       # tiny model, arithmetic task, CPU
    prmflow sft --config configs/quickstart-cpu.yaml --set max_steps=100
    prmflow sft --policy /models/Qwen2.5-Math-1.5B --task data/train.jsonl --engine.zero_stage 2

Choices: loss on response tokens only (prompt tokens masked), token-mean over every response token
of the optimizer step (so gradient accumulation does not change the objective), right padding to
the longest example of a micro-batch (with grad_accum > 1 a step's examples are cut into micro-batches
in length order: less padding, the same step), AdamW with linear warm-up then cosine/linear decay, gradient
clipping, DeepSpeed (ZeRO 0-3) or plain PyTorch, optional LoRA through peft (saved merged). Held-out
evaluation: loss, and greedy-decoding accuracy checked by the task's verifier. The training loop is
the one prm uses too (training/supervised.py); this module supplies the loss. Resume: a checkpoint
beside the output (`.OUTPUT.work/latest`) is picked up on restart with the same config, continuing
the step count, LR schedule and data order. On SIGTERM (Kubernetes stopping the pod) the step in
progress finishes, the resume checkpoint is saved and the process exits with status 143
(runtime/preemption.py); running the same command again continues bit-for-bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..training import checkpoint
from .. import config as config_lib
from ..runtime import distributed, preemption
from ..data import io
from ..models import modeling, vision
from ... import tasks, tracking
from ..training.engine import EngineConfig, OptimSettings, TrainEngine, init_distributed
from ...errors import ConfigError
from ..sampling.generation import generate_texts
from ..training.optim import OptimConfig
from ...tasks.arithmetic import ArithmeticConfig
from ...tasks.memory_agent import MemoryAgentConfig
from ..training import supervised, supervised_data as data

log = logging.getLogger(__name__)


@dataclass
class Config:
    policy: str = "tiny-llama"
    """Policy to start from: an HF model directory, or a tiny preset (tiny-llama, tiny-qwen2; tiny-llava for images)
    built from a config."""
    output: str = "outputs/sft"
    """Directory the trained policy is written to (HF format), atomically at the end."""
    task: str = "arithmetic"
    """Training data: 'arithmetic' or 'visual' (built-in tasks; visual needs a vision-language model) or a
    .jsonl/.parquet file with prompt/messages + response/answer (+ images)."""
    eval_task: str = ""
    """Held-out data: empty = the built-in task's 'eval' split, or the last eval_size rows of a dataset file."""
    num_prompts: int = 6000
    """Training prompts (each with its reference response) drawn from the task (for a dataset file: at most this many rows)."""
    eval_size: int = 200
    """Held-out examples for eval loss and accuracy."""
    seed: int = 0
    """Seed for model init (tiny presets), data order and sampling."""
    max_seq_len: int = 256
    """Examples longer than this (prompt + response tokens) are dropped with a logged count."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (the tiny tokenizer has none)."""
    micro_batch_size: int = 32
    """Examples per forward/backward pass, shared by the ranks (each of N ranks takes micro_batch_size/N of them)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (batch = micro_batch_size * grad_accum examples, the same on any number of ranks)."""
    max_steps: int = 700
    """Optimizer steps to train for."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, lr_schedule="cosine", warmup_steps=30))
    """Optimizer: peak lr, schedule, warm-up, weight decay, gradient clipping (tiny models like a high lr; use ~1e-5 for
    billion-parameter models)."""
    log_every: int = 10
    """Log train/* and perf/* metrics every this many steps."""
    eval_every: int = 250
    """Evaluate every this many steps (and at the end)."""
    save_every: int = 250
    """Write a resume checkpoint every this many steps (0 = only at the end)."""
    eval_max_new_tokens: int = 64
    """Greedy decoding budget for held-out accuracy."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes kept frozen, e.g. model.vision_tower: a vision-language model then trains its projector
    and language model only (LLaVA's recipe)."""
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
    memory_agent: MemoryAgentConfig = field(default_factory=MemoryAgentConfig)
    """The built-in memory_agent task's episodes and demonstrations (how many chunks they skip or store in part)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("num_prompts", "eval_size", "micro_batch_size", "grad_accum", "max_steps", "max_seq_len", "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.optim.warmup_steps >= self.max_steps:
            raise ConfigError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be smaller than "
                              f"max_steps ({self.max_steps}).")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r is {self.lora_r}; use 0 (off) or a positive rank.")


def load_data(cfg: Config) -> tuple[list[tasks.PromptRecord], list[tasks.PromptRecord]]:
    """(train, held-out) records: the built-in task's splits, or a dataset file whose last eval_size rows
    are held out (unless eval_task names the held-out data)."""
    task_kw = {**config_lib.to_dict(cfg.arithmetic), "memory_agent": config_lib.to_dict(cfg.memory_agent)}
    if cfg.task in tasks.TASKS:
        train = tasks.load(cfg.task, "train", cfg.num_prompts, cfg.seed, **task_kw)
    else:
        train = tasks.load(cfg.task, n=None)
    if cfg.eval_task:
        held_out = tasks.load(cfg.eval_task, "eval", cfg.eval_size, cfg.seed, **task_kw)
    elif cfg.task in tasks.TASKS:
        held_out = tasks.load(cfg.task, "eval", cfg.eval_size, cfg.seed, **task_kw)
    else:
        if len(train) <= cfg.eval_size:
            raise ConfigError(f"{cfg.task} has {len(train)} rows, not more than eval_size={cfg.eval_size}; "
                              f"lower eval_size or pass eval_task.")
        train, held_out = train[:-cfg.eval_size], train[-cfg.eval_size:]
    return train[:cfg.num_prompts], held_out


def _apply_lora(model, cfg: Config):
    """The model with LoRA adapters on cfg.lora_target_modules (peft is imported only when LoRA is asked for)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[data.Example], records: list[tasks.PromptRecord], cfg: Config) -> dict:
    """Held-out loss (token-mean over response tokens) and greedy accuracy by the verifier, over the held-out rows
    that have an answer and are not episodes (NaN when none is: multi-turn demonstrations, whose episodes evaluate
    scores)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), cfg.micro_batch_size):
        batch = data.collate(examples[i:i + cfg.micro_batch_size], tokenizer.pad_token_id)
        batch = {k: v.to(next(model.parameters()).device) for k, v in batch.items()}
        logits = model(**data.model_inputs(batch)).logits
        loss, n = data.response_loss(logits, batch["labels"])
        total, count = total + float(loss), count + n
    model.train()
    if any(r.answer is None or r.source in tasks.EPISODE_SOURCES for r in records):  # the agent's metrics are evaluate's
        records = [r for r in records if r.answer is not None and r.source not in tasks.EPISODE_SOURCES]
        if not records:
            return {"eval/loss": total / max(count, 1), "eval/accuracy": float("nan")}
    model.eval()
    prompts = [tasks.render_prompt(tokenizer, r, cfg.chat_template) for r in records]
    responses = generate_texts(model, tokenizer, prompts, cfg.eval_max_new_tokens, batch_size=100,
                               add_special_tokens=not any(tasks.templated(tokenizer, r, cfg.chat_template) for r in records),
                               images=[r.images or [] for r in records] if any(r.images for r in records) else None)
    correct = [tasks.verify(r, resp) for r, resp in zip(records, responses)]
    model.train()
    return {"eval/loss": total / max(count, 1), "eval/accuracy": sum(correct) / len(correct)}


def accuracy_text(metrics: dict) -> str:
    """The held-out accuracy as the console shows it; episodes have none here (evaluate scores them)."""
    acc = metrics["eval/accuracy"]
    return "accuracy: none for episodes (evaluate scores them)" if acc != acc else f"accuracy {acc:.3f}"


@dataclass
class SFTObjective:
    """SFT's objective for the shared loop: cross-entropy on response tokens, a token-mean over the
    optimizer step; evaluated by held-out loss and greedy accuracy (`evaluate`)."""

    cfg: Config
    tokenizer: Any
    examples: list[data.Example]
    eval_examples: list[data.Example]
    eval_records: list[tasks.PromptRecord]
    stage = "sft"

    def order(self, epoch: int) -> list[int]:
        return data.epoch_order(len(self.examples), self.cfg.seed, epoch)

    def collate(self, examples: list[data.Example]) -> dict[str, torch.Tensor]:
        return data.collate(examples, self.tokenizer.pad_token_id)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != data.IGNORE).sum())  # response tokens that are predicted

    def loss_sum(self, engine: TrainEngine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = engine(**data.model_inputs(batch)).logits  # (B, T, V)
        return data.response_loss(logits, batch["labels"])[0]

    def evaluate(self, engine: TrainEngine) -> dict:
        return evaluate(engine.module, self.tokenizer, self.eval_examples, self.eval_records, self.cfg)

    def summary(self, metrics: dict) -> str:
        return f"eval loss {metrics['eval/loss']:.4f}, {accuracy_text(metrics)}"


def identity(cfg: Config) -> dict:
    """The config as the output's identity records it (finished-output check, resume, manifest): the memory_agent
    section only where a memory-agent task reads it, so an output of another task made before the section existed
    is still this config's."""
    d = config_lib.to_dict(cfg)
    if not {cfg.task, cfg.eval_task} & set(tasks.EPISODE_SOURCES):
        d.pop("memory_agent")
    return d


def run(cfg: Config) -> dict:
    """Train, evaluate and write the policy to `cfg.output`. Returns the final metrics."""
    if n := distributed.should_launch(cfg.engine):  # engine.nproc_per_node > 1: run as n torchrun ranks
        distributed.launch("sft", cfg, n)
        return io.read_manifest(cfg.output).get("metrics", {})
    if distributed.under_launcher():
        init_distributed(cfg.engine)  # the ranks decide together from here on
    done = io.finished_output("sft", cfg.output, identity(cfg), cfg.overwrite)
    if done is not None:
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, stop)


def _run(cfg: Config, stop: preemption.Preemption) -> dict:
    cfg_dict = identity(cfg)
    torch.manual_seed(cfg.seed)
    if not modeling.is_tiny(cfg.policy):
        modeling.check_model_dir(cfg.policy, "policy")  # the error names the key
    model, tokenizer = modeling.load_causal_lm(cfg.policy, cfg.engine.dtype, seed=cfg.seed)
    vis = vision.Vision.of(tokenizer, model.config)
    train_records, eval_records = load_data(cfg)
    train_ex, dropped = data.tokenize(train_records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.task)
    eval_ex, _ = data.tokenize(eval_records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.eval_task or cfg.task)
    schedule = supervised.Schedule.of(cfg)
    schedule.check_fits(len(train_ex))
    modeling.freeze(model, cfg.freeze)
    if cfg.lora_r:
        model = _apply_lora(model, cfg)
    engine = TrainEngine(model, cfg.engine, OptimSettings.of(cfg.optim, cfg.max_steps),
                         cfg.micro_batch_size, cfg.grad_accum)

    work = checkpoint.work_dir_for(cfg.output)
    state = supervised.resume(engine, work, cfg_dict, cfg.resume, "sft")

    tracker = tracking.start_stage_run(cfg.tracking, "sft", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())}) \
        if distributed.is_main() else tracking.NullTracker()  # one MLflow run, from rank 0
    with tracker:
        tracker.log_metrics({"data/train_examples": len(train_ex), "data/dropped_too_long": dropped}, step=state["step"])
        objective = SFTObjective(cfg, tokenizer, train_ex, eval_ex, eval_records)
        metrics = supervised.train(objective, schedule, engine, tokenizer, state, work, cfg_dict,
                                   tracker, stop, vis)
        with io.shared_output_dir(cfg.output, "policy", overwrite=True,
                                  manifest={"config": checkpoint.identity(cfg_dict), "metrics": metrics,
                                            "parents": [cfg.policy]}) as tmp, engine.gathered():
            if distributed.is_main():  # ZeRO-3 weights gathered once; rank 0 writes them
                modeling.save_pretrained(engine.module, tokenizer, tmp, extra={"stage": "sft", "metrics": metrics})
        checkpoint.clear(work)
    if not distributed.is_main():
        return metrics
    print(f"sft: held-out {accuracy_text(metrics)}, eval loss {metrics['eval/loss']:.4f} -> {cfg.output}")
    return metrics
