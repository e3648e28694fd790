"""The ptx loss (InstructGPT's pretraining mix): its data, supervised examples (prompt masked,
reference response + EOS trained on) drawn per update as a fixed function of the update's index, so a
resumed run replays them; and the policy's summed cross-entropy on them (`PtxScorer`).
"""

from __future__ import annotations

import logging

import torch

from .. import config as config_lib
from ... import tasks
from ..training import supervised_data
from ..models.head_chunks import chunked_head_scores
from .config import Config

log = logging.getLogger(__name__)


def load_ptx(cfg: Config, tokenizer):
    """Tokenized supervised examples for the ptx loss (prompt masked, response + EOS trained on)."""
    akw = config_lib.to_dict(cfg.arithmetic)
    records = tasks.load(cfg.ptx_task, "train", cfg.ptx_num_prompts, cfg.seed, **akw) if cfg.ptx_task in tasks.TASKS \
        else tasks.load(cfg.ptx_task, n=cfg.ptx_num_prompts)
    examples, _ = supervised_data.tokenize(records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.ptx_task)
    return examples


def ptx_batch(cfg: Config, examples, update: int, n_micro: int, pad_id: int):
    """The ptx examples of update `update` (a fixed function of it, so resume replays it), split in n_micro
    micro-batches; returns (micro-batches, response tokens over all of them)."""
    n, per = len(examples), cfg.ptx_batch_size
    picked, orders = [], {}
    for pos in range(update * per, (update + 1) * per):
        epoch, k = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = supervised_data.epoch_order(n, cfg.seed, epoch)
        picked.append(examples[orders[epoch][k]])
    bounds = [round(j * per / n_micro) for j in range(n_micro + 1)]
    micro = [supervised_data.collate(picked[a:b], pad_id) for a, b in zip(bounds, bounds[1:])]
    tokens = sum(int((m["labels"][:, 1:] != supervised_data.IGNORE).sum()) for m in micro)
    return micro, tokens


class PtxScorer:
    """The summed next-token cross-entropy of a ptx micro-batch's trained tokens under the policy.

    With `chunk_rows` > 0 the LM head reads only the positions that predict a trained token (labels not
    IGNORE), `chunk_rows` at a time, inside the engine's own forward pass, as `models.PolicyScorer` does
    for the responses (`head_chunks.chunked_head_scores`): the (B, T, V) logits over the whole
    sequences, prompts included, and their float32 copy never exist; the sum of -log p over those
    tokens is the cross-entropy sum. A model whose head cannot be read so is scored from its whole
    logits (`supervised_data.response_loss`), with the reason logged once; `chunk_rows` 0: always.
    """

    def __init__(self, engine, chunk_rows: int):
        self.engine, self.chunk_rows = engine, chunk_rows
        self.chunked = chunk_rows > 0

    def __call__(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy (scalar, float32, with gradient) of `mb` (a `supervised_data.collate` batch
        on the engine's device)."""
        if self.chunked:
            ce_sum, why = chunked_ce_sum(self.engine, mb, self.chunk_rows)
            if ce_sum is not None:
                return ce_sum
            log.warning("ppo: the policy's LM head cannot be read chunk by chunk (%s); computing the ptx loss from "
                        "the whole (batch, sequence, vocabulary) logits instead", why)
            self.chunked = False
        return whole_ce_sum(self.engine, mb)


def whole_ce_sum(engine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed cross-entropy from the whole (B, T, V) logits: the reference computation."""
    logits = engine(**supervised_data.model_inputs(mb), use_cache=False).logits  # (B, T, V)
    return supervised_data.response_loss(logits, mb["labels"])[0]


def chunked_ce_sum(engine, mb: dict[str, torch.Tensor], chunk_rows: int) -> tuple[torch.Tensor | None, str]:
    """The summed cross-entropy with the head read `chunk_rows` rows at a time; (None, why) when this
    model's head cannot be read so. The trained tokens are the labels that are not IGNORE, which
    `supervised_data.tokenize` copies from the input ids, so input_ids[r, t] is the token scored there."""
    labels = mb["labels"]                                                         # (B, T)
    rows, cols = (labels[:, 1:] != supervised_data.IGNORE).nonzero(as_tuple=True)
    positions = cols + 1                      # labels[r, t] is predicted at t - 1, as response_loss shifts them
    rest = {k: v for k, v in supervised_data.model_inputs(mb).items() if k != "input_ids"}  # mask, pixel inputs
    out, why = chunked_head_scores(engine, engine.module, mb["input_ids"], rows, positions, chunk_rows,
                                   use_cache=False, **rest)
    if out is None:
        return None, why
    return -out.logp.sum(), ""
