"""The models PPO trains: the policy's forward pass over response positions, the critic, their engines."""

from __future__ import annotations

import inspect

import torch

from ..common import modeling
from ..common.engine import OptimSettings, TrainEngine
from ...errors import ConfigError
from .batch import MicroBatch
from .config import Config


def disable_dropout(model: torch.nn.Module) -> None:
    """PPO needs ratio = 1 before any update; dropout would make two forwards of the same policy differ."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward can skip the LM head on all but the last positions (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(modeling.unwrap(model).forward).parameters


def response_logits(engine, mb: MicroBatch, keep: bool) -> torch.Tensor:
    """Logits of the positions that predict the response tokens: (B, R, V).

    With `keep` (see accepts_logits_to_keep) the LM head runs on the last R + 1 positions only.
    """
    R = mb.response_ids.shape[1]
    extra = {"logits_to_keep": R + 1} if keep else {}
    out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                 **mb.model_kwargs(engine), **extra)
    return out.logits[:, -(R + 1):-1]


def response_values(engine, mb: MicroBatch) -> torch.Tensor:
    """Critic values at the positions that predict the response tokens: (B, R) float32."""
    R = mb.response_ids.shape[1]
    out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False)
    return out.logits[:, -(R + 1):-1, 0].float()


def load_critic(cfg: Config, policy_vocab: int):
    """The critic: a scalar-head model continued from `critic`, or a new one whose head starts at V = 0."""
    if modeling.is_vision(cfg.policy):
        raise ConfigError(f"train_critic=true, but the policy '{cfg.policy}' is a vision-language model; critics are "
                          f"text-only so far. Use a critic-free estimator (grpo, rloo, reinforce_baseline, grpo_process).")
    fresh = not cfg.critic
    path = cfg.critic or (cfg.policy if cfg.critic_init == "policy" else cfg.prm)
    critic, _ = modeling.load_scalar_model(path, cfg.engine.dtype)
    if fresh:  # a PRM's head scores step correctness, not values: a new critic starts at V = 0
        with torch.no_grad():
            critic.score.weight.zero_()
            if getattr(critic.score, "bias", None) is not None:
                critic.score.bias.zero_()
    if critic.config.vocab_size != policy_vocab:
        raise ConfigError(f"critic '{path}' has a vocabulary of {critic.config.vocab_size} tokens, the policy "
                          f"{policy_vocab}; the critic must share the policy's tokenizer.")
    disable_dropout(critic)
    return critic


def make_engine(model, cfg: Config, lr: float, total: int, offset: int, micro: int) -> TrainEngine:
    """A training engine for `model` (policy or critic): `total` updates over the whole RL run, of which
    `offset` were taken by earlier iterations, `micro` responses per forward/backward."""
    engine = TrainEngine(model, cfg.engine, OptimSettings.of(cfg.optim, max(total, 1), start_step=offset, lr=lr),
                         micro, cfg.minibatch_size // micro)
    engine.train()
    return engine
