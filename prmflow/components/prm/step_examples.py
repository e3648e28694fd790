"""Step-labelled examples: a prompt, its response cut into steps, and one label per step.

The stepwise format (JSONL or Parquet, one row per solution; `prm-label` writes it; Math-Shepherd,
PRM800K and TRL's stepwise rows are mapped onto it by tasks/public.py):

    {"prompt": "...", "steps": ["7+5=12", "12*3=36", "answer: 36"], "labels": [1, 1, 1],
     "answer": "36", "id": "...", "source": "arithmetic"}

`labels` are hard (0/1) or soft (in [0, 1], e.g. the fraction of Math-Shepherd completions that
reach the answer). Instead of `steps` a row may carry a `response` string, cut into steps with the
stage's separator. A step may not be empty or contain the separator (it would be read as two
steps), and there must be one label per step: each violation is a DataError naming file and line.

The built-in arithmetic task makes examples with exact labels: the reference solution (all 1),
`arithmetic.corrupt` solutions (one wrong result, labels 1...1 0...0 from it on, the documented
convention) and a few other slips a policy makes (a wrong operand, a wrong final answer line),
every one labelled by the exact checker `arithmetic.step_labels`.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import config as config_lib
from ..data import io, steps as steps_lib
from ..models import modeling
from ... import tasks
from ...errors import ConfigError, DataError
from ..sampling.generation import generate_texts
from ..sampling.config import SamplingConfig
from ...tasks import arithmetic, memory_agent, public, sources, visual
from ..models.vision import batch_pixels, read_image_list
from ..models.prm_model import encode, has_shared_readout
from .config import Config

log = logging.getLogger(__name__)


@dataclass
class StepExample:
    prompt: str
    steps: list[str]
    labels: list[float]
    answer: str | None = None
    prompt_id: str = ""
    source: str = "dataset"
    where: str = ""
    """file and line (or 'arithmetic') the example came from, for error messages."""
    images: list[bytes] | None = None
    """The prompt's images (a vision-language PRM sees them too), None for text."""

    def response(self, separator: str = "\n") -> str:
        return separator.join(self.steps)


@dataclass
class Tokenized:
    input_ids: list[int]
    step_ends: list[int]
    labels: list[float]
    example: StepExample = field(repr=False)
    pixels: dict = field(default_factory=dict, repr=False)
    response_start: int = 0  # index in input_ids of the response's first token


# --- reading and checking --------------------------------------------------------------------

def check_example(ex: StepExample, separator: str) -> StepExample:
    """Raise a DataError naming `ex.where` unless the example is well formed."""
    w = ex.where or "example"
    if not isinstance(ex.prompt, str) or not ex.prompt.strip():
        raise DataError(f"{w}: no 'prompt' (or it is empty). Each row needs a prompt string.")
    if ex.steps and not isinstance(ex.steps, list):
        raise DataError(f"{w}: 'steps' is a {type(ex.steps).__name__} ({str(ex.steps)[:40]!r}), not a list; give a list of "
                        f"step strings (or a 'response' string with steps separated by {separator!r}).")
    if not isinstance(ex.steps, list) or not ex.steps:
        raise DataError(f"{w}: no steps. Give a non-empty 'steps' list (or a 'response' string with steps "
                        f"separated by {separator!r}).")
    for k, s in enumerate(ex.steps):
        if not isinstance(s, str) or not s.strip():
            raise DataError(f"{w}: step {k} is empty; every step needs text (drop empty steps and their labels).")
        if separator in s:
            raise DataError(f"{w}: step {k} ({s!r}) contains the step separator {separator!r}, so it would be read as "
                            f"several steps. Split it into separate steps, or change step_separator.")
    if not isinstance(ex.labels, list) or len(ex.labels) != len(ex.steps):
        n = len(ex.labels) if isinstance(ex.labels, list) else "no"
        raise DataError(f"{w}: {n} labels for {len(ex.steps)} steps; give exactly one label per step.")
    for k, y in enumerate(ex.labels):
        if isinstance(y, bool):
            y = float(y)
        if not isinstance(y, (int, float)) or not math.isfinite(y) or not 0.0 <= y <= 1.0:
            raise DataError(f"{w}: label {k} is {y!r}; labels must be numbers in [0, 1] (0/1 hard, or a soft fraction).")
    ex.labels = [float(y) for y in ex.labels]
    return ex


