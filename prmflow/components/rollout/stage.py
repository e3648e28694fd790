"""Rollout stage: sample responses from the policy, score them, write a rollouts hand-off.

    prmflow rollout --policy outputs/sft --prm outputs/prm --output outputs/rollouts/iter0
    prmflow rollout --policy outputs/ppo/iter3 --ref outputs/sft --critic outputs/critic/iter3 \\
        --iteration 3 --n_samples 8 --engine vllm --shard 2 --num_shards 8 --output outputs/rollouts/iter3/shard-2
    prmflow rollout --config configs/quickstart-cpu.yaml --set num_prompts=16

Phases, in one process:
1. prompts: the task's rows for this iteration (`_select_prompts`), this shard's share
   (index % num_shards == shard), rendered with the chat template and tokenized as SFT did;
   prompts longer than max_prompt_len keep their last tokens (counted and logged) or fail.
2. generate (engines.py): HF KV-cache loop or vLLM; behavior_logprobs and finish_reason per sample.
3. outcome reward (rewards.py): the recipe of each row's `source`, a weighted sum of components,
   computed before the model passes so a broken reward fails fast.
4. score (scoring.py): old_logprobs from a fresh full forward of the policy (never copied from
   behavior_logprobs), ref_logprobs from `ref` when set (KL term), values from `critic` when set,
   step_ends from the policy's tokens, step_rewards from the PRM on the re-tokenized text.
5. write: DatasetWriter into a temporary sibling, validated, renamed at the end; the manifest keeps
   the config and the metrics, so a re-run with the same config returns at once.

With num_shards > 1 each pod writes its own output directory (ITER/shard-0, ITER/shard-1, ...);
the parent reads as one dataset (`schema.open_dataset(ITER)`). Logprobs are of the model's raw
distribution (temperature 1, no top-k/top-p), see engines.py.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from ..common import checkpoint, config as config_lib, io, modeling, schema, tasks, tracking, vision
from ..common.errors import ConfigError, DataError, ModelLoadError, OutputExistsError
from ..common.tasks.arithmetic import ArithmeticConfig
from . import rewards as rewards_lib
from . import scoring
from .engines import HFEngine, SamplingParams, VLLMEngine, VLLMSettings

log = logging.getLogger(__name__)


@dataclass
class Config:
    policy: str = "tiny-llama"
    """Policy to sample from: HF model directory (the sft or ppo output) or a tiny preset."""
    output: str = "outputs/rollouts"
    """Rollouts directory to create; with num_shards > 1 this shard's own directory (e.g. ITER/shard-3)."""
    prm: str = ""
    """PRM directory for step_rewards (its own tokenizer re-reads the text). Empty: no step_rewards."""
    ref: str = ""
    """Reference model for ref_logprobs (the KL term), sharing the policy's tokenizer. Empty: no ref_logprobs."""
    critic: str = ""
    """Critic (scalar-head model) for per-token values, needed by GAE. Empty: no values."""
    task: str = "arithmetic"
    """Prompts: 'arithmetic' or 'visual' (built-in tasks; visual needs a vision-language policy) or a .jsonl/.parquet dataset (prompt/messages, answer, source, images)."""
    split: str = "train"
    """Split of the arithmetic task (a dataset file is one split)."""
    num_prompts: int = 64
    """Prompts per iteration over all shards; 0 = every row of a dataset file."""
    n_samples: int = 4
    """Responses sampled per prompt (a group, for GRPO/RLOO baselines)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy (then n_samples > 1 repeats the same response)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off)."""
    max_new_tokens: int = 64
    """Most tokens per response (EOS included); longer responses end with finish_reason 'length'."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends once its text contains one (kept in the response)."""
    seed: int = 0
    """Seed of prompt selection and sampling; with iteration and shard it fixes every sample."""
    iteration: int = 0
    """RL iteration k (the policy version): written to every row; picks this iteration's prompts."""
    batch_size: int = 64
    """Sequences (prompts x samples) per generation batch of the HF engine."""
    score_batch_size: int = 32
    """Sequences per forward pass when scoring (old/ref logprobs, values, PRM)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Sampling engine: hf (CPU or GPU, transformers) or vllm (GPU node pools, the gpu extra)."""
    device: str = ""
    """Torch device for the HF engine and the scoring models; empty = cuda when available, else cpu."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Model dtype for sampling and scoring; bfloat16 halves GPU memory, float32 is exact on CPU."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (as SFT did)."""
    max_prompt_len: int = 0
    """Longest prompt in tokens; 0 = the model's window minus max_new_tokens."""
    on_long_prompt: Literal["truncate", "fail"] = "truncate"
    """A longer prompt keeps its last max_prompt_len tokens (counted, logged) or fails the stage."""
    step_separator: str = "\n"
    """Text between reasoning steps (step_ends and the PRM's steps); the shared default is a newline."""
    rewards: list = field(default_factory=lambda: [dict(e) for e in rewards_lib.DEFAULT_RECIPES])
    """Outcome reward table: entries {source, component, weight, name, ...params}; a row's recipe is its source's entries (else source 'default'). YAML text on the command line."""
    shard: int = 0
    """This pod's shard: it samples the prompts with index % num_shards == shard."""
    num_shards: int = 1
    """Pods sampling this iteration in parallel, each into its own output; their parent reads as one dataset."""
    log_samples: int = 16
    """Responses (with per-step PRM scores) logged as an MLflow table artifact."""
    overwrite: bool = False
    """Replace an existing output written by a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the built-in arithmetic task."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM engine settings (engine=vllm only)."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("n_samples", "max_new_tokens", "batch_size", "score_batch_size", "num_shards"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        for key in ("num_prompts", "max_prompt_len", "top_k", "log_samples", "iteration"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be 0 or more.")
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"shard is {self.shard} with num_shards={self.num_shards}; use 0 <= shard < num_shards.")
        if self.temperature < 0:
            raise ConfigError(f"temperature is {self.temperature}; use 0 (greedy) or a positive value.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p is {self.top_p}; it must be in (0, 1].")
        if self.task in tasks.TASKS and self.num_prompts == 0:
            raise ConfigError(f"num_prompts=0 (every row) needs a dataset file; the {self.task} task needs a count.")
        if not self.step_separator:
            raise ConfigError("step_separator is empty; steps need a separator (the shared default is a newline).")
        if self.engine == "vllm" and modeling.is_tiny(self.policy):
            raise ConfigError(f"engine=vllm needs a model directory; '{self.policy}' is a tiny preset. "
                              f"Write it with `prmflow make-tiny-model DIR` or use engine=hf.")
        if not self.policy:
            raise ConfigError("policy is empty; point it at the policy's model directory.")
        self.rewards = rewards_lib.parse_table(self.rewards)  # YAML text from the command line -> entries
        # a malformed recipe fails here; user functions are imported when the stage runs (the machine
        # that compiles a pipeline may not have them)
        rewards_lib.build_recipes(self.rewards, import_functions=False)


# --- outputs -------------------------------------------------------------------------------------

def output_dir(cfg: Config) -> Path:
    """Where this invocation writes: `output`, one directory per shard (the pipeline gives every pod
    its own); shards placed under one parent read back as one dataset."""
    return Path(cfg.output)


def _identity(cfg: Config) -> dict:
    return checkpoint.identity(config_lib.to_dict(cfg))


def _inputs(cfg: Config) -> dict[str, str]:
    """{path: digest} of the models and the dataset the rollouts come from: prmflow outputs by their
    manifests' file digests, data files by their bytes (a tiny preset or a plain HF directory has no
    entry). The same config on a newer policy in the same place is a different result."""
    out: dict[str, str] = {}
    for p in (cfg.policy, cfg.prm, cfg.ref, cfg.critic, cfg.task):
        path = Path(p) if p else None
        if path is not None and (path / io.MANIFEST).is_file():
            out.update(io.fingerprint([path]))
        elif path is not None and path.is_file():
            out[str(path)] = io.sha256_file(path)
    return out


def _existing_output(cfg: Config, out: Path, inputs: dict[str, str]) -> dict | None:
    """Metrics of a finished, intact output written by the same config from the same inputs (nothing
    to do), else None; any other existing output is an error unless overwrite."""
    try:
        done = io.completed_output(out, {"config": _identity(cfg), "inputs": inputs}, cfg.overwrite, "rollout")
    except OutputExistsError as e:
        if cfg.num_shards > 1:
            raise OutputExistsError(f"{e} Each shard needs its own output directory (e.g. ITER/shard-3).") from None
        raise
    return None if done is None else done.get("metrics", {})


# --- prompts -------------------------------------------------------------------------------------

def _select_prompts(cfg: Config) -> list[tasks.PromptRecord]:
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


def _model_window(path: str) -> int | None:
    """Positions the model can attend over (max_position_embeddings), None if it does not say."""
    if modeling.is_tiny(path):
        spec = modeling.TINY_PRESETS.get(path) or modeling.TINY_VL_PRESETS[path]["text"]
        return spec.get("max_position_embeddings")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(modeling.check_model_dir(path, "policy"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Cannot read the config of policy '{path}': {e}") from None
    cfg = getattr(cfg, "text_config", None) or cfg
    return getattr(cfg, "max_position_embeddings", None)


def tokenize_prompts(cfg: Config, tokenizer, records: list[tasks.PromptRecord], window: int | None
                     ) -> tuple[list[str], list[list[int]], int]:
    """Rendered prompt texts, their token ids (as SFT tokenized them), and how many were truncated."""
    limit = cfg.max_prompt_len
    if window is not None:
        room = window - cfg.max_new_tokens
        if room < 1:
            raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the policy's "
                              f"{window}-token window; lower max_new_tokens.")
        if limit == 0:
            limit = room
        elif limit > room:
            raise ConfigError(f"max_prompt_len={limit} + max_new_tokens={cfg.max_new_tokens} exceeds the policy's "
                              f"{window}-token window; lower one of them.")
    texts, ids, truncated = [], [], 0
    for r in records:
        text, p_ids, _ = tasks.encode_prompt(tokenizer, r, cfg.chat_template, cfg.task)
        if not p_ids:
            raise DataError(f"{cfg.task}: prompt_id={r.prompt_id!r} tokenizes to no tokens; remove the row or fix its prompt.")
        if limit and len(p_ids) > limit:
            if cfg.on_long_prompt == "fail" or r.images:
                raise DataError(f"{cfg.task}: prompt_id={r.prompt_id!r} is {len(p_ids)} tokens, longer than {limit} "
                                f"(max_prompt_len, or the window minus max_new_tokens). Shorten it, raise the limit, "
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


# --- the stage -----------------------------------------------------------------------------------

def _device(cfg: Config) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _sampling_seed(cfg: Config) -> int:
    """One seed per (seed, iteration, shard), so shards and iterations draw independent samples."""
    return ((cfg.seed * 1_000_003 + cfg.iteration) * 1_009 + cfg.shard) % (2**63)


def _progress(total: int, desc: str, unit: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)


def _check_shared_tokenizer(policy_tok, cfg: Config) -> None:
    """ref and critic score the policy's token ids, so they must share its tokenizer (checked before sampling)."""
    vocab = policy_tok.get_vocab()
    for what, path in (("ref", cfg.ref), ("critic", cfg.critic)):
        if path and modeling.load_tokenizer(path).get_vocab() != vocab:
            raise ConfigError(f"{what} '{path}' has a different tokenizer from the policy '{cfg.policy}'; the {what} model "
                              f"scores the policy's token ids, so it must share the policy's tokenizer (start it from "
                              f"the same base model).")


