"""SFT examples: prompt tokens masked out of the loss, response tokens (plus the token that ends a
response) trained on; padding never is. A multi-turn demonstration (`messages` with assistant turns and
tool messages between them) trains every assistant turn and none of the tool turns (`episode_tokens`).

With a chat template (Qwen2.5: the prompt is the templated conversation ending in
`<|im_start|>assistant\n`) the response ends with the template's end of turn, `<|im_end|>`; without
one, with the tokenizer's eos (`chat.end_of_turn_id`). Padding (`<|endoftext|>` for Qwen2.5, a
different id) is added only by `collate`, with label IGNORE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..models import chat, vision
from ... import tasks
from ...errors import DataError

log = logging.getLogger(__name__)
IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens
    pixels: dict = field(default_factory=dict, repr=False)
    """Pixel inputs of the prompt's images (vision-language), {} for text."""


def tokenize(records: list[tasks.PromptRecord], tokenizer, max_seq_len: int, chat_template: bool = True,
             where: str = "dataset") -> tuple[list[Example], int]:
    """Examples for every record with a response; returns (examples, number dropped as too long)."""
    examples, dropped = [], 0
    ends = {}  # per templated-or-not: the token that closes a response (chat.end_of_turn_id)
    for r in records:
        if not r.response:
            raise DataError(f"{where}: prompt {r.prompt_id!r} has no response to train on.")
        _, p_ids, pixels = tasks.encode_prompt(tokenizer, r, chat_template, where)
        templated = tasks.templated(tokenizer, r, chat_template)
        if templated not in ends:
            ends[templated] = chat.end_of_turn_id(tokenizer, templated)
        if ends[templated] is None:
            raise DataError(f"{where}: the tokenizer has no eos token and no chat template that ends a turn, so a "
                            f"response cannot be taught to end; use a model directory whose tokenizer sets eos_token.")
        if r.messages and any(m["role"] == "assistant" for m in r.messages) and not r.images:
            ids, labels = episode_tokens(tokenizer, r.messages + [{"role": "assistant", "content": r.response}],
                                         templated, ends[templated], f"{where}, prompt {r.prompt_id!r}")
        else:
            r_ids = tokenizer(r.response, add_special_tokens=False)["input_ids"] + [ends[templated]]
            ids, labels = p_ids + r_ids, [IGNORE] * len(p_ids) + r_ids
        if len(ids) > max_seq_len:  # dropped, never cut: a cut could split an image's tokens
            dropped += 1
            continue
        examples.append(Example(ids, labels, pixels))
    if dropped:
        log.warning("%s: dropped %d of %d examples longer than max_seq_len=%d", where, dropped, len(records), max_seq_len)
    if not examples:
        raise DataError(f"{where}: no example fits max_seq_len={max_seq_len}; raise max_seq_len.")
    return examples, dropped


def episode_tokens(tokenizer, messages: list[dict], templated: bool, end: int, where: str) -> tuple[list[int], list[int]]:
    """A multi-turn demonstration (opening messages, then assistant turns with one tool message between two) as
    (ids, labels): laid out as the rollout lays out an episode (`chat.opening_ids`, each assistant turn's content
    and its end-of-turn token, each tool message as `chat.observation_ids`), so SFT teaches the ids the policy then
    samples; labels are the assistant turns' ids, IGNORE on the opening and the tool turns (assistant-only loss)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if first == 0:
        raise DataError(f"{where}: 'messages' opens with an assistant turn; an episode opens with a user (or system) turn.")
    _, ids = chat.opening_ids(tokenizer, messages[:first], templated)
    ids = list(ids)
    labels = [IGNORE] * len(ids)
    previous = "assistant"
    for k, m in enumerate(messages[first:], start=first):
        if m["role"] == "assistant":
            turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [end]
            ids += turn
            labels += turn
        elif m["role"] == "tool" and previous == "assistant" and k + 1 < len(messages):
            try:
                obs = chat.observation_ids(tokenizer, m["content"], templated)
            except chat.ChatTurnError as e:
                raise DataError(f"{where}: {e}; use a tokenizer whose chat template has a tool role.") from None
            ids += obs
            labels += [IGNORE] * len(obs)
        else:
            raise DataError(f"{where}: message {k} has role {m['role']!r} after a {previous!r} turn; after the opening, a "
                            f"multi-turn demonstration alternates assistant turns and single tool messages, and ends "
                            f"with an assistant turn.")
        previous = m["role"]
    return ids, labels


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, labels, each (B, T); plus the
    batch's pixel inputs (vision-language, `vision.batch_pixels`)."""
    T = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **vision.batch_pixels([e.pixels for e in batch])}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model's forward takes from a collated batch (everything but the labels)."""
    return {k: v for k, v in batch.items() if k != "labels"}


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation fixed by (seed, epoch), so resume replays it."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def response_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over response tokens, and their count.

    logits (B, T, V), labels (B, T) with IGNORE on prompt/padding -> (scalar sum, n_tokens).
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
        ignore_index=IGNORE, reduction="sum")
    return loss, int((shift_labels != IGNORE).sum())