def load_stepwise(path: str | Path, separator: str = "\n", n: int | None = None) -> list[StepExample]:
    """Read and check step-labelled data (or a prm-label output directory); fails on the first bad row,
    naming it. Any dataset string tasks/sources.py reads, in the stepwise format or a public one
    (Math-Shepherd, PRM800K, TRL stepwise: tasks/public.py; detected from the columns or ?format=)."""
    spec = sources.parse(str(path))
    local = Path(spec.location)
    if local.is_dir() and (local / io.MANIFEST).is_file():  # a prm-label output, once its manifest says complete
        manifest = io.read_manifest(local)
        if manifest.get("kind") != "prm-labels":  # it said "'DIR/labels.jsonl' does not exist"
            raise DataError(f"'{local}' holds a {manifest.get('kind')!r} hand-off; the prm stage reads step-labelled "
                            f"data: a prm-label output, or a dataset file (docs/data.md).")
        io.verify_files(local, manifest)
        spec.location = str(local / "labels.jsonl")
    given = public.canonical(spec.options["format"], str(spec)) if spec.options.get("format") else None
    fmt, last_file = given, None
    neutral = public.neutral_option(spec.options, str(spec))
    base = Path(spec.location).parent if "://" not in spec.location else Path.cwd()
    out: list[StepExample] = []
    skipped: dict[str, list[str]] = {}  # kind of row -> where each one is
    for where, raw in sources.iter_rows(spec):
        if given is None and sources.file_of(where) != last_file:  # each file of a directory in its own format
            fmt, last_file = public.detect(raw, where), sources.file_of(where)
        if fmt in public.PROMPT_FORMATS:
            raise DataError(f"{where}: a {fmt} dataset has no step labels; the prm stage needs stepwise rows (prompt, "
                            f"steps, labels), Math-Shepherd, PRM800K or prm-label output (or task=arithmetic).")
        try:
            rows = public.step_rows(fmt, raw, where, separator, neutral)
        except public.RowSkipped as e:
            skipped.setdefault(str(e), []).append(where)
            continue
        for row in rows:
            out.append(_stepwise_example(row, where, separator, base))
            if n is not None and len(out) >= n:
                break
        if n is not None and len(out) >= n:
            break
    for kind, wheres in skipped.items():
        log.warning("%s: skipped %d %s (first: %s)", spec, len(wheres), kind, wheres[0])
    if not out:
        raise DataError(f"Step data '{spec}' is empty: it has no rows" + "".join(
            f"; {len(w)} {kind} were skipped (first: {w[0]})" for kind, w in skipped.items()) + ".")
    return out


def _stepwise_example(row: dict, where: str, separator: str, base: Path) -> StepExample:
    step_list = row.get("steps")
    if step_list is None and isinstance(row.get("response"), str):
        step_list = steps_lib.steps(row["response"], separator)
        labels = row.get("labels")
        if step_list and isinstance(labels, list) and len(labels) != len(step_list):
            raise DataError(f"{where}: {len(labels)} labels, but its response cut at the step separator "
                            f"{separator!r} has {len(step_list)} step(s). Separate every step with {separator!r} "
                            f"(or give a 'steps' list), one label per step.")
    return check_example(StepExample(
        prompt=row.get("prompt"), steps=step_list, labels=row.get("labels"),
        answer=None if row.get("answer") is None else str(row["answer"]),
        prompt_id=str(row.get("id") or row.get("prompt_id") or where), source=str(row.get("source") or "dataset"),
        where=where, images=read_image_list(row.get("images"), base, where) or None), separator)