def _load_scorer_model(path: str, cfg: Config, scalar: bool):
    model, _ = (modeling.load_scalar_model(path, cfg.dtype) if scalar
                else modeling.load_causal_lm(path, cfg.dtype, seed=cfg.seed))
    return model.to(_device(cfg)).eval()


def _generate(cfg: Config, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, images=None):
    """Sample with the configured engine. Returns (completions per prompt, the HF policy for
    scoring, timings); with vLLM the engine is shut down first, then the HF policy is loaded."""
    t0 = time.perf_counter()
    if cfg.engine == "hf":
        policy, _ = modeling.load_causal_lm(cfg.policy, cfg.dtype, seed=cfg.seed)
        engine = HFEngine(policy, tokenizer, cfg.batch_size, _device(cfg))
    else:
        engine = VLLMEngine(cfg.policy, cfg.dtype, seed=_sampling_seed(cfg), settings=cfg.vllm)
    load_s = time.perf_counter() - t0
    bar = _progress(len(prompt_ids), f"rollout iter {cfg.iteration}: generate", "prompt")
    t0 = time.perf_counter()
    completions = engine.generate(prompt_ids, params, progress=bar.update, images=images)
    generate_s = time.perf_counter() - t0
    bar.close()
    if cfg.engine == "vllm":
        engine.close()  # free the GPU for the scoring models
        policy, _ = modeling.load_causal_lm(cfg.policy, cfg.dtype, seed=cfg.seed)
        policy.to(_device(cfg))
    return completions, policy, {"perf/load_s": load_s, "perf/generate_s": generate_s}


