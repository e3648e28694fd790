"""The prm stage's Config, and what identifies a trained PRM: the config keys and input files that decide its weights."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..training import checkpoint
from .. import config as config_lib
from ..data import io
from ..models import modeling
from ... import tasks, tracking
from ..training.engine import EngineConfig
from ...errors import ConfigError
from ..training.optim import OptimConfig
from ..sampling.config import SamplingConfig
from ...tasks.arithmetic import ArithmeticConfig
from ..scoring import bestofn
from ..models.prm_model import HeadConfig


@dataclass
class Config:
    backbone: str = "outputs/sft"
    """Model the PRM is built on: a causal-LM HF directory (default: the sft stage's output), an existing PRM directory,
    or a tiny preset (random init: then train_layers=0, extra_layers=0). The verifier's starting weights, which need not
    be the policy's."""
    extra_layers: int = 2
    """Decoder layers appended to a causal-LM backbone, starting as the identity: room to compare the backbone's
    next-token predictions with the tokens actually written (what a verifier does). Costs (layers+extra)/layers compute."""
    train_layers: int = 2
    """Train only the last train_layers decoder layers (plus the final norm and the head); the rest of the backbone
    stays frozen. 0 = train everything. With extra_layers = train_layers the verifier reads a frozen policy's own
    predictions, and a step costs about a third."""
    output: str = "outputs/prm"
    """Directory the trained PRM is written to (HF format + prmflow.json with its head), atomically at the end."""
    task: str = "arithmetic"
    """Training data: 'arithmetic' or 'visual' (built-in tasks, exact step labels incl. wrong steps; visual needs a
    vision-language backbone, head.kind=lm_tokens), 'memory_agent(_qwen)' (turns labelled by its environment) or a
    stepwise .jsonl/.parquet file (prompt, steps, labels, images)."""
    eval_task: str = ""
    """Held-out step data: a stepwise file, or 'arithmetic' (its 'eval' split, exact labels). Empty: the arithmetic
    'eval' split for task=arithmetic, else the task file's last prompts (at least eval_size rows). Training never sees a
    held-out prompt."""
    num_prompts: int = 6000
    """Arithmetic: problems (each gives its reference solution and negatives_per_problem wrong ones); a file: at most
    this many rows."""
    eval_size: int = 300
    """Held-out arithmetic problems (for a file: at least this many rows, whole prompts) for step AUC / accuracy /
    first-error recall."""
    negatives_per_problem: int = 2
    """Arithmetic: wrong solutions per problem (mostly arithmetic.corrupt); more negatives, more error patterns seen."""
    policy: str = ""
    """Arithmetic: a policy (HF directory) whose own sampled solutions, labelled by the exact checker, join the training
    data (matches the errors the PRM will judge). Empty = reference + corrupted solutions only."""
    policy_from_backbone: bool = False
    """Arithmetic: sample those solutions from the backbone itself (the SFT policy), as if policy named it: the
    pipeline's switch, as the SFT policy's path is known only at run time. Why it matters: the prm stage's README, 'On
    the quickstart's mixed SFT policy'."""
    n_samples: int = 2
    """Arithmetic with policy (or policy_from_backbone): solutions sampled per training problem."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How those solutions are sampled (temperature > 0, top_p, top_k; max_new_tokens caps each one)."""
    batch_sequences: int = 256
    """Sequences (a prompt and one sampled solution) per generation batch when sampling the policy. Larger batches are
    faster on CPU (1,024: ~1.35x the sequences per second of 256 on the quickstart's tiny model, 2 cores) and cost
    KV-cache memory on a GPU."""
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
    """Solutions per forward/backward pass, shared by the ranks (each of N ranks takes micro_batch_size/N of them)."""
    group_by_prompt: bool = True
    """Keep the solutions of one prompt in the same batch (shuffling prompts, not solutions): right and wrong solutions
    of a problem side by side."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (batch = micro_batch_size * grad_accum examples, the same on any number of ranks)."""
    max_steps: int = 6000
    """Optimizer steps to train for. Measured on the SFT test policy's backbone (tiny model, CPU): held-out step AUC
    0.883 after 3000 steps, 0.931 after 6000 (0.912 already at step 3500 of the 6000-step schedule)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=50))
    """Optimizer: peak lr, schedule, warm-up, weight decay, gradient clipping (tiny models like a high lr; use ~1e-5 for
    billion-parameter models)."""
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
    """Best-of-N reranking after training (needs bon.policy)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("num_prompts", "eval_size", "micro_batch_size", "grad_accum", "max_steps", "max_seq_len",
                    "log_every", "batch_sequences"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.extra_layers < 0 or self.train_layers < 0:
            raise ConfigError(f"extra_layers ({self.extra_layers}) and train_layers ({self.train_layers}) must be 0 or more.")
        if self.negatives_per_problem < 0:
            raise ConfigError(f"negatives_per_problem is {self.negatives_per_problem}; use 0 or more.")
        if self.optim.warmup_steps >= self.max_steps:
            raise ConfigError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be smaller than "
                              f"max_steps ({self.max_steps}).")
        if self.policy_from_backbone and self.policy:
            raise ConfigError("policy_from_backbone=true and policy both name the policy to sample; "
                              "set one of them.")
        if self.samples_policy and self.task not in tasks.TASKS:
            raise ConfigError("policy / policy_from_backbone need a built-in task (arithmetic or visual: its checker labels "
                              "the samples); "
                              "for other data, label samples with `prmflow prm-label` and pass them as task.")
        if self.samples_policy and self.sampling.temperature == 0:
            raise ConfigError("sampling.temperature is 0: every one of the n_samples solutions of a problem would be the "
                              "same greedy one; use a temperature above 0 (1.0 samples the policy's own distribution).")
        if not self.step_separator:
            raise ConfigError("step_separator is empty; steps need a separator (the default is a newline).")
        if self.policy_from_backbone and modeling.is_tiny(self.backbone):
            raise ConfigError(f"policy_from_backbone=true samples the backbone, but '{self.backbone}' is an "
                              f"untrained preset; point backbone at a trained policy (e.g. the sft output).")

    @property
    def samples_policy(self) -> str:
        """The policy whose own solutions join the training data ('' = none)."""
        return self.backbone if self.policy_from_backbone else self.policy


def training_identity(cfg: Config) -> dict:
    """The keys that decide the trained weights (best-of-N settings only decide extra metrics)."""
    d = config_lib.to_dict(cfg)
    d.pop("bon")
    d["head"] = cfg.head.recorded()  # beta only for the head that reads it (older outputs still match)
    return checkpoint.identity(d)


def input_fingerprints(cfg: Config) -> dict[str, str]:
    """What the weights are trained from besides the config: {path: digest} of the backbone and the
    policy-samples model when they are prmflow outputs (their manifests' file digests) and of the
    step data files (their bytes). The same config on a retrained SFT policy or edited labels is a
    different result: a re-run is refused, a resume checkpoint is not picked up."""
    return io.input_fingerprints([cfg.backbone, cfg.samples_policy,
                                  *(t for t in (cfg.task, cfg.eval_task) if t not in tasks.TASKS)])
