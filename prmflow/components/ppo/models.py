"""The models PPO trains: the policy's forward pass over response positions, the critic, their engines."""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple

import torch

from ..common import modeling
from ..common.tensor_ops import (chunked_entropy, chunked_logprobs_entropy, chunked_token_logprobs,
                                 entropy_from_logits, token_logprobs)
from ..common.engine import OptimSettings, TrainEngine
from ...errors import ConfigError
from .batch import MicroBatch
from .config import Config

log = logging.getLogger(__name__)


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
    """Scores a micro-batch's response tokens under the policy: log-probs, optionally entropies.

    With `chunk_rows` > 0 the LM head reads the response positions only, `chunk_rows` at a time, from
    the final hidden states (`tensor_ops.chunked_token_logprobs`; checkpointed, so the backward pass
    too holds one chunk): the (B, R, V) logits and their float32 copies never exist. The head runs in
    a forward hook on the backbone, inside the engine's own forward pass, so it runs under the pass's
    autocast and, with ZeRO-3, DeepSpeed's module hooks gather the head's weights for it, in the
    forward and again for the backward's recomputation: ZeRO-3 puts a forward pre-hook (gather) and
    post-hook (release) on every submodule, not only on the model it wraps (deepspeedai/DeepSpeed 0.19.8 as installed,
    deepspeed/runtime/zero/parameter_offload.py, `_register_deepspeed_module`, L337-357 and L444-448),
    so calling `head(...)` gathers as the model's own call does; calling `head.forward` or its weight
    directly would read an empty partition. The gradients flow back through engine.backward. A model whose head cannot be read that way
    (none found, no `logits_to_keep`, logits that are not the head's output: a soft-cap) is scored
    from its whole logits, with the reason logged once. `chunk_rows` 0: always the whole logits.
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
    """`ResponseScores` with the head read `chunk_rows` rows at a time (see PolicyScorer); (None, why)
    when this model's head cannot be read so."""
    model = engine.module
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the HF model inside
    backbone = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(backbone, torch.nn.Module) or head is None:
        return None, f"{type(lm).__name__} has no backbone at base_model_prefix or no get_output_embeddings()"
    if not accepts_logits_to_keep(lm):
        return None, f"{type(lm).__name__}.forward takes no logits_to_keep"
    B, R = mb.response_ids.shape
    T = mb.input_ids.shape[1]
    rows, cols = mb.mask.nonzero(as_tuple=True)                                   # (N,) each: the real response tokens
    tokens = mb.response_ids[rows, cols]                                          # (N,)
    # the last position, as an index tensor: the model gathers it into a contiguous (B, 1, H) copy, as below
    last = torch.tensor([T - 1], device=mb.input_ids.device)
    seen: dict[str, torch.Tensor] = {}

    def read(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state  # (B, T, H)
        with torch.no_grad():
            seen["last"] = head(hidden[:, last])  # what the model's own head computes there: the check
        h = hidden[rows, T - R - 1 + cols]                                        # (N, H): position P-1+t predicts token t
        if entropy:
            seen["logp"], seen["entropy"] = chunked_logprobs_entropy(head, h, tokens, chunk_rows)
        else:
            seen["logp"] = chunked_token_logprobs(head, h, tokens, chunk_rows)
        if sample is not None:
            with torch.no_grad():
                seen["sampled"] = chunked_entropy(head, hidden.detach()[sample // R, T - R - 1 + sample % R], chunk_rows)

    handle = backbone.register_forward_hook(read)
    try:
        out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                     logits_to_keep=last, **mb.model_kwargs(engine))
    finally:
        handle.remove()
    if "logp" not in seen:
        return None, f"the forward hook on {type(backbone).__name__} never ran"
    if out.logits.shape[1] != 1 or not torch.equal(out.logits.detach(), seen["last"]):
        return None, f"{type(lm).__name__}'s logits are not its LM head applied to its backbone's output"
    scatter = lambda flat: flat.new_zeros(B, R).index_put((rows, cols), flat)  # noqa: E731  (B, R), 0 at padding
    return ResponseScores(scatter(seen["logp"]), scatter(seen["entropy"]) if entropy else None,
                          seen.get("sampled")), ""


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
