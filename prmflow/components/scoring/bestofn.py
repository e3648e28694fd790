"""Best-of-N evaluation: does reranking N sampled solutions by PRM score pick right answers?

For every held-out prompt the policy samples N solutions; each is scored step by step by the PRM
and reduced to one number by an aggregation (min: the weakest step, Math-Shepherd's (Wang et al.
2024); product: P(all steps right) under independence, Lightman et al. 2023's; last: the final step;
mean). The pick is the solution with the highest aggregate. Baselines, on the same samples:
- majority: the most frequent final answer (self-consistency, Wang et al. 2022);
- random: a uniformly random pick, reported as its expectation (the mean correctness of the N);
- pass1: the policy's greedy solution;
- pass_at_n: some sample is right (the ceiling of any reranker).
Ties (equal aggregate, equal vote counts) count as a uniformly random choice among the tied ones,
i.e. their mean correctness, so no ordering accident flatters a method.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, NamedTuple

from .. import config as config_lib
from ..models import modeling
from ..data import steps as steps_lib
from ... import tasks
from ...errors import ConfigError
from ..sampling.config import SamplingConfig
from ..sampling.text_sampling import Sampler, TextSampler, check_sampling
from ..sampling.vllm_engine import VLLMSettings
from ...tasks import arithmetic, grader
from .prm_metrics import roc_auc
from .prm_scoring import PRMScorer

log = logging.getLogger(__name__)


def _product(s: list[float]) -> float:
    return math.prod(s)


#: name -> reduction of a solution's step scores to one number.
AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "min": min,
    "product": _product,
    "last": lambda s: s[-1],
    "mean": lambda s: sum(s) / len(s),
}


@dataclass
class BestOfNConfig:
    policy: str = ""
    """Policy (HF directory) to sample from for best-of-N after training; empty = skip best-of-N."""
    n_samples: int = 8
    """Solutions sampled per prompt (the N of best-of-N)."""
    num_prompts: int = 200
    """Held-out prompts (arithmetic 'test' split, or the first rows of task)."""
    task: str = "arithmetic"
    """Prompts with reference answers: 'arithmetic' or 'visual' (their test split) or a .jsonl/.parquet dataset."""
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64))
    """How the N solutions are drawn (temperature 1.0 = the policy's own distribution); max_new_tokens is the budget of
    every solution, the greedy one included."""
    aggregations: list[str] = field(default_factory=lambda: ["min", "product", "last", "mean"])
    """Reductions of step scores to one score per solution; each gives eval/bon_<name>."""
    batch_sequences: int = 256
    """Sequences (a prompt and one response) per generation batch and per PRM scoring batch."""
    seed: int = 0
    """Sampling seed."""
    device: str = ""
    """Where the policy samples and the PRM scores (cuda, cuda:1, cpu); empty = cuda when available, else cpu."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the policy and the PRM; auto = bfloat16 on a GPU (half the memory of float32) and for vLLM, float32 on
    CPU (exact)."""
    sampler: Sampler = "hf"
    """Sampling engine: hf (transformers, CPU or GPU) or vllm (a GPU with the gpu extra; shut down before the PRM
    loads). In the prm stage training's states still hold the GPU: lower bon.vllm.gpu_memory_utilization, or rerun on
    the finished output."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM engine settings (sampler=vllm only)."""

    def __post_init__(self):
        check_sampling(self.sampler, self.sampling.temperature, "bon.sampling")
        if self.n_samples < 1 or self.num_prompts < 1:
            raise ConfigError(f"bon.n_samples ({self.n_samples}) and bon.num_prompts ({self.num_prompts}) must be at least 1.")
        unknown = [a for a in self.aggregations if a not in AGGREGATIONS]
        if unknown:
            raise ConfigError(f"bon.aggregations has {unknown}; known: {sorted(AGGREGATIONS)}.")


def aggregate(step_scores: list[float], how: str) -> float:
    """One score per solution; a solution without steps scores -inf (never preferred)."""
    return AGGREGATIONS[how](step_scores) if step_scores else -math.inf


def pick_value(keys: list[float], correct: list[float]) -> float:
    """Expected correctness of picking an argmax of `keys`, ties broken uniformly at random."""
    best = max(keys)
    tied = [c for k, c in zip(keys, correct) if k == best]
    return sum(tied) / len(tied)


def majority_value(answers: list[str | None], correct: list[float]) -> float:
    """Expected correctness of majority vote over final answers (None = no answer, no vote)."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winners = [a for a, c in counts.items() if c == top]
    # every sample with the same answer is equally right, so each winner's correctness is any of its samples'
    return sum(next(c for a2, c in zip(answers, correct) if a2 == a) for a in winners) / len(winners)


def extract_answer(record: tasks.PromptRecord, response: str) -> str | None:
    """The final answer a response commits to, as the grader reads it (equal keys = the same answer, for
    the majority vote); None when it commits to none (a format error)."""
    return grader.answer_key(record.source, response)


def score_table(records: list[tasks.PromptRecord], candidates: list[list[str]], scores: list[list[list[float]]],
                greedy: list[str], aggregations: list[str]) -> dict:
    """Every accuracy from already sampled and scored solutions (pure: easy to test).

    candidates[i][j]: solution j of prompt i; scores[i][j]: its step scores; greedy[i]: the greedy
    solution. Returns eval/bon_<agg>, eval/majority, eval/random, eval/pass1, eval/pass_at_n.
    """
    acc = collections.defaultdict(float)
    for rec, cands, sc, g in zip(records, candidates, scores, greedy):
        correct = [tasks.verify(rec, c) for c in cands]
        for how in aggregations:
            acc[f"eval/bon_{how}"] += pick_value([aggregate(s, how) for s in sc], correct)
        acc["eval/majority"] += majority_value([extract_answer(rec, c) for c in cands], correct)
        acc["eval/random"] += sum(correct) / len(correct)
        acc["eval/pass1"] += tasks.verify(rec, g)
        acc["eval/pass_at_n"] += max(correct)
    return {k: v / len(records) for k, v in acc.items()}


def open_sampler(policy_path: str, cfg: BestOfNConfig) -> TextSampler:
    """The policy at `policy_path`, ready to sample with cfg's engine, device and dtype (close it, or use `with`)."""
    return TextSampler(policy_path, cfg.sampler, cfg.device, cfg.dtype, cfg.vllm, seed=cfg.seed,
                       batch_size=cfg.batch_sequences)


def render(tokenizer, records: list[tasks.PromptRecord], chat_template: bool) -> tuple[list[str], bool]:
    """(the prompts as the policy reads them, whether the tokenizer adds its special tokens to them)."""
    prompts = [tasks.render_prompt(tokenizer, r, chat_template) for r in records]
    return prompts, not any(tasks.templated(tokenizer, r, chat_template) for r in records)


class Sampled(NamedTuple):
    candidates: list[list[str]]     # N sampled solutions per prompt
    greedy: list[str]               # one greedy solution per prompt
    prompts: list[str]              # the prompts as the policy read them
    baseline_greedy: list[str] | None  # the baseline policy's greedy solution per prompt (None without one)
    sample_s: float                 # the policy's load, samples and greedy solutions
    baseline_s: float               # the baseline's switch and greedy solutions


def sample(policy_path: str, records: list[tasks.PromptRecord], cfg: BestOfNConfig,
           chat_template: bool = True, baseline: str = "") -> Sampled:
    """N samples and a greedy solution per prompt from `policy_path`, then, with `baseline`, the baseline's greedy
    solutions from the same engine (`TextSampler.switch`: vLLM reads the baseline's weights into the running engine
    when only the weights differ). Everything is freed before this returns (with vLLM: its engine shut down and its
    GPU memory back)."""
    t0 = time.perf_counter()
    with open_sampler(policy_path, cfg) as sampler:
        prompts, special = render(sampler.tokenizer, records, chat_template)
        flat = [p for p in prompts for _ in range(cfg.n_samples)]
        images = prompt_images(records)
        flat_images = [im for im in images for _ in range(cfg.n_samples)] if images else None
        sampled = sampler.generate(flat, cfg.sampling.max_new_tokens, do_sample=True, temperature=cfg.sampling.temperature,
                                   top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, seed=cfg.seed,
                                   add_special_tokens=special, images=flat_images,
                                   progress=f"sampling {cfg.n_samples} per prompt")
        greedy = _greedy(sampler, prompts, special, images, cfg)
        sample_s, t0 = time.perf_counter() - t0, time.perf_counter()
        base = None
        if baseline:
            sampler.switch(baseline)
            base_prompts, base_special = render(sampler.tokenizer, records, chat_template)
            base = _greedy(sampler, base_prompts, base_special, images, cfg)
    return Sampled([sampled[i * cfg.n_samples:(i + 1) * cfg.n_samples] for i in range(len(records))], greedy, prompts,
                   base, sample_s, time.perf_counter() - t0 if baseline else 0.0)


def _greedy(sampler: TextSampler, prompts: list[str], special: bool, images, cfg: BestOfNConfig) -> list[str]:
    return sampler.generate(prompts, cfg.sampling.max_new_tokens, add_special_tokens=special, images=images,
                            progress="greedy")


def prompt_images(records: list[tasks.PromptRecord]) -> list[list[bytes]] | None:
    """Per record its images, or None when no record has any (text prompts)."""
    return [r.images or [] for r in records] if any(r.images for r in records) else None


def load_prompts(cfg: BestOfNConfig, arithmetic_cfg: arithmetic.ArithmeticConfig | None = None,
                 seed: int = 0, key: str = "bon.task") -> list[tasks.PromptRecord]:
    """cfg.task's prompts, each with a reference answer; `key` names cfg.task in an error as the calling stage's
    config spells it (prm: bon.task, evaluate: task)."""
    akw = config_lib.to_dict(arithmetic_cfg or arithmetic.ArithmeticConfig())
    split = "test" if cfg.task in tasks.TASKS else "eval"
    records = tasks.load(cfg.task, split, cfg.num_prompts, seed, **akw)
    missing = [r.prompt_id for r in records if r.answer is None]
    if missing:
        raise ConfigError(f"{key} '{cfg.task}': {len(missing)} prompts have no reference answer (first: "
                          f"{missing[0]!r}); best-of-N needs one per prompt: give every row an answer.")
    return records


def evaluate(prm_path: str, cfg: BestOfNConfig, arithmetic_cfg: arithmetic.ArithmeticConfig | None = None,
             chat_template: bool = True, step_separator: str = "\n", seed: int = 0) -> tuple[dict, dict]:
    """Sample with cfg.policy, rerank by the PRM at prm_path; (metrics, a sample table).

    When the prompts are arithmetic, the sampled steps also have exact labels, and
    eval/bon_step_auc says how well the PRM ranks the policy's own steps.
    """
    records = load_prompts(cfg, arithmetic_cfg, seed)
    sampled = sample(cfg.policy, records, cfg, chat_template)
    candidates, greedy = sampled.candidates, sampled.greedy
    device, dtype = modeling.placement(cfg.device, cfg.dtype)
    scorer = PRMScorer(prm_path, batch_size=cfg.batch_sequences, step_separator=step_separator, device=str(device),
                       dtype=dtype)
    images = prompt_images(records)
    # the prompts as written: the scorer renders them the way its PRM was trained
    flat = scorer.score([r.prompt for r in records for _ in range(cfg.n_samples)], [c for cs in candidates for c in cs],
                        images=[im for im in images for _ in range(cfg.n_samples)] if images else None)
    scores = [flat[i * cfg.n_samples:(i + 1) * cfg.n_samples] for i in range(len(records))]
    metrics = score_table(records, candidates, scores, greedy, cfg.aggregations)
    metrics["perf/prm_tokens_per_s"] = scorer.tokens_per_s
    if all(r.source == "arithmetic" for r in records):
        ys, ss = [], []
        for rec, cands, sc in zip(records, candidates, scores):
            for c, s in zip(cands, sc):
                labels = arithmetic.step_labels(rec.prompt, step_separator.join(steps_lib.steps(c, step_separator)))
                if len(labels) == len(s):
                    ys += labels
                    ss += s
        metrics["eval/bon_step_auc"] = roc_auc(ss, ys)
    table = {"prompt_id": [], "response": [], "step_scores": [], "correct": []}
    for rec, cands, sc in list(zip(records, candidates, scores))[:20]:
        for c, s in zip(cands, sc):
            table["prompt_id"].append(rec.prompt_id)
            table["response"].append(c)
            table["step_scores"].append([round(x, 4) for x in s])
            table["correct"].append(tasks.verify(rec, c))
    return metrics, table

