"""The `sampling` section shared by the stages that sample from a policy (rollout, evaluate,
prm-label, prm's best-of-N): how one response is drawn.

How many responses a prompt gets (`n_samples`) stays a flat key of each stage: it is the group size
(GRPO/RLOO baselines, pass@k, best-of-N's N, Math-Shepherd's solutions per prompt), a property of
the experiment rather than of the decoding. Each stage keeps its own defaults (`sampling:
SamplingConfig = field(default_factory=lambda: SamplingConfig(...))`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature (1.0 = the policy's own distribution; rollout: 0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off)."""
    max_new_tokens: int = 64
    """Most tokens per response (EOS included)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature is {self.temperature}; use 0 (greedy) or a positive value.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p is {self.top_p}; it must be in (0, 1].")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k is {self.top_k}; use 0 (off) or more.")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens is {self.max_new_tokens}; it must be at least 1.")