def run(cfg: Config) -> dict:
    """Sample, score and write this shard's rollouts to `output_dir(cfg)`. Returns the metrics."""
    out = output_dir(cfg)
    inputs = _inputs(cfg)
    done = _existing_output(cfg, out, inputs)
    if done is not None:
        print(f"rollout: '{out}' is already complete for this config and these inputs; nothing to do.")
        return done
    recipes = rewards_lib.build_recipes(cfg.rewards)
    records = [r for i, r in enumerate(_select_prompts(cfg)) if i % cfg.num_shards == cfg.shard]
    if not records:
        raise DataError(f"No prompts to sample for shard {cfg.shard} of {cfg.num_shards} (task {cfg.task!r}, "
                        f"num_prompts={cfg.num_prompts}); raise num_prompts or lower num_shards.")
    for source in sorted({r.source for r in records}):
        rewards_lib.recipe_for(recipes, source)  # every source has a recipe, before any model loads
    torch.manual_seed(cfg.seed)
    tokenizer = modeling.load_tokenizer(cfg.policy)
    _check_shared_tokenizer(tokenizer, cfg)
    has_images = any(r.images for r in records)
    if cfg.critic and vision.processor_of(tokenizer) is not None:
        raise ConfigError(f"critic is set, but the policy '{cfg.policy}' is a vision-language model; critics are "
                          f"text-only so far. Use a critic-free estimator (grpo, rloo, reinforce_baseline, grpo_process).")
    prompt_texts, prompt_ids, truncated = tokenize_prompts(cfg, tokenizer, records, _model_window(cfg.policy))
    params = SamplingParams(n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop), seed=_sampling_seed(cfg))
    tracker = tracking.start_stage_run(cfg.tracking, "rollout", params=config_lib.flat_dict(cfg), iteration=cfg.iteration,
                                       tags={"prmflow.output": str(out.resolve()), "prmflow.shard": f"{cfg.shard}/{cfg.num_shards}"})
    with tracker:
        images = [r.images or [] for r in records] if has_images else None
        completions, policy, timing = _generate(cfg, tokenizer, prompt_ids, params, images)
        rows = [(i, j, c) for i, group in enumerate(completions) for j, c in enumerate(group)]
        n_tokens = sum(len(c.token_ids) for _, _, c in rows)

        # outcome rewards (cheap, and a broken recipe should fail before the model passes)
        t0 = time.perf_counter()
        texts_and_ends = [scoring.step_ends(tokenizer, c.token_ids, cfg.step_separator) for _, _, c in rows]
        responses = [t for t, _ in texts_and_ends]
        # reward models and the PRM read the question as the task states it (not the policy's chat template)
        items = [rewards_lib.RewardInput(records[i].prompt_id, j, records[i].prompt, responses[k], records[i].answer,
                                         records[i].source) for k, (i, j, _) in enumerate(rows)]
        scored = rewards_lib.score_items(recipes, items)
        reward_s = time.perf_counter() - t0

        # model passes: old logprobs, ref logprobs, values, PRM step rewards
        t0 = time.perf_counter()
        p_ids = [prompt_ids[i] for i, _, _ in rows]
        r_ids = [c.token_ids for _, _, c in rows]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        columns = _score(cfg, policy, tokenizer, records, rows, p_ids, r_ids, responses, pad)
        del policy
        score_s = time.perf_counter() - t0

        table = _table(cfg, records, prompt_texts, rows, p_ids, r_ids, responses, [e for _, e in texts_and_ends],
                       scored, columns)
        metrics = _metrics(cfg, records, rows, responses, scored, columns, truncated)
        metrics.update({"perf/tokens_per_s": n_tokens / max(timing["perf/generate_s"], 1e-9), **timing,
                        "perf/reward_s": reward_s, "perf/score_s": score_s})
        parents = [p for p in (cfg.policy, cfg.prm, cfg.ref, cfg.critic, cfg.task) if p]
        with schema.DatasetWriter(out, "rollouts", config=_identity(cfg), parents=parents,
                                  overwrite=cfg.overwrite, extra={"metrics": metrics, "inputs": inputs}) as writer:
            writer.write(table)
        tracker.log_metrics(metrics, step=cfg.iteration)
        tracker.log_table(_sample_table(cfg, table), artifact_file=f"rollout_samples_iter{cfg.iteration}_shard{cfg.shard}.json")
    print(f"rollout: {len(rows)} responses to {len(records)} prompts, reward mean {metrics['rollout/reward_mean']:.3f}, "
          f"accuracy {metrics.get('rollout/accuracy', float('nan')):.3f}, {metrics['perf/tokens_per_s']:.0f} tokens/s -> {out}")
    return metrics


