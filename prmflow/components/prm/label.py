"""PRM labels without a human or a checker (Math-Shepherd, Wang et al. 2024): label a step by what
the policy can still reach from it.

    prmflow prm-label --policy outputs/sft --output outputs/prm-labels
    prmflow prm --task outputs/prm-labels --output outputs/prm-ms      # train a PRM on them

For each prompt (with a reference answer) the policy samples solutions; from the prefix that ends
each step it draws `completions` continuations. A step's hard label is 1 when any continuation
reaches the reference answer, its soft label the fraction that do. The last step needs no
continuation: its label is whether the solution's own final answer is right. Writes the stepwise
format (`labels.jsonl`: prompt, steps, labels, hard_labels, soft_labels) atomically into `output`.
For the arithmetic task every step also has an exact label (`arithmetic.step_labels`), so the
stage reports how often the estimated labels agree with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..training import checkpoint
from .. import config as config_lib
from ..data import io, steps as steps_lib
from ..models import modeling
from ... import tasks, tracking
from ...errors import ConfigError, DataError
from ..sampling.config import SamplingConfig
from ..sampling.text_sampling import TextSampler, check_sampling
from ..sampling.vllm_engine import VLLMSettings
from ...tasks import arithmetic
from ...tasks.arithmetic import ArithmeticConfig
from .step_examples import StepExample, write_jsonl
from ..scoring.prm_metrics import roc_auc

log = logging.getLogger(__name__)

LABELS_FILE = "labels.jsonl"


@dataclass
class Config:
    policy: str = "outputs/sft"
    """Policy (HF directory) that samples the solutions and the completions."""
    output: str = "outputs/prm-labels"
    """Directory written atomically: labels.jsonl (stepwise format) + manifest.json with the agreement metrics."""
    task: str = "arithmetic"
    """Prompts with reference answers: 'arithmetic' (train split) or a .jsonl/.parquet dataset with an answer column."""
    num_prompts: int = 400
    """Prompts to label."""
    n_samples: int = 4
    """Solutions sampled per prompt; each becomes one labelled row."""
    completions: int = 8
    """Continuations drawn from every step prefix (Math-Shepherd's N); more = less noisy labels, linear cost."""
    label: Literal["hard", "soft"] = "hard"
    """Which estimate goes into the `labels` column that the prm stage trains on (both are written)."""
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64))
    """How solutions and continuations are drawn; max_new_tokens is the budget of a solution and of a continuation."""
    step_separator: str = "\n"
    """Text between steps (the same segmentation as the prm stage and rollout)."""
    batch_sequences: int = 256
    """Sequences per generation batch."""
    sampler: Literal["hf", "vllm"] = "hf"
    """Sampling engine: hf (transformers; a GPU in bfloat16 when there is one, else the CPU in float32) or vllm (a GPU
    with the gpu extra, bfloat16), which batches the many continuations itself."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM engine settings (sampler=vllm only)."""
    chat_template: bool = True
    """Wrap prompts in the policy's chat template when it has one (the tiny tokenizer has none)."""
    seed: int = 0
    """Seed for the prompts and the sampling."""
    overwrite: bool = False
    """Replace an existing output written with a different config."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the built-in arithmetic task."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("num_prompts", "n_samples", "completions", "batch_sequences"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if not self.step_separator:
            raise ConfigError("step_separator is empty; steps need a separator (the default is a newline).")
        check_sampling(self.sampler, self.sampling.temperature, "sampling")


def step_prefixes(response: str, separator: str) -> list[str]:
    """The response text up to (and including the separators after) each step but the last.

    Continuing from prefix k re-generates steps k+1...; the text between steps is kept as written.
    """
    spans = steps_lib.step_spans(response, separator)
    return [response[:nxt[0]] for nxt in spans[1:]]


def estimate_labels(reached: list[list[float]], final_correct: float) -> tuple[list[float], list[float]]:
    """(hard, soft) labels of one solution from its continuations' outcomes.

    reached[k]: 1/0 per continuation from the prefix ending at step k (all steps but the last);
    the last step's label is `final_correct`. hard = any continuation right, soft = the fraction.
    """
    soft = [sum(r) / len(r) for r in reached] + [float(final_correct)]
    hard = [1.0 if s > 0 else 0.0 for s in soft]
    return hard, soft


def agreement(examples: list[StepExample], hard: list[list[float]], soft: list[list[float]], separator: str) -> dict:
    """How well estimated labels match the exact checker (arithmetic prompts only)."""
    exact, est_h, est_s = [], [], []
    for ex, h, s in zip(examples, hard, soft):
        if ex.source != "arithmetic":
            continue
        exact += arithmetic.step_labels(ex.prompt, separator.join(ex.steps))
        est_h += h
        est_s += s
    if not exact:
        return {}
    agree = sum(1 for e, h in zip(exact, est_h) if e == h)
    wrong = [h for e, h in zip(exact, est_h) if e == 0]
    right = [h for e, h in zip(exact, est_h) if e == 1]
    return {
        "label/agreement": agree / len(exact),
        "label/soft_auc": roc_auc(est_s, exact),
        "label/soft_mae": sum(abs(e - s) for e, s in zip(exact, est_s)) / len(exact),
        # Math-Shepherd's known failure: a wrong step from which the policy still reaches the answer
        "label/false_positive_rate": sum(wrong) / len(wrong) if wrong else float("nan"),
        "label/false_negative_rate": (len(right) - sum(right)) / len(right) if right else float("nan"),
        "label/exact_positive_fraction": sum(exact) / len(exact),
    }


def run(cfg: Config) -> dict:
    """Sample, complete, label, write `output/labels.jsonl`. Returns the metrics."""
    done = io.finished_output("prm-label", cfg.output, config_lib.to_dict(cfg), cfg.overwrite)
    if done is not None:
        return done.get("metrics", {})
    if not modeling.is_tiny(cfg.policy):  # a tiny preset's name is built from its config, as the error offers
        modeling.check_model_dir(cfg.policy, "policy")
    records = tasks.load(cfg.task, "train", cfg.num_prompts, cfg.seed, **config_lib.to_dict(cfg.arithmetic))
    for r in records:
        if r.answer is None:
            raise DataError(f"{cfg.task}: prompt {r.prompt_id!r} has no reference answer; prm-label needs one per prompt.")
        if r.images:
            raise DataError(f"{cfg.task}: prompt {r.prompt_id!r} has images; prm-label labels text prompts only so far "
                            f"(its labels file has no images column). For the visual task the PRM stage labels exactly "
                            f"with the checker: prmflow prm --task visual.")
    torch.manual_seed(cfg.seed)
    # hf: a GPU in bfloat16 when there is one, else CPU float32; vllm: an engine on this process's GPU
    sampler = TextSampler(cfg.policy, cfg.sampler, vllm=cfg.vllm, seed=cfg.seed, batch_size=cfg.batch_sequences)
    tok = sampler.tokenizer
    special = not (cfg.chat_template and getattr(tok, "chat_template", None))
    gen = dict(max_new_tokens=cfg.sampling.max_new_tokens, do_sample=True,
               temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
               add_special_tokens=special)
    tracker = tracking.start_stage_run(cfg.tracking, "prm-label", params=config_lib.flat_dict(cfg),
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker, sampler:
        t0 = time.perf_counter()
        # 1. solutions
        rendered = [tasks.render_prompt(tok, r, cfg.chat_template) for r in records]
        owners = [i for i in range(len(records)) for _ in range(cfg.n_samples)]
        solutions = sampler.generate([rendered[i] for i in owners], seed=cfg.seed, **gen,
                                     progress="prm-label: solutions")
        kept = [(i, s) for i, s in zip(owners, solutions) if steps_lib.steps(s, cfg.step_separator)]
        # 2. continuations from every step prefix but the last, all in one batched pass
        jobs = [(j, k, prefix) for j, (i, s) in enumerate(kept) for k, prefix in enumerate(step_prefixes(s, cfg.step_separator))]
        contexts = [rendered[kept[j][0]] + prefix for j, _, prefix in jobs for _ in range(cfg.completions)]
        conts: list[str] = []
        bar = tqdm(total=len(contexts), desc="prm-label", unit="seq", dynamic_ncols=True, mininterval=10.0)
        chunk = cfg.batch_sequences * 8
        for c in range(0, len(contexts), chunk):
            conts += sampler.generate(contexts[c:c + chunk], seed=cfg.seed + 1 + c, **gen)
            bar.update(len(contexts[c:c + chunk]))
        bar.close()
        # 3. labels
        reached: list[list[list[float]]] = [[] for _ in kept]
        for n, (j, k, prefix) in enumerate(jobs):
            rec = records[kept[j][0]]
            outs = conts[n * cfg.completions:(n + 1) * cfg.completions]
            reached[j].append([tasks.verify(rec, prefix + o) for o in outs])
        examples, hard, soft = [], [], []
        for j, (i, s) in enumerate(kept):
            rec = records[i]
            h, so = estimate_labels(reached[j], tasks.verify(rec, s))
            examples.append(StepExample(rec.prompt, steps_lib.steps(s, cfg.step_separator), h if cfg.label == "hard" else so,
                                        rec.answer, rec.prompt_id, rec.source, "prm-label"))
            hard.append(h)
            soft.append(so)
        if not examples:
            raise DataError(f"The policy '{cfg.policy}' produced no solution with a step; nothing to label. "
                            f"Check sampling.max_new_tokens and the policy.")
        elapsed = time.perf_counter() - t0
        metrics = {
            "label/solutions": float(len(examples)),
            "label/steps": float(sum(len(e.steps) for e in examples)),
            "label/sample_accuracy": sum(tasks.verify(records[i], s) for i, s in kept) / max(len(kept), 1),
            "label/positive_fraction": sum(map(sum, hard)) / max(sum(map(len, hard)), 1),
            "perf/sequences_per_s": (len(solutions) + len(contexts)) / elapsed,
            **agreement(examples, hard, soft, cfg.step_separator),
        }
        tracker.log_metrics(metrics)
        with io.atomic_output_dir(cfg.output, "prm-labels", overwrite=True, manifest={
                "config": checkpoint.identity(config_lib.to_dict(cfg)), "metrics": metrics,
                "rows": len(examples), "parents": [cfg.policy]}) as tmp:
            write_jsonl(examples, tmp / LABELS_FILE, extra=[{"hard_labels": h, "soft_labels": s} for h, s in zip(hard, soft)])
    shown = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in metrics.items() if k.startswith("label/"))
    print(f"prm-label: {shown} -> {cfg.output}")
    return metrics
