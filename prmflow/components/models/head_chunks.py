"""A causal LM's head read at chosen positions only, chunk by chunk, inside the model's own forward pass.

Scoring N tokens of a (B, T) batch the plain way makes (B, T, V) logits and their float32 copies: at
Qwen2.5's 151,936-token vocabulary they dwarf the model. `chunked_head_scores` runs the forward pass
with `logits_to_keep` at the last position only and reads the selected positions' log-probs (and
entropies) from the backbone's hidden states through the head, `chunk_rows` rows at a time
(`tensor_ops.chunked_logprobs_entropy`): the PPO policy (ppo.models.PolicyScorer), the implicit PRM
and the rollout stage's log-probs (prm_model.selected_logprobs) all read their heads this way.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from . import modeling
from .tensor_ops import chunked_entropy, chunked_logprobs_entropy, chunked_token_logprobs, tempered


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward can skip the LM head on all but the last positions (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(modeling.unwrap(model).forward).parameters


class ChunkedScores(NamedTuple):
    """What the head gives about the N selected tokens."""

    logp: torch.Tensor             # (N,) float32: log p(token)
    entropy: torch.Tensor | None   # (N,) float32: entropy of each token's distribution (when asked)
    sampled: torch.Tensor | None   # (k,) float32, no graph: the entropy at the `sample` tokens (when given)


def chunked_head_scores(call, model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor,
                        positions: torch.Tensor, chunk_rows: int, *, entropy: bool = False,
                        sample: tuple[torch.Tensor, torch.Tensor] | None = None, temperature: float = 1.0,
                        **forward_kwargs) -> tuple[ChunkedScores | None, str]:
    """log p(input_ids[r, t] | input_ids[r, :t]) for each (r, t) of (rows, positions), (N,) each, from
    one forward pass of `call` (`model` itself, or a training engine running it) in which the LM head
    reads the hidden states at positions - 1 only, `chunk_rows` at a time; with `entropy` also the
    entropy of each of those distributions (with gradient under autograd); with `sample`, (rows,
    positions) of tokens whose distributions' entropy is wanted as a metric only (no graph). Every
    distribution is softmax(logits / `temperature`) (`tensor_ops.tempered`).
    `forward_kwargs`: the rest of the call (attention_mask, position_ids, pixel inputs, ...).

    Slow equivalent: log_softmax(model(input_ids).logits[:, :-1] / temperature) gathered at input_ids[:, 1:],
    entry (r, t - 1). Returns (scores, "") or (None, why) when `model`'s head cannot be read so.

    `model` may be a peft wrapper (the HF model inside is read). The head runs in a forward hook on the
    backbone, inside `call`'s own pass, so it runs under the pass's autocast and, with ZeRO-3,
    DeepSpeed's module hooks gather the head's weights for it, in the forward and again for the
    backward's recomputation: ZeRO-3 puts a forward pre-hook (gather) and post-hook (release) on every
    submodule, not only on the model it wraps (deepspeedai/DeepSpeed 0.19.8 as installed,
    deepspeed/runtime/zero/parameter_offload.py, `_register_deepspeed_module`, L337-357 and L444-448),
    so calling `head(...)` gathers as the model's own call does; calling `head.forward` or its weight
    directly would read an empty partition.

    Checked on every call: the model's own logits at the last position, which logits_to_keep keeps,
    must equal the head applied to the hidden state the hook saw there; they differ under a logit
    soft-cap or scale (Gemma 2, Cohere) or in an architecture that ignores logits_to_keep.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the HF model inside
    backbone = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(backbone, torch.nn.Module) or head is None:
        return None, f"{type(lm).__name__} has no backbone at base_model_prefix or no get_output_embeddings()"
    if not accepts_logits_to_keep(lm):
        return None, f"{type(lm).__name__}.forward takes no logits_to_keep"
    tokens = input_ids[rows, positions]                                           # (N,)
    # the last position, as an index tensor: the model gathers it into a contiguous (B, 1, H) copy. (An int
    # keeps a strided slice, and matmul of a strided (B, 1, H) by the (H, V) head copies the head B times.)
    last = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
    seen: dict[str, torch.Tensor] = {}
    scores = tempered(head, temperature)  # what the scores read; the check below reads the head itself

    def read(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state  # (B, T, H)
        with torch.no_grad():
            seen["last"] = head(hidden[:, last])  # what the model's own head computes there: the check
        h = hidden[rows, positions - 1]                                           # (N, H): position t - 1 predicts token t
        if entropy:
            seen["logp"], seen["entropy"] = chunked_logprobs_entropy(scores, h, tokens, chunk_rows)
        else:
            seen["logp"] = chunked_token_logprobs(scores, h, tokens, chunk_rows)
        if sample is not None:
            with torch.no_grad():
                seen["sampled"] = chunked_entropy(scores, hidden.detach()[sample[0], sample[1] - 1], chunk_rows)

    handle = backbone.register_forward_hook(read)
    try:
        out = call(input_ids=input_ids, logits_to_keep=last, **forward_kwargs)
    finally:
        handle.remove()
    if "logp" not in seen:
        return None, f"the forward hook on {type(backbone).__name__} never ran"
    if out.logits.shape[1] != 1 or not torch.equal(out.logits.detach(), seen["last"]):
        return None, f"{type(lm).__name__}'s logits are not its LM head applied to its backbone's output"
    return ChunkedScores(seen["logp"], seen.get("entropy"), seen.get("sampled")), ""
