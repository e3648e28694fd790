"""The ptx loss's data: supervised examples (prompt masked, reference response + EOS trained on),
drawn per update as a fixed function of the update's index, so a resumed run replays them.
"""

from __future__ import annotations

from ..common import config as config_lib
from ... import tasks
from ..common import supervised_data
from .config import Config


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

