"""The `optim` section shared by the training stages (sft, prm, ppo): learning rate, schedule,
warm-up, weight decay and gradient clipping of the AdamW optimizer the engine builds.

Each stage keeps its own defaults (`optim: OptimConfig = field(default_factory=lambda:
OptimConfig(lr=...))`); `config.flat_fields` and the generated README tables show the stage's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...errors import ConfigError


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate (tiny CPU models like a high one; use ~1e-5 (supervised) or ~1e-6 (RL) for billion-parameter models)."""
    lr_schedule: Literal["cosine", "linear", "constant_with_warmup", "constant"] = "constant"
    """LR decay after warm-up (ppo: over the whole RL run, rl_iterations x updates per iteration)."""
    warmup_steps: int = 0
    """Linear LR warm-up from 0 to lr, in optimizer steps (ppo: updates counted over the whole RL run)."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on norms and biases)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    eps: float = 1e-8
    """AdamW's epsilon, added to sqrt(v): a larger one damps the steps of parameters whose gradients are near zero (rare
    tokens' embeddings), where Adam would otherwise take a full lr-sized step on float noise."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr is {self.lr}; it must be positive.")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps is {self.eps}; it must be positive (torch's default is 1e-8).")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps is {self.warmup_steps}; use 0 or more.")
