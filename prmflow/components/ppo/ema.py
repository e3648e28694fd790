"""The policy's exponential moving average (`ema_decay`): ema <- decay * ema + (1 - decay) * weights after
every applied policy update, kept in float32 on the CPU, written to OUTPUT/policy_ema.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from ..runtime import distributed
from ..training.engine import TrainEngine


class PolicyEMA:
    """A float32 CPU copy of the policy's parameters, by name, that trails the trained weights.

    Every rank keeps the whole copy (ZeRO-3 gathers the weights for each update), so any rank can
    swap it into the model; rank 0 alone writes it to a resume checkpoint."""

    FILE = "ema.safetensors"
    """Its file in a resume checkpoint."""

    def __init__(self, engine: TrainEngine, decay: float):
        self.decay = decay
        with engine.gathered():
            self.weights = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}

    @torch.no_grad()
    def update(self, engine: TrainEngine) -> None:
        """Move the average toward the engine's current weights (after an applied policy update)."""
        with engine.gathered():
            for name, p in engine.module.named_parameters():
                self.weights[name].mul_(self.decay).add_(p.detach().float().cpu(), alpha=1 - self.decay)

    def save(self, directory: Path) -> None:
        """Write the average into a resume checkpoint `directory` (rank 0; the other ranks hold the same)."""
        if distributed.is_main():
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in self.weights.items()}, str(Path(directory) / self.FILE))

    def load(self, directory: Path) -> None:
        """Continue the average a resume checkpoint `directory` holds."""
        from safetensors.torch import load_file

        self.weights = load_file(str(Path(directory) / self.FILE))

    @contextlib.contextmanager
    def swapped_in(self, engine: TrainEngine) -> Iterator[torch.nn.Module]:
        """The engine's module with the average in place of its weights (in their dtype), gathered under
        ZeRO-3; the trained weights are put back on exit."""
        with engine.gathered():
            params = dict(engine.module.named_parameters())
            trained = {n: p.detach().clone() for n, p in params.items()}
            try:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(self.weights[n].to(p.dtype))
                yield engine.module
            finally:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(trained[n])
