"""Evaluate a policy on held-out prompts: greedy pass@1, pass@k, majority vote, PRM best-of-N.

    prmflow evaluate --policy outputs/ppo/policy --prm outputs/prm --output outputs/eval
    prmflow evaluate --policy outputs/sft --n_samples 8 --task data/test.jsonl

Choices: pass@1 is greedy decoding checked by the task's verifier; the k samples (temperature
sampling) give pass@k (any right), majority vote over final answers and, with a PRM, best-of-k
reranking for each aggregation (min, product, last, mean); ties count as a random choice among
the tied. Also the mean response length (tokens) and the share of greedy responses with no final
answer (format errors). Metrics go to the stage's MLflow run and are copied to the pipeline's parent
run, so runs compare side by side; the per-step HTML view is logged as an artifact.
With `environment.factory` set (a tool-using agent, docs/agents.md) every held-out prompt is an episode played
through the environment instead: the metrics are its reward components on greedy episodes (eval/qa_accuracy, ...;
eval/accuracy is `agent_metric`'s), best-of-k picks among k sampled episodes by the PRM's turn scores
(evaluate/agent_metrics.py), and per_step.html shows each turn with its rewards.
Sampling runs on transformers (`sampler: hf`, the GPU when there is one) or on the rollout's vLLM engine
(`sampler: vllm`, a GPU with the gpu extra), one engine per policy, shut down before the PRM loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from .. import config as config_lib
from ..data import io
from ..models import modeling
from ... import tasks, tracking
from ...errors import ConfigError
from ..sampling.config import SamplingConfig
from ...tasks import arithmetic
from ..scoring import bestofn
from ..scoring.prm_scoring import PRMScorer
from ..sampling.text_sampling import check_sampling
from ..sampling.vllm_engine import VLLMSettings
from ..sampling.environment import EnvironmentConfig
from . import agent_metrics, report

log = logging.getLogger(__name__)


@dataclass
class Config:
    policy: str = "outputs/sft"
    """Policy to evaluate (HF directory)."""
    prm: str = ""
    """PRM (HF directory) for best-of-k reranking and the per-step view; empty = no PRM metrics."""
    baseline: str = ""
    """Optional second policy (e.g. the SFT one) whose greedy pass@1 is logged as eval/baseline_accuracy."""
    output: str = "outputs/eval"
    """Directory for metrics.json, samples.jsonl and per_step.html (written atomically)."""
    task: str = "arithmetic"
    """Held-out prompts with answers: 'arithmetic' or 'visual' (their test split; visual needs a vision-language policy)
    or a dataset: its first num_prompts rows, the test split of a datasets directory or hub id without ?split=."""
    train_tasks: list[str] = field(default_factory=list)
    """Datasets the policy trained on (a pipeline fills in sft.task and rollout.task): a prompt of task found in one is
    an error naming both."""
    num_prompts: int = 200
    """Held-out prompts to evaluate on."""
    n_samples: int = 8
    """k: samples per prompt for pass@k, majority vote and best-of-k."""
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64))
    """How the k samples are drawn (temperature, top_p, top_k); max_new_tokens is the budget of every response, the
    greedy one included."""
    aggregations: list[str] = field(default_factory=lambda: ["min", "product", "last", "mean"])
    """PRM score reductions for best-of-k (each gives eval/bon_<name>)."""
    step_separator: str = "\n"
    """Separator between reasoning steps (as the PRM was trained)."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    batch_sequences: int = 256
    """Sequences (a prompt and one response) per generation batch."""
    log_samples: int = 20
    """Responses shown in the per-step HTML view (logged as an MLflow artifact)."""
    seed: int = 0
    """Sampling seed."""
    device: str = ""
    """Where the policy samples and the PRM scores (cuda, cuda:1, cpu); empty = cuda when available, else cpu."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the policy, the baseline and the PRM; auto = bfloat16 on a GPU (half the memory of float32) and for
    vLLM, float32 on CPU (exact)."""
    sampler: Literal["hf", "vllm"] = "hf"
    """Sampling engine for the policy and the baseline: hf (transformers, CPU or GPU) or vllm (a GPU with the gpu
    extra). With vllm the policy's engine also samples a baseline that differs only in its weights (read in), and is
    shut down, its GPU memory waited for, before the PRM loads."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM engine settings (sampler=vllm only)."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes (docs/agents.md): with a factory, each held-out prompt is played through the environment
    (greedy, and n_samples sampled); the metrics are its reward components, best-of-N picks episodes by PRM turn scores."""
    agent_metric: str = "qa_accuracy"
    """With an environment: the component reported as eval/accuracy, the baseline's accuracy and best-of-N's value."""
    iteration: int = -1
    """RL iteration of the evaluated policy (-1: not part of an RL loop)."""
    overwrite: bool = False
    """Replace an existing output directory."""
    arithmetic: arithmetic.ArithmeticConfig = field(default_factory=arithmetic.ArithmeticConfig)
    """Difficulty of the built-in arithmetic task (must match training)."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        if self.num_prompts < 1 or self.n_samples < 1:
            raise ConfigError(f"num_prompts ({self.num_prompts}) and n_samples ({self.n_samples}) must be at least 1.")
        if not self.policy:
            raise ConfigError("policy is empty; point it at the policy directory to evaluate.")
        check_sampling(self.sampler, self.sampling.temperature, "sampling")
        if self.environment.enabled and self.sampler != "hf":
            raise ConfigError(f"sampler={self.sampler} with environment.factory: agent episodes are evaluated on the "
                              f"hf sampler for now; set sampler=hf.")


def run(cfg: Config) -> dict:
    """Evaluate `cfg.policy`; write the results to `cfg.output`; return the eval/* metrics."""
    bon_cfg = bestofn.BestOfNConfig(policy=cfg.policy, n_samples=cfg.n_samples, num_prompts=cfg.num_prompts, task=cfg.task,
                                    sampling=dataclasses.replace(cfg.sampling),
                                    aggregations=cfg.aggregations if cfg.prm else [], batch_sequences=cfg.batch_sequences,
                                    seed=cfg.seed, device=cfg.device, dtype=cfg.dtype, sampler=cfg.sampler,
                                    vllm=dataclasses.replace(cfg.vllm))
    for key in ("policy", "prm", "baseline"):  # a tiny preset's name is built from its config, as the error offers
        if getattr(cfg, key) and not modeling.is_tiny(getattr(cfg, key)):
            modeling.check_model_dir(getattr(cfg, key), key)
    inputs = io.input_fingerprints([cfg.policy, cfg.prm, cfg.baseline, cfg.task if cfg.task not in tasks.TASKS else ""])
    done = io.finished_output("evaluate", cfg.output, config_lib.to_dict(cfg), cfg.overwrite, inputs=inputs)
    if done is not None:
        return done.get("metrics", {})
    records = bestofn.load_prompts(bon_cfg, cfg.arithmetic, cfg.seed, key="task")
    if cfg.task not in tasks.TASKS:  # a built-in task's test split is disjoint from its train split by a hash
        tasks.check_held_out(records, cfg.train_tasks, cfg.task)
        if not cfg.train_tasks:
            log.warning("evaluate: task '%s' is a dataset and train_tasks is empty, so nothing checks that its prompts "
                        "are held out; name the datasets the policy trained on in train_tasks", cfg.task)
    tracker = tracking.start_stage_run(cfg.tracking, "evaluate", params=config_lib.flat_dict(cfg),
                                       iteration=cfg.iteration if cfg.iteration >= 0 else None)
    with tracker:
        if cfg.environment.enabled:
            metrics, rows, page = agent_metrics.evaluate(cfg, records)
        else:
            metrics, rows, page = single_turn(cfg, bon_cfg, records)
        with io.atomic_output_dir(cfg.output, "evaluation", overwrite=cfg.overwrite,
                                  manifest={"config": config_lib.to_dict(cfg), "inputs": inputs, "metrics": metrics}) as tmp:
            (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
            (tmp / "per_step.html").write_text(page)
            with open(tmp / "samples.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        step = max(cfg.iteration, 0)
        tracker.log_metrics(metrics, step=step)
        tracker.log_text(page, "per_step.html")
        tracker.log_parent_metrics({k: v for k, v in metrics.items() if k.startswith("eval/")}, step=step)  # as final/*
    print("evaluate: " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith("eval/")))
    return metrics


def single_turn(cfg: Config, bon_cfg: bestofn.BestOfNConfig, records) -> tuple[dict, list[dict], str]:
    """(metrics, one row per prompt for samples.jsonl, the per-step page) of one response per prompt (module docstring)."""
    # the baseline's greedy solutions come from the policy's engine, before any PRM loads (bestofn.sample)
    sampled = bestofn.sample(cfg.policy, records, bon_cfg, cfg.chat_template, baseline=cfg.baseline)
    candidates, greedy, sample_s = sampled.candidates, sampled.greedy, sampled.sample_s
    t0 = time.perf_counter()
    if cfg.prm:
        device, dtype = modeling.placement(cfg.device, cfg.dtype)
        scorer = PRMScorer(cfg.prm, step_separator=cfg.step_separator, device=str(device), dtype=dtype)
        prompts = [r.prompt for r in records]  # as written: the scorer renders them as its PRM was trained
        images = bestofn.prompt_images(records)
        flat = scorer.score([p for p in prompts for _ in range(cfg.n_samples)], [c for cs in candidates for c in cs],
                            images=[im for im in images for _ in range(cfg.n_samples)] if images else None)
        scores = [flat[i * cfg.n_samples:(i + 1) * cfg.n_samples] for i in range(len(records))]
        greedy_scores = scorer.score(prompts, greedy, images=images)
    else:
        scores = [[[] for _ in cs] for cs in candidates]
        greedy_scores = [None] * len(records)
    score_s = time.perf_counter() - t0
    metrics = bestofn.score_table(records, candidates, scores, greedy, bon_cfg.aggregations)
    metrics["eval/accuracy"] = metrics.pop("eval/pass1")
    metrics[f"eval/pass_at_{cfg.n_samples}"] = metrics.pop("eval/pass_at_n")
    metrics[f"eval/mean_at_{cfg.n_samples}"] = metrics.pop("eval/random")
    tok = modeling.load_tokenizer(cfg.policy)
    lengths = [len(tok(g, add_special_tokens=False)["input_ids"]) for g in greedy]
    metrics["eval/response_length"] = sum(lengths) / len(lengths)
    sampled_tokens = sum(len(ids) for ids in tok([c for cs in candidates for c in cs], add_special_tokens=False)["input_ids"])
    # the policy's load, its k samples and greedy responses (the tokens as the tokenizer reads the decoded text back)
    metrics.update({"perf/sample_s": sample_s, "perf/sample_tokens": float(sampled_tokens + sum(lengths)),
                    "perf/tokens_per_s": (sampled_tokens + sum(lengths)) / max(sample_s, 1e-9)})
    if cfg.prm:
        metrics["perf/score_s"] = score_s
    metrics["eval/format_errors"] = sum(bestofn.extract_answer(r, g) is None for r, g in zip(records, greedy)) / len(records)
    if cfg.baseline:
        metrics["perf/baseline_s"] = sampled.baseline_s
        right = [tasks.verify(r, g) for r, g in zip(records, sampled.baseline_greedy)]
        metrics["eval/baseline_accuracy"] = sum(right) / len(records)
    rows = [{"prompt_id": r.prompt_id, "prompt": r.prompt, "response": g, "correct": tasks.verify(r, g),
             "step_scores": s, "source": r.source} for r, g, s in zip(records, greedy, greedy_scores)]
    page = report.per_step_html(rows[:cfg.log_samples])
    return metrics, rows, page
