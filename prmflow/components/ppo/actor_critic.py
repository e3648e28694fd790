"""The models PPO trains: the policy's forward pass over response positions, the critic, their engines."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..models import modeling
from ..models.head_chunks import accepts_logits_to_keep, chunked_head_scores
from ..models.tensor_ops import entropy_from_logits, token_logprobs
from ..training.engine import OptimSettings, TrainEngine
from ...errors import ConfigError
from .minibatches import MicroBatch
from .config import Config

log = logging.getLogger(__name__)


def disable_dropout(model: torch.nn.Module) -> None:
    """PPO needs ratio = 1 before any update; dropout would make two forwards of the same policy differ."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def response_logits(engine, mb: MicroBatch, keep: bool) -> torch.Tensor:
    """Logits of the positions that predict the response tokens: (B, R, V).

    With `keep` (see accepts_logits_to_keep) the LM head runs on the last R + 1 positions only.
    """
    R = mb.response_ids.shape[1]
    extra = {"logits_to_keep": R + 1} if keep else {}
    out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                 **mb.model_kwargs(engine), **extra)
    return out.logits[:, -(R + 1):-1]


class ResponseScores(NamedTuple):
    """What the policy's head gives about a micro-batch's response tokens."""

    logp: torch.Tensor             # (B, R) float32: log p(response token), 0 at padding
    entropy: torch.Tensor | None   # (B, R) float32: entropy of each token's distribution, 0 at padding (when asked)
    sampled: torch.Tensor | None   # (k,) float32, no graph: the entropy at the `sample` positions (when given)


def entropy_sample(mask: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, int]:
    """The positions `train/entropy` is estimated from: at most `max_tokens` (0 = all) of the masked
    tokens of (B, R) `mask`, evenly spaced in order, as flat indices into B * R; and the masked count."""
    where = mask.reshape(-1).nonzero().squeeze(-1)                                # (n,) flat token positions
    n = where.numel()
    if 0 < max_tokens < n:
        where = where[torch.linspace(0, n - 1, max_tokens, device=where.device).round().long()]
    return where, n


class PolicyScorer:
    """Scores a micro-batch's response tokens under the policy: log-probs, optionally entropies, of
    softmax(logits / mb.temperature), the distribution the rollout sampled and took its log-probs of
    (TRL and veRL divide the trainer's logits by the rollout temperature alike, the reference model's too:
    trl 1.16.0 trl/trainer/grpo_trainer.py:1068-1077 `add_fused_lm_head(..., temperature=self.temperature)`,
    trl/trainer/utils.py:576-577; verl 0.5.0 verl/workers/actor/dp_actor.py:182 `logits_rmpad.div_(temperature)`,
    :261, with the rollout's temperature for old and ref log-probs: verl/workers/fsdp_workers.py:777, 820).

    With `chunk_rows` > 0 the LM head reads the response positions only, `chunk_rows` at a time, from
    the final hidden states, in a forward hook inside the engine's own forward pass
    (`head_chunks.chunked_head_scores`; checkpointed, so the backward pass too holds one chunk; ZeRO-3
    gathers the head for it): the (B, R, V) logits and their float32 copies never exist. The gradients
    flow back through engine.backward. A model whose head cannot be read that way (none found, no
    `logits_to_keep`, logits that are not the head's output: a soft-cap) is scored from its whole
    logits, with the reason logged once. `chunk_rows` 0: always the whole logits.
    """

    def __init__(self, engine, chunk_rows: int):
        self.engine, self.chunk_rows = engine, chunk_rows
        self.keep = accepts_logits_to_keep(engine.module)
        self.chunked = chunk_rows > 0

    def __call__(self, mb: MicroBatch, entropy: bool = False, sample: torch.Tensor | None = None) -> ResponseScores:
        """Scores of `mb`'s response tokens; `entropy`: with the (B, R) entropies (with gradient under
        autograd); `sample`: flat positions into (B, R) whose entropy is wanted as a metric only."""
        if self.chunked:
            out, why = chunked_scores(self.engine, mb, self.chunk_rows, entropy, sample)
            if out is not None:
                return out
            log.warning("ppo: the policy's LM head cannot be read chunk by chunk (%s); scoring the responses from "
                        "the whole (batch, response, vocabulary) logits instead", why)
            self.chunked = False
        return whole_scores(self.engine, mb, self.keep, entropy, sample)


def whole_scores(engine, mb: MicroBatch, keep: bool, entropy: bool = False,
                 sample: torch.Tensor | None = None) -> ResponseScores:
    """`ResponseScores` from the whole (B, R, V) logits (`response_logits`): the reference computation."""
    logits = response_logits(engine, mb, keep)                                    # (B, R, V)
    if mb.temperature != 1:  # float32 first, then the division, as vLLM's sampler does (tensor_ops.tempered)
        logits = logits.float() / mb.temperature
    zero = torch.zeros((), device=logits.device)
    logp = torch.where(mb.mask, token_logprobs(logits, mb.response_ids), zero)   # (B, R)
    ent = torch.where(mb.mask, entropy_from_logits(logits), zero) if entropy else None
    sampled = None
    if sample is not None:
        R = mb.mask.shape[1]
        with torch.no_grad():  # only the picked rows pass through the softmax
            sampled = entropy_from_logits(logits.detach()[sample // R, sample % R])  # (k,)
    return ResponseScores(logp, ent, sampled)


def chunked_scores(engine, mb: MicroBatch, chunk_rows: int, entropy: bool = False,
                   sample: torch.Tensor | None = None) -> tuple[ResponseScores | None, str]:
    """`ResponseScores` with the head read `chunk_rows` rows at a time (`head_chunks.chunked_head_scores`);
    (None, why) when this model's head cannot be read so."""
    B, R = mb.response_ids.shape
    P = mb.input_ids.shape[1] - R
    rows, cols = mb.mask.nonzero(as_tuple=True)                                   # (N,) each: the real response tokens
    picked = None if sample is None else (sample // R, P + sample % R)            # response token t sits at column P + t
    out, why = chunked_head_scores(engine, engine.module, mb.input_ids, rows, P + cols, chunk_rows, entropy=entropy,
                                   sample=picked, temperature=mb.temperature, attention_mask=mb.attention_mask, use_cache=False,
                                   **mb.model_kwargs(engine))
    if out is None:
        return None, why
    scatter = lambda flat: flat.new_zeros(B, R).index_put((rows, cols), flat)  # noqa: E731  (B, R), 0 at padding
    return ResponseScores(scatter(out.logp), scatter(out.entropy) if entropy else None, out.sampled), ""


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