def write_jsonl(examples: list[StepExample], path: Path, extra: list[dict] | None = None) -> None:
    """Write examples in the stepwise format (what load_stepwise reads)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, ex in enumerate(examples):
            row = {"id": ex.prompt_id, "prompt": ex.prompt, "steps": ex.steps, "labels": ex.labels,
                   "answer": ex.answer, "source": ex.source, **(extra[i] if extra else {})}
            f.write(json.dumps(row) + "\n")


# --- the arithmetic task with exact labels ---------------------------------------------------

def _wrong_operand(p: arithmetic.Problem, rng: random.Random) -> str:
    """A step that copies a wrong operand but computes consistently with it."""
    k = rng.randrange(len(p.ops))
    value, out = p.start, []
    for i, (op, b) in enumerate(p.ops):
        if i == k:
            b = b + rng.choice([-2, -1, 1, 2]) if b > 2 else b + rng.choice([1, 2])
        nxt = value + b if op == "+" else value - b if op == "-" else value * b
        out.append(f"{value}{op}{b}={nxt}")
        value = nxt
    return "\n".join(out + [f"{arithmetic.ANSWER_PREFIX}{value}"])


def _wrong_answer_line(p: arithmetic.Problem, rng: random.Random) -> str:
    """Every computation right, the final answer line wrong."""
    return "\n".join(p.steps[:-1] + [f"{arithmetic.ANSWER_PREFIX}{int(p.answer) + rng.choice([-2, -1, 1, 2])}"])


def arithmetic_examples(n: int, seed: int, split: str, cfg: arithmetic.ArithmeticConfig,
                        negatives_per_problem: int = 1) -> list[StepExample]:
    """For each of n problems: the reference solution and `negatives_per_problem` wrong ones
    (mostly `arithmetic.corrupt`), each labelled by the exact checker."""
    rng = random.Random(f"prm:{seed}:{split}")
    out = []
    for p in arithmetic.generate(n, seed=seed, split=split, cfg=cfg):
        responses = [p.solution]
        for _ in range(negatives_per_problem):
            kind = rng.random()
            if kind < 0.6:
                responses.append(arithmetic.corrupt(p, rng)[0])
            elif kind < 0.8:
                responses.append(_wrong_operand(p, rng))
            else:
                responses.append(_wrong_answer_line(p, rng))
        for r in responses:
            out.append(StepExample(p.prompt, arithmetic.split_steps(r), [float(y) for y in arithmetic.step_labels(p.prompt, r)],
                                   p.answer, p.prompt_id, "arithmetic", f"arithmetic:{split}"))
    return out


def visual_examples(n: int, seed: int, split: str, negatives_per_problem: int = 1) -> list[StepExample]:
    """The visual task's counterpart of `arithmetic_examples`: for each of n problems (an image of
    two digits) the reference solution and `negatives_per_problem` `visual.corrupt` ones (a misread
    digit, a wrong result or a wrong answer line), labelled by the exact checker."""
    rng = random.Random(f"prm-visual:{seed}:{split}")
    out = []
    for p in visual.generate(n, seed=seed, split=split):
        for r in [p.solution] + [visual.corrupt(p, rng)[0] for _ in range(negatives_per_problem)]:
            out.append(StepExample(p.prompt, visual.split_steps(r), [float(y) for y in visual.step_labels(p.prompt_id, r)],
                                   p.answer, p.prompt_id, "visual", f"visual:{split}", [p.image]))
    return out


def memory_agent_examples(n: int, seed: int, split: str, task: str, separator: str) -> list[StepExample]:
    """The memory-agent task's episodes, one step per policy turn as rollout writes them, labelled by its
    environment (`memory_agent.step_examples`: the expert's, and one with a flawed turn)."""
    return [StepExample(r["prompt"], r["steps"], r["labels"], r["answer"], r["prompt_id"], r["source"], f"{task}:{split}")
            for r in memory_agent.step_examples(n, seed, split, task=task, separator=separator)]


def _exact_labels(r: tasks.PromptRecord, response: str) -> list[int]:
    if r.source == "visual":
        return visual.step_labels(r.prompt_id, response)
    return arithmetic.step_labels(r.prompt, response)


def from_records(records: list[tasks.PromptRecord], responses: list[str], separator: str = "\n") -> list[StepExample]:
    """Exactly labelled examples for sampled responses to built-in task prompts (e.g. policy samples)."""
    out = []
    for r, resp in zip(records, responses):
        s = steps_lib.steps(resp, separator)
        if not s:
            continue
        out.append(StepExample(r.prompt, s, [float(y) for y in _exact_labels(r, separator.join(s))],
                               r.answer, r.prompt_id, r.source, "policy sample", r.images))
    return out


# --- a run's data ---------------------------------------------------------------------------

def load_data(cfg: Config) -> tuple[list[StepExample], list[StepExample]]:
    """(train, held-out) step-labelled examples: a built-in task's exact labels (plus the sampling policy's
    own solutions), or a stepwise file whose last prompts (at least eval_size rows, every row of each
    prompt: `hold_out_last_prompts`) are held out unless eval_task is set. No prompt is on both sides:
    training rows of a held-out prompt (an eval_task file sharing problems with the task) are dropped."""
    if cfg.task in memory_agent.VARIANTS:
        if cfg.samples_policy:
            raise ConfigError(f"task={cfg.task}: policy samples (policy / policy_from_backbone) are labelled by the "
                              f"arithmetic or visual checker; the memory-agent task's PRM data comes from its environment.")
        train = memory_agent_examples(cfg.num_prompts, cfg.seed, "train", cfg.task, cfg.step_separator)
    elif cfg.task in tasks.TASKS:
        train = (arithmetic_examples(cfg.num_prompts, cfg.seed, "train", cfg.arithmetic, cfg.negatives_per_problem)
                 if cfg.task == "arithmetic" else visual_examples(cfg.num_prompts, cfg.seed, "train", cfg.negatives_per_problem))
        if cfg.samples_policy:
            records = tasks.load(cfg.task, "train", cfg.num_prompts, cfg.seed, **config_lib.to_dict(cfg.arithmetic))
            train += policy_examples(cfg.samples_policy, records, cfg.n_samples, cfg.step_separator,
                                     seed=cfg.seed, chat_template=cfg.chat_template, sampling=cfg.sampling,
                                     batch_size=cfg.batch_sequences)
    else:
        train = load_stepwise(cfg.task, cfg.step_separator)
    if cfg.eval_task and cfg.eval_task not in tasks.TASKS:
        held_out = load_stepwise(cfg.eval_task, cfg.step_separator, n=cfg.eval_size)
    elif cfg.task in memory_agent.VARIANTS and not cfg.eval_task:
        held_out = memory_agent_examples(cfg.eval_size, cfg.seed, "eval", cfg.task, cfg.step_separator)
    elif "visual" in (cfg.task, cfg.eval_task) and cfg.eval_task != "arithmetic":
        held_out = visual_examples(cfg.eval_size, cfg.seed, "eval", cfg.negatives_per_problem)
    elif cfg.task == "arithmetic" or cfg.eval_task == "arithmetic":
        held_out = arithmetic_examples(cfg.eval_size, cfg.seed, "eval", cfg.arithmetic, cfg.negatives_per_problem)
    else:
        if len(train) <= cfg.eval_size:
            raise ConfigError(f"{cfg.task} has {len(train)} rows, not more than eval_size={cfg.eval_size}; "
                              f"lower eval_size or pass eval_task.")
        train, held_out = hold_out_last_prompts(train, cfg.eval_size)
        if not train:
            raise ConfigError(f"{cfg.task}: its last {cfg.eval_size} rows (eval_size) belong to prompts that hold every "
                              f"row of the file, so nothing is left to train on; lower eval_size or pass eval_task.")
    held = {prompt_key(e) for e in held_out}
    kept = [e for e in train if prompt_key(e) not in held]
    if len(kept) < len(train):  # e.g. an eval_task file that shares problems with the task
        log.warning("%d training rows are solutions of held-out prompts and are left out of training, so the held-out "
                    "metrics judge unseen problems", len(train) - len(kept))
    train = kept
    if cfg.task not in tasks.TASKS:
        train = train[:cfg.num_prompts]
    return train, held_out


def prompt_key(ex: StepExample) -> tuple:
    """What makes two rows solutions of one problem: the same prompt text and the same images (tasks.prompt_key,
    which evaluate's held-out check uses too)."""
    return tasks.prompt_key(ex)


def hold_out_last_prompts(rows: list[StepExample], eval_size: int) -> tuple[list[StepExample], list[StepExample]]:
    """(train, held-out) split by whole prompts: the prompts of the last rows, taken from the end of
    the file until they hold at least `eval_size` rows, are held out with every row they have anywhere
    in the file. Public step data has many solutions per problem (Math-Shepherd: dozens), so holding
    out rows, not problems, scores the PRM on problems it trained on."""
    held: set[tuple] = set()
    count: dict[tuple, int] = {}
    for e in rows:
        count[prompt_key(e)] = count.get(prompt_key(e), 0) + 1
    n_held = 0
    for e in reversed(rows):
        if n_held >= eval_size:
            break
        key = prompt_key(e)
        if key not in held:
            held.add(key)
            n_held += count[key]
    return [e for e in rows if prompt_key(e) not in held], [e for e in rows if prompt_key(e) in held]


def epoch_order(groups: list[int], seed: int, epoch: int, by_group: bool = True) -> list[int]:
    """The example order of one epoch, fixed by (seed, epoch) so resume replays it.

    groups[i]: the prompt group of example i. by_group shuffles the prompts and keeps each prompt's
    solutions together, so a batch holds right and wrong solutions of the same problem: their
    gradients differ only where the solutions differ, at the wrong step.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if not by_group:
        return torch.randperm(len(groups), generator=g).tolist()
    members: dict[int, list[int]] = {}
    for i, grp in enumerate(groups):
        members.setdefault(grp, []).append(i)
    keys = list(members)
    return [i for k in torch.randperm(len(keys), generator=g).tolist() for i in members[keys[k]]]


# --- tensors ---------------------------------------------------------------------------------

def tokenize(examples: list[StepExample], tokenizer, separator: str, step_tag: str, max_seq_len: int,
             render=lambda prompt, images=None: prompt) -> tuple[list[Tokenized], int]:
    """Token ids and step readout positions; examples longer than max_seq_len are dropped (counted).
    `render(prompt, images)` gives the prompt text the model reads (with image placeholders)."""
    out, dropped = [], 0
    for ex in examples:
        enc = encode(tokenizer, render(ex.prompt, ex.images), ex.response(separator), separator, step_tag,
                     images=ex.images)
        if has_shared_readout(enc):  # two labels on one token: the loss could not tell them apart
            raise DataError(f"{ex.where}: the tokenizer puts the end of two steps in one token (steps {ex.steps!r}), so "
                            f"they have no separate readout. Set head.step_tag to a string this tokenizer keeps as "
                            f"its own token, so every step ends in one.")
        if len(enc.input_ids) > max_seq_len:
            dropped += 1
            continue
        if len(enc.step_ends) != len(ex.labels):
            raise DataError(f"{ex.where}: {len(ex.labels)} labels but the response has {len(enc.step_ends)} steps "
                            f"when cut by {separator!r}.")
        out.append(Tokenized(enc.input_ids, enc.step_ends, ex.labels, ex, enc.pixels, enc.response_start))
    return out, dropped


def collate(batch: list[Tokenized], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask (B, T); step_mask (B, T) true at readout tokens;
    targets (B, T) float, the step label at readout tokens and 0 elsewhere; response_start (B,) where
    each response begins (the implicit head's sum starts there); plus the batch's pixel inputs
    (vision-language, `vision.batch_pixels`)."""
    T = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    step_mask = torch.zeros((len(batch), T), dtype=torch.bool)
    targets = torch.zeros((len(batch), T), dtype=torch.float32)
    for i, e in enumerate(batch):
        ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, :len(e.input_ids)] = 1
        step_mask[i, e.step_ends] = True
        targets[i, e.step_ends] = torch.tensor(e.labels)
    return {"input_ids": ids, "attention_mask": mask, "step_mask": step_mask, "targets": targets,
            "response_start": torch.tensor([e.response_start for e in batch], dtype=torch.long),
            **batch_pixels([e.pixels for e in batch])}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the PRM's forward takes besides ids and mask: response_start and the pixel inputs."""
    return {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "step_mask", "targets")}