def _score(cfg: Config, policy, tokenizer, records, rows, p_ids, r_ids, responses, pad) -> dict[str, list | None]:
    bs, total = cfg.score_batch_size, len(rows)
    pixels = images = None
    if any(r.images for r in records):  # each prompt's pixel inputs once, shared by its samples
        vis = vision.Vision.of(tokenizer, policy.config)
        per_prompt = [vis.pixels(r.images or [], f"{cfg.task}, prompt_id={r.prompt_id!r}") for r in records]
        pixels = [per_prompt[i] for i, _, _ in rows]
        images = [records[i].images or [] for i, _, _ in rows]
    bar = _progress(total, "rollout: old logprobs", "resp")
    old = scoring.forward_logprobs(policy, p_ids, r_ids, bs, pad, progress=bar.update, pixels=pixels)
    bar.close()
    ref = values = step_rewards = None
    if cfg.ref:
        ref_model = _load_scorer_model(cfg.ref, cfg, scalar=False)
        bar = _progress(total, "rollout: ref logprobs", "resp")
        ref = scoring.forward_logprobs(ref_model, p_ids, r_ids, bs, pad, progress=bar.update, pixels=pixels)
        bar.close()
        del ref_model
    if cfg.critic:
        critic = _load_scorer_model(cfg.critic, cfg, scalar=True)
        bar = _progress(total, "rollout: values", "resp")
        values = scoring.forward_values(critic, p_ids, r_ids, bs, pad, progress=bar.update)
        bar.close()
        del critic
    if cfg.prm:
        step_rewards = scoring.prm_step_rewards(cfg.prm, [records[i].prompt for i, _, _ in rows], responses, bs,
                                                str(_device(cfg)), cfg.step_separator, images=images)
    return {"old_logprobs": old, "ref_logprobs": ref, "values": values, "step_rewards": step_rewards}


