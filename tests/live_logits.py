"""A probe for tests that must show a computation never holds whole (B, T, V) logits: the peak rows of
vocabulary-wide tensors alive at once (tests/prm/test_implicit_chunked.py, tests/rollout/test_scoring.py)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveLogits(TorchDispatchMode):
    """Sees every tensor any aten op returns, forward and backward, and keeps the peak of the rows of
    vocabulary-wide tensors alive at once (logits, their float32 copy, the log-softmax, its gradient,
    and whatever autograd keeps of them for the backward pass): elements / vocab, summed over the live
    tensors (a view counts again: an upper bound). (hidden, vocab) matrices are left out: the head's
    weight, seen transposed, and its gradient are the same in any computation (a (B, H, V) copy of
    the head is not). Pick a vocabulary no other dimension of the model equals."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab \
                    and tuple(t.shape) != (self.hidden, self.vocab):
                self.live[id(t)] = t.numel() // self.vocab
                weakref.finalize(t, self.live.pop, id(t), None)
                self.peak = max(self.peak, sum(self.live.values()))
        return out
