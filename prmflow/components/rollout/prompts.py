"""This iteration's prompts: which rows of the task, and their token ids as SFT tokenized them."""

from __future__ import annotations

import logging
import random

from .. import config as config_lib
from ... import tasks
from ...errors import ConfigError, DataError
from .config import Config

log = logging.getLogger(__name__)


def select_prompts(cfg: Config) -> list[tasks.PromptRecord]:
    """This iteration's prompts (before sharding).

    arithmetic: num_prompts problems drawn with a seed mixed from (seed, iteration).
    dataset file: rows k*num_prompts ... (k+1)*num_prompts - 1 of one seeded shuffle of the file,
    wrapping around, so iterations walk through the data in epochs; num_prompts=0 = all rows.
    """
    if cfg.task in tasks.TASKS:
        return tasks.load(cfg.task, cfg.split, cfg.num_prompts, cfg.seed * 100_003 + cfg.iteration,
                          **config_lib.to_dict(cfg.arithmetic))
    rows = tasks.load(cfg.task)
    if not rows:
        raise DataError(f"Dataset '{cfg.task}' has no prompts.")
    if cfg.num_prompts == 0:
        return rows
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    start = cfg.iteration * cfg.num_prompts
    return [rows[order[(start + j) % len(rows)]] for j in range(cfg.num_prompts)]


def shard_prompts(cfg: Config) -> list[tasks.PromptRecord]:
    """This shard's share of the iteration's prompts: those with index % num_shards == shard."""
    return [r for i, r in enumerate(select_prompts(cfg)) if i % cfg.num_shards == cfg.shard]


def tokenize_prompts(cfg: Config, tokenizer, records: list[tasks.PromptRecord], window: int | None,
                     window_name: str = "the policy's window") -> tuple[list[str], list[list[int]], int]:
    """Rendered prompt texts, their token ids (as SFT tokenized them), and how many were truncated.
    `window` (named `window_name` in errors): positions for prompt + response (`context_window`)."""
    limit = cfg.max_prompt_len
    if window is not None:
        room = window - cfg.sampling.max_new_tokens
        if room < 1:
            raise ConfigError(f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} leaves no room for a prompt in "
                              f"{window_name}; lower sampling.max_new_tokens.")
        if limit == 0:
            limit = room
        elif limit > room:
            raise ConfigError(f"max_prompt_len={limit} + sampling.max_new_tokens={cfg.sampling.max_new_tokens} exceeds "
                              f"{window_name}; lower one of them.")
    texts, ids, truncated = [], [], 0
    for r in records:
        text, p_ids, _ = tasks.encode_prompt(tokenizer, r, cfg.chat_template, cfg.task)
        if not p_ids:
            raise DataError(f"{cfg.task}: prompt_id={r.prompt_id!r} tokenizes to no tokens; remove the row or fix its prompt.")
        if limit and len(p_ids) > limit:
            if cfg.on_long_prompt == "fail" or r.images:
                raise DataError(f"{cfg.task}: prompt_id={r.prompt_id!r} is {len(p_ids)} tokens, longer than {limit} "
                                f"(max_prompt_len, or the window minus sampling.max_new_tokens). Shorten it, raise the limit, "
                                + ("or use smaller images (a prompt with images is never cut: it would split an "
                                   "image's tokens)." if r.images else "or set on_long_prompt=truncate."))
            p_ids = p_ids[-limit:]  # keep the end: the question's last words and the generation prompt
            text = tokenizer.decode(p_ids)
            truncated += 1
        texts.append(text)
        ids.append(list(p_ids))
    if truncated:
        log.warning("%d of %d prompts were longer than %d tokens and keep only their last %d tokens",
                    truncated, len(records), limit, limit)
    return texts, ids, truncated