def step_bce(z: torch.Tensor, targets: torch.Tensor, step_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed binary cross-entropy over step positions, and their count.

    z, targets (B, T) float, step_mask (B, T) bool -> (scalar sum, n_steps). Soft targets are the
    same formula: -(y log sigmoid(z) + (1-y) log(1-sigmoid(z))); other positions never enter.
    """
    losses = torch.nn.functional.binary_cross_entropy_with_logits(z[step_mask], targets[step_mask], reduction="sum")
    return losses, int(step_mask.sum())


def policy_examples(policy_path: str, records: list[tasks.PromptRecord], samples: int, separator: str = "\n",
                    seed: int = 0, chat_template: bool = True, sampling: SamplingConfig | None = None,
                    batch_size: int = 256) -> list[StepExample]:
    """The policy's own solutions to built-in task prompts (arithmetic, visual), labelled by the exact checker.

    A PRM is used on the policy's mistakes (best-of-N, RL); training on them, not only on synthetic
    corruptions, matches that distribution (the PRM800K recipe, with the checker as the labeller). The policy
    samples on a GPU in bfloat16 when there is one (`modeling.load_for_sampling`), else on the CPU in float32.
    """
    policy, tok = modeling.load_for_sampling(policy_path)
    rendered = [tasks.render_prompt(tok, r, chat_template) for r in records]
    special = not (chat_template and getattr(tok, "chat_template", None))
    owners = [r for r in records for _ in range(samples)]
    images = [r.images or [] for r in records for _ in range(samples)] if any(r.images for r in records) else None
    sampling = sampling or SamplingConfig()
    texts = generate_texts(policy, tok, [p for p in rendered for _ in range(samples)], sampling.max_new_tokens,
                           batch_size=batch_size, do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k, seed=seed, add_special_tokens=special, images=images,
                           progress="prm: sampling the policy")
    out = from_records(owners, texts, separator)
    for ex in out:
        ex.where = f"sample of {policy_path}"
    return out
