"""The ppo stage's config: every knob with its default and why, and the combinations it refuses.

The CLI (`prmflow ppo --help`), the YAML configs and the KFP component are generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ... import tracking
from ..training.engine import EngineConfig
from ...errors import ConfigError
from ..training.optim import OptimConfig
from ...tasks.arithmetic import ArithmeticConfig


@dataclass
class Config:
    policy: str = "outputs/sft"
    """Policy that generated the batch (HF dir); it is trained and written to OUTPUT/policy."""
    input: str = "outputs/advantages"
    """Advantages hand-off directory (the advantage stage's output; a parent of shard dirs works too)."""
    output: str = "outputs/ppo"
    """Output directory: policy/, critic/, policy_ema/, kl_state.json, updates.jsonl (written atomically)."""
    iteration: int = 0
    """RL iteration k: tags the MLflow run, seeds the minibatch order, positions the LR schedule."""
    seed: int = 0
    """Seed of the minibatch order and the ptx data order."""
    epochs: int = 2
    """Passes over the batch (PPO epochs); each pass reshuffles the minibatches. More reuse, more drift."""
    minibatch_size: int = 32
    """Responses per optimizer update; each epoch has floor(N / minibatch_size) updates (a remainder sits out)."""
    micro_batch_size: int = 8
    """Responses per forward/backward; must divide minibatch_size. Only memory changes with it."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, lr_schedule="constant", warmup_steps=0))
    """Policy optimizer (the critic's too, but for critic_lr): lr (tiny CPU models; use ~1e-6 for billion-parameter
    models), LR schedule and warm-up in updates over the whole RL run (rl_iterations x updates per iteration), weight
    decay, gradient-norm clip of each model."""
    rl_iterations: int = 1
    """RL iterations the LR schedule spans; this run starts at iteration x its number of updates. In a pipeline,
    left out: pipeline.iterations (a chain's whole length)."""
    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + clip_eps_high (DAPO's clip-higher uses 0.28 to keep exploring)."""
    dual_clip: float = 0.0
    """Dual clip c > 1 bounds the loss of negative-advantage tokens at -c*A when the ratio exceeds c (0 = off)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number: over all tokens, per sequence then over sequences, or Dr. GRPO."""
    drgrpo_max_len: int = 0
    """Dr. GRPO's constant length; 0 = the rollout's sampling.max_new_tokens, as the advantages' manifest records it."""
    advantage_clip: float = 0.0
    """Clamp advantages to [-advantage_clip, advantage_clip] (0 = off); guards against outlier rewards."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy); costs a softmax over the vocabulary with gradient."""
    entropy_metric_tokens: int = 64
    """With entropy_coef 0, the `train/entropy` metric is the mean over at most this many evenly spaced response
    tokens of each micro-batch (a full-vocabulary softmax per token; at 151,936 tokens it cost as much as a third
    of the update); 0 = every token."""
    head_chunk_rows: int = 512
    """Tokens per pass through the LM head when the policy scores responses (and the ptx loss its references): log-probs
    are computed chunk by chunk from the hidden states, so the (batch, tokens, vocabulary) logits never exist. 0 = the
    whole logits (the reference computation)."""
    kl_loss_coef: float = 0.0
    """KL loss to the reference model (GRPO style; needs ref_logprobs); 0 = KL only in the reward."""
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL loss: k1 = x, k2 = x^2/2, k3 = exp(-x)-1+x with x = logp - ref_logp."""
    top_entropy_frac: float = 1.0
    """Policy loss only on this fraction of the batch's highest-entropy tokens (Wang et al. 2025 use 0.2; 1 = all)."""
    recompute_old_logprobs: bool | None = None
    """Recompute old_logprobs with this stage's engine (one extra forward) instead of reading the hand-off's. Empty:
    recompute on a GPU or with engine.dtype=bfloat16 (so the first ratio is exactly 1), read the hand-off on CPU in
    float32 (equal up to ~2e-5). docs/design.md#the-ppo-update"""
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Importance-sampling correction for the sampler-trainer gap: weight each token's loss by pi_old / pi_sampler, per
    token or per response, truncated at rollout_correction_cap (TIS) or masked above it (MIS). Use token_truncate with
    sampler=vllm; docs/design.md#the-ppo-update."""
    rollout_correction_cap: float = 2.0
    """The cap C of rollout_correction (veRL's and the TIS paper's 2.0): a weight above it is cut to C (truncate) or its
    token/response leaves the loss (mask). Must be at least 1, so tokens the two engines agree on keep their weight."""
    ptx_coef: float = 0.0
    """Coefficient of an SFT (ptx) loss on reference solutions, added to every policy update (0 = off)."""
    ptx_task: str = "arithmetic"
    """Supervised data for the ptx loss: 'arithmetic' (reference solutions) or a .jsonl/.parquet with responses."""
    ptx_batch_size: int = 16
    """Supervised examples per update for the ptx loss (at least minibatch_size / micro_batch_size)."""
    ptx_num_prompts: int = 2000
    """Supervised examples (prompts with their reference responses) drawn from ptx_task."""
    max_seq_len: int = 256
    """Supervised (ptx) examples longer than this are dropped."""
    chat_template: bool = True
    """Wrap ptx prompts in the tokenizer's chat template when it has one (as sft does)."""
    train_critic: bool = False
    """Train a value model (needed by GAE advantages); reads 'returns' (and 'values' as V_old) from the batch."""
    critic: str = ""
    """Critic to continue training (the previous iteration's OUTPUT/critic); empty = a new one from critic_init."""
    critic_init: Literal["policy", "prm"] = "policy"
    """Backbone of a new critic: the policy (policy) or the PRM (prm); its value head starts at 0."""
    prm: str = ""
    """PRM directory, for critic_init=prm."""
    critic_lr: float = 1e-3
    """Critic learning rate (tiny CPU models; ~1e-5 for billion-parameter models)."""
    value_clip: float = 0.2
    """Value clipping: V may move at most this far from V_old before its error stops counting (0 = off)."""
    critic_warmup_steps: int = 0
    """The first updates of this run train only the critic (actor frozen); use it while a new critic is meaningless."""
    kl_control: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient of the reward: fixed, or adapted toward kl_target (Ziegler et al. 2019)."""
    kl_coef: float = 0.0
    """KL coefficient beta of this batch's rewards when the advantages manifest does not record it (kl_coef_used;
    advantages from another tool)."""
    kl_target: float = 6.0
    """Adaptive control: target KL per response (nats, summed over its tokens)."""
    kl_horizon: int = 10000
    """Adaptive control: responses over which beta may change by at most 20% per unit of error."""
    optimizer_state: str = ""
    """Optimizer moments to continue from: the previous iteration's OUTPUT/optimizer, so the RL iterations train as one
    long run. Empty = a fresh optimizer, whose first bias-corrected updates are sign-like steps of size lr on every
    parameter (noisy when an iteration has few updates)."""
    save_optimizer: bool = True
    """Write the optimizer moments to OUTPUT/optimizer for the next iteration (costs 2x the trainable parameters in fp32
    on disk; turn off for very large models)."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the policy weights (e.g. 0.99) and write it to OUTPUT/policy_ema (0 = off)."""
    save_every: int = 0
    """Write a resume checkpoint every this many updates (0 = never)."""
    resume: bool = True
    """Continue from the checkpoint beside the output when one with the same config exists."""
    overwrite: bool = False
    """Replace an existing output written with a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the arithmetic task (for ptx_task=arithmetic)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend (policy and critic alike)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes of the policy kept frozen (e.g. model.vision_tower, as the SFT warm-up froze them)."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def recomputes_old_logprobs(self) -> bool:
        """`recompute_old_logprobs`, the empty default resolved for the machine this stage runs on."""
        if self.recompute_old_logprobs is not None:
            return self.recompute_old_logprobs
        import torch

        return torch.cuda.is_available() or self.engine.dtype != "float32"

    def __post_init__(self):
        for key in ("epochs", "minibatch_size", "micro_batch_size", "rl_iterations", "kl_horizon", "ptx_batch_size",
                    "ptx_num_prompts", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.minibatch_size % self.micro_batch_size:
            raise ConfigError(f"micro_batch_size ({self.micro_batch_size}) must divide minibatch_size "
                              f"({self.minibatch_size}); e.g. set micro_batch_size to a divisor of it.")
        if self.critic_lr <= 0:
            raise ConfigError(f"critic_lr is {self.critic_lr}; it must be positive.")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ConfigError(f"clip_eps_low must be in [0, 1) and clip_eps_high >= 0 (got {self.clip_eps_low}, "
                              f"{self.clip_eps_high}).")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip is {self.dual_clip}; use 0 (off) or a bound c > 1 (3.0 is usual).")
        if self.rollout_correction_cap < 1:
            raise ConfigError(f"rollout_correction_cap is {self.rollout_correction_cap}; it must be at least 1 (a cap "
                              f"below 1 would shrink the tokens the sampler and the trainer agree on); 2.0 is usual.")
        if not 0 < self.top_entropy_frac <= 1:
            raise ConfigError(f"top_entropy_frac is {self.top_entropy_frac}; it must be in (0, 1].")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"ema_decay is {self.ema_decay}; use 0 (off) or a decay in (0, 1).")
        for key in ("advantage_clip", "entropy_coef", "kl_loss_coef", "ptx_coef", "value_clip", "kl_coef",
                    "critic_warmup_steps", "save_every", "drgrpo_max_len", "iteration", "entropy_metric_tokens",
                    "head_chunk_rows"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must not be negative.")
        if self.kl_target <= 0:
            raise ConfigError(f"kl_target is {self.kl_target}; it must be positive.")
        if self.critic_warmup_steps and not self.train_critic:
            raise ConfigError("critic_warmup_steps needs train_critic=true (only a critic can train while the actor is frozen).")
        if self.train_critic and self.critic_init == "prm" and not self.critic and not self.prm:
            raise ConfigError("critic_init=prm needs prm (the PRM directory), or set critic_init=policy.")
        if self.optim.lr_schedule != "constant" and self.iteration >= self.rl_iterations:
            raise ConfigError(f"iteration ({self.iteration}) is past the end of the LR schedule (rl_iterations="
                              f"{self.rl_iterations}); raise rl_iterations or use optim.lr_schedule=constant.")
        if self.ptx_coef and self.ptx_batch_size < self.minibatch_size // self.micro_batch_size:
            raise ConfigError(f"ptx_batch_size ({self.ptx_batch_size}) must be at least the number of micro-batches "
                              f"per update ({self.minibatch_size // self.micro_batch_size}).")