def _f32_lists(arrays: list | None, n: int) -> pa.Array:
    if arrays is None:
        return pa.nulls(n, pa.list_(pa.float32()))
    return pa.array([np.asarray(a, dtype=np.float32) for a in arrays], type=pa.list_(pa.float32()))


def _table(cfg, records, prompt_texts, rows, p_ids, r_ids, responses, ends, scored, columns) -> pa.Table:
    n = len(rows)
    step_rewards = columns["step_rewards"]
    if step_rewards is not None:
        for k, (e, s) in enumerate(zip(ends, step_rewards)):
            if len(e) != len(s):  # both come from steps.step_spans on the same text
                raise RuntimeError(f"row {k}: {len(e)} step ends but the PRM scored {len(s)} steps")
    i32 = pa.list_(pa.int32())
    return pa.table({
        "prompt_id": pa.array([records[i].prompt_id for i, _, _ in rows], pa.string()),
        "sample_idx": pa.array([j for _, j, _ in rows], pa.int32()),
        "iteration": pa.array([cfg.iteration] * n, pa.int32()),
        "prompt": pa.array([prompt_texts[i] for i, _, _ in rows], pa.string()),
        "response": pa.array(responses, pa.string()),
        "prompt_ids": pa.array(p_ids, i32),
        "response_ids": pa.array(r_ids, i32),
        "images": pa.array([records[i].images for i, _, _ in rows], pa.list_(pa.binary())),
        "finish_reason": pa.array([c.finish_reason for _, _, c in rows], pa.string()),
        "behavior_logprobs": _f32_lists([c.logprobs for _, _, c in rows], n),
        "old_logprobs": _f32_lists(columns["old_logprobs"], n),
        "ref_logprobs": _f32_lists(columns["ref_logprobs"], n),
        "values": _f32_lists(columns["values"], n),
        "step_ends": pa.array(ends, i32),
        "step_rewards": _f32_lists(step_rewards, n),
        "outcome_reward": pa.array(scored.outcome, pa.float32()),
        "reward_components": pa.array([list(c.items()) for c in scored.components], pa.map_(pa.string(), pa.float32())),
        "answer": pa.array([records[i].answer for i, _, _ in rows], pa.string()),
    })


