"""Prompt sources: the built-in arithmetic, visual and memory-agent tasks and user datasets (JSONL / Parquet).

`load(task, split, n, seed)` returns PromptRecords whatever the source; `render_prompt` turns a
record into the text the policy sees (the tokenizer's chat template when it has one and the config
asks for it, else the plain prompt; a record with images gets one image placeholder per image,
see models/vision.py); `encode_prompt` gives its token ids and pixel inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass
class PromptRecord:
    prompt_id: str
    prompt: str
    answer: str | None = None
    response: str | None = None
    """Reference solution (SFT target), when known."""
    messages: list | None = None
    """Chat messages the prompt came from, when the dataset is chat-style."""
    source: str = "arithmetic"
    """Which task/reward recipe the row belongs to."""
    images: list[bytes] | None = None
    """Encoded images of a vision-language prompt (checked when read), None for text."""


TASKS = ("arithmetic", "visual", "memory_agent", "memory_agent_qwen")
"""Built-in tasks; anything else names a dataset file."""
EPISODE_SOURCES = ("memory_agent", "memory_agent_qwen")
"""Sources whose rows are episodes for an environment: scored by playing them through it (rollout, evaluate), not by
`verify` on one response."""


def load(task: str, split: str = "train", n: int | None = None, seed: int = 0, memory_agent: dict | None = None,
         **task_kwargs) -> list[PromptRecord]:
    """Records of `task`: 'arithmetic', 'visual' (images of two digits to compute with, for
    vision-language policies), 'memory_agent' or 'memory_agent_qwen' (episodes for its environment, with the
    expert's multi-turn demonstration as `messages`; tool calls as bare JSON or in Qwen2.5's <tool_call> tags) or a
    dataset: a .jsonl / .parquet file, a directory, an object-store
    URL or hub:ID, in the project's format or a public one (GSM8K, MATH; see sources.py, public.py).

    For a dataset, `split` 'eval' or 'test' reads held-out rows: a datasets directory or hub id
    without ?split= gives its `test` split (else `train`); a file has no splits (pass a file per
    split: `check_held_out` refuses prompts a policy trained on). `n` keeps the first n rows.
    `task_kwargs` configure the arithmetic task, `memory_agent` (MemoryAgentConfig keys) the memory agent's episodes
    and demonstrations (the visual task uses its defaults).
    """
    if task == "visual":
        from . import visual

        problems = visual.generate(n if n is not None else 1000, seed=seed, split=split)
        return [PromptRecord(p.prompt_id, p.prompt, p.answer, p.solution, None, "visual", [p.image]) for p in problems]
    if task in ("memory_agent", "memory_agent_qwen"):  # episodes for its environment; task_kwargs are arithmetic's
        from . import memory_agent as agent

        return agent.records(n if n is not None else 1000, seed=seed, split=split, task=task,
                             cfg=agent.MemoryAgentConfig(**(memory_agent or {})))
    if task == "arithmetic":
        from . import arithmetic

        cfg = arithmetic.ArithmeticConfig(**{k: v for k, v in task_kwargs.items() if v is not None})
        problems = arithmetic.generate(n if n is not None else 1000, seed=seed, split=split, cfg=cfg)
        return [PromptRecord(p.prompt_id, p.prompt, p.answer, p.solution, None, "arithmetic") for p in problems]
    from .datasets import load_records

    return load_records(task, n=n, held_out=split in ("eval", "test"))


def prompt_key(record) -> tuple:
    """What makes two rows the same problem: the same prompt text and the same images (a PromptRecord,
    or anything with `prompt` and `images`)."""
    return (record.prompt, tuple(hashlib.sha256(b).hexdigest() for b in record.images or ()))


def check_held_out(records: list[PromptRecord], train_tasks: list[str], task: str, key: str = "task") -> None:
    """Refuse held-out `records` (read from `task`, named `key` in the config) whose prompts are in any
    dataset of `train_tasks` (what the policy trained on): a ConfigError naming both datasets, how many
    prompts they share and the first one. Built-in tasks are skipped (their splits are disjoint by a hash)."""
    from ..errors import ConfigError

    for train_task in train_tasks:
        if not train_task or train_task in TASKS:
            continue
        seen = {prompt_key(r) for r in load(train_task)}
        shared = [r for r in records if prompt_key(r) in seen]
        if shared:
            raise ConfigError(
                f"{key} '{task}': {len(shared)} of its {len(records)} evaluated prompts are also in the training data "
                f"'{train_task}' (train_tasks; first: prompt_id {shared[0].prompt_id!r}), so the scores would not be "
                f"held out. Evaluate on rows the policy never saw: a test file (SFT's eval_task, say), or ?split=test "
                f"of a datasets directory or hub id; or drop '{train_task}' from train_tasks to score training prompts.")


def render_prompt(tokenizer, record: PromptRecord, chat_template: bool = True) -> str:
    """The prompt text the policy sees for `record`."""
    if record.images:
        from ..errors import DataError
        from ..components.models.vision import Vision, processor_of

        processor = processor_of(tokenizer)
        if processor is None:
            raise DataError(f"prompt {record.prompt_id!r} has {len(record.images)} image(s), but the model is text-only. "
                            f"Use a vision-language model directory (with its processor), or drop the images.")
        return Vision(processor).render(record.prompt, len(record.images), chat_template, record.messages)
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    if use_template:
        messages = record.messages or [{"role": "user", "content": record.prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return record.prompt


def templated(tokenizer, record: PromptRecord, chat_template: bool = True) -> bool:
    """Whether `render_prompt` wraps this record in a chat template (which then brings its own
    special tokens; a plain prompt gets the tokenizer's)."""
    if not chat_template:
        return False
    from ..components.models.vision import processor_of

    holder = processor_of(tokenizer) if record.images else tokenizer
    return bool(getattr(holder, "chat_template", None))


def encode_prompt(tokenizer, record: PromptRecord, chat_template: bool = True, where: str = "prompt"):
    """(text, token ids, pixel inputs) of `record` as the policy sees it; pixel inputs are {} for text."""
    text = render_prompt(tokenizer, record, chat_template)
    special = not templated(tokenizer, record, chat_template)
    if not record.images:
        return text, tokenizer(text, add_special_tokens=special)["input_ids"], {}
    from ..components.models.vision import Vision, processor_of

    ids, pixels = Vision(processor_of(tokenizer)).encode_prompt(
        text, record.images, f"{where}, prompt_id={record.prompt_id!r}", add_special_tokens=special)
    return text, ids, pixels


def verify(record: PromptRecord, response: str) -> float:
    """1.0 when `response` reaches the record's reference answer, else 0.0: the one grader
    (grader.py) in the convention of the record's source, the same one the RL reward uses."""
    if record.answer is None:
        raise ValueError(f"prompt {record.prompt_id!r} has no reference answer to verify against")
    if record.source in EPISODE_SOURCES:
        raise ValueError(f"prompt {record.prompt_id!r} is a {record.source} episode: its environment scores it "
                         f"(environment.factory in rollout and evaluate), not one response")
    from .grader import grade

    return grade(record.source, response, record.answer)