def _metrics(cfg, records, rows, responses, scored, columns, truncated) -> dict:
    reward = np.asarray(scored.outcome, dtype=np.float64)
    lengths = np.asarray([len(c.token_ids) for _, _, c in rows], dtype=np.float64)
    m = {"rollout/reward_mean": float(reward.mean()), "rollout/reward_std": float(reward.std()),
         "rollout/response_length": float(lengths.mean()), "rollout/prompts": len(records), "rollout/samples": len(rows),
         "rollout/finish_length_frac": float(np.mean([c.finish_reason == "length" for _, _, c in rows])),
         "rollout/truncated_prompts": truncated}
    correct = []
    for k, (i, _, _) in enumerate(rows):
        if scored.correct[k] is not None:
            correct.append(scored.correct[k])
        elif records[i].answer is not None:
            correct.append(tasks.verify(records[i], responses[k]))
    if correct:
        m["rollout/accuracy"] = float(np.mean(correct))
    names = sorted({name for c in scored.components for name in c})
    for name in names:
        m[f"rollout/reward/{name}"] = float(np.mean([c[name] for c in scored.components if name in c]))
    if columns["step_rewards"] is not None:
        flat = [s for row in columns["step_rewards"] for s in row]
        m["rollout/step_reward_mean"] = float(np.mean(flat)) if flat else math.nan
        m["rollout/steps_per_response"] = len(flat) / len(rows)
    old = np.concatenate(columns["old_logprobs"])
    behavior = np.concatenate([np.asarray(c.logprobs, np.float32) for _, _, c in rows])
    m["rollout/logprob_gap"] = float(np.abs(old - behavior).mean())  # sampler vs trainer numerics
    m["rollout/neg_logprob_mean"] = float(-old.mean())  # a sampled estimate of the policy entropy
    if columns["ref_logprobs"] is not None:
        m["rollout/kl_k1"] = float((old - np.concatenate(columns["ref_logprobs"])).mean())
    if columns["values"] is not None:
        m["rollout/value_mean"] = float(np.concatenate(columns["values"]).mean())
    return m


def _sample_table(cfg: Config, table: pa.Table) -> dict[str, list]:
    """An evenly spaced sample of responses with the PRM score printed before each step."""
    n = table.num_rows
    take = np.unique(np.linspace(0, n - 1, num=min(cfg.log_samples, n)).astype(int)) if cfg.log_samples else []
    rows = table.take(pa.array(take, pa.int64())).to_pylist() if len(take) else []
    from ..common import steps as steps_lib

    def annotated(r):
        parts = steps_lib.steps(r["response"], cfg.step_separator)
        scores = r["step_rewards"] or [None] * len(parts)
        return "\n".join(f"[{s:.3f}] {p}" if s is not None else p for p, s in zip(parts, scores))

    return {
        "prompt_id": [r["prompt_id"] for r in rows], "sample_idx": [r["sample_idx"] for r in rows],
        "prompt": [r["prompt"] for r in rows], "response": [r["response"] for r in rows],
        "steps_with_prm_scores": [annotated(r) for r in rows],
        "step_rewards": [r["step_rewards"] for r in rows], "outcome_reward": [r["outcome_reward"] for r in rows],
        "reward_components": [dict(r["reward_components"] or []) for r in rows],
        "finish_reason": [r["finish_reason"] for r in rows], "answer": [r["answer"] for r in rows],
    }
