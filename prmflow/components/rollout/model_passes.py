"""The model passes of a rollout: sample with the engine, then score what was sampled.

Sampling (engines.py) gives token ids, behavior_logprobs and finish_reason per sample. Scoring
(response_scores.py) recomputes old_logprobs with a fresh full forward of the policy, unless the sampler's
own numbers are that policy's (`old_from_sampler`: the HF sampler in float32), ref_logprobs from `ref` (the KL term),
values from `critic`, and step_rewards from the PRM on the re-tokenized text. One model is on the device at a time.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ..models import modeling, vision
from ... import tasks
from ...errors import ConfigError
from . import oracle, response_scores as scoring
from .config import Config
from ..sampling.engines import Completion, HFEngine, SamplingParams, logprob_temperature
from ..sampling.vllm_engine import VLLMEngine, check_logprobs_mode, rank_gpu_index, stop_ids


def device(cfg: Config) -> torch.device:
    """The configured device; empty = cuda when available (a rank's own GPU: $LOCAL_RANK, or the first
    of the GPUs its vLLM engine was given), else cpu."""
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda", rank_gpu_index()) if torch.cuda.is_available() else torch.device("cpu")


def model_dtype(cfg: Config) -> str:
    """cfg.dtype, with `auto` resolved (`modeling.sampling_dtype`)."""
    return modeling.sampling_dtype(cfg.sampler, cfg.device, cfg.dtype)


def old_from_sampler(cfg: Config) -> bool:
    """cfg.old_logprobs resolved: take old_logprobs from the sampler's own log-probs (no scoring
    forward)? auto: only for the HF sampler in float32, where the sampling forward is the policy's
    own forward at the weights and dtype a fresh pass would use (the KV cache changes only the
    order of float32 sums); vLLM and bf16 numbers are another engine's, so auto scores again."""
    if cfg.old_logprobs != "auto":
        return cfg.old_logprobs == "sampler"
    return cfg.sampler == "hf" and model_dtype(cfg) == "float32"


def local_rank(cfg: Config) -> int | None:
    """This process's index on its node when several processes sample ($LOCAL_RANK from torchrun;
    the rank itself when the keys rank/world_size start them by hand on one node); None for one process."""
    if os.environ.get("LOCAL_RANK"):
        return int(os.environ["LOCAL_RANK"])
    rank, world = cfg.ranks()
    return rank if world > 1 else None


def sampling_seed(cfg: Config) -> int:
    """One seed per (seed, iteration, shard), so shards and iterations draw independent samples."""
    return ((cfg.seed * 1_000_003 + cfg.iteration) * 1_009 + cfg.shard) % (2**63)


def progress(total: int, desc: str, unit: str) -> tqdm:
    """A progress bar that redraws at most every 10 s when stderr is a log file, not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)


def check_shared_tokenizer(policy_tok, cfg: Config) -> None:
    """ref and critic score the policy's token ids, so they must share its tokenizer (checked before sampling)."""
    vocab = policy_tok.get_vocab()
    for what, path in (("ref", cfg.ref), ("critic", cfg.critic)):
        if path and modeling.load_tokenizer(path).get_vocab() != vocab:
            raise ConfigError(f"{what} '{path}' has a different tokenizer from the policy '{cfg.policy}'; the {what} model "
                              f"scores the policy's token ids, so it must share the policy's tokenizer (start it from "
                              f"the same base model).")


def load_scorer_model(path: str, cfg: Config, scalar: bool):
    """The ref (a causal LM) or the critic (scalar=True: a scalar-head model), on the device, in eval mode."""
    model, _ = (modeling.load_scalar_model(path, model_dtype(cfg)) if scalar
                else modeling.load_causal_lm(path, model_dtype(cfg), seed=cfg.seed))
    return model.to(device(cfg)).eval()


def generate(cfg: Config, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, images=None):
    """Sample with the configured engine. Returns (completions per prompt, the HF policy for
    scoring, timings); with vLLM the engine is shut down first, then the HF policy is loaded. On
    several ranks the prompts other ranks sample have no completions here."""
    t0 = time.perf_counter()
    engine, policy = make_engine(cfg, tokenizer)
    load_s = time.perf_counter() - t0
    bar = progress(len(prompt_ids), f"rollout iter {cfg.iteration}: generate", "prompt")
    t0 = time.perf_counter()
    rank, world = cfg.ranks()
    completions = engine.generate(prompt_ids, params, progress=bar.update, images=images, rank=rank, world=world)
    generate_s = time.perf_counter() - t0
    bar.close()
    policy = scoring_policy(cfg, tokenizer, engine, policy)
    return completions, policy, {"perf/load_s": load_s, "perf/generate_s": generate_s}


def make_engine(cfg: Config, tokenizer):
    """(the configured sampling engine, the HF policy it samples with, or None for vLLM)."""
    dtype = model_dtype(cfg)
    if cfg.sampler == "hf":
        policy, _ = modeling.load_causal_lm(cfg.policy, dtype, seed=cfg.seed, tokenizer=tokenizer)
        return HFEngine(policy, tokenizer, cfg.batch_sequences, device(cfg)), policy
    # the engine's GPUs are chosen before anything here asks CUDA a question
    check_logprobs_mode(cfg.sampling.temperature, "sampling")
    return VLLMEngine(cfg.policy, dtype, seed=sampling_seed(cfg), settings=cfg.vllm,
                      stop_ids=stop_ids(cfg.policy, tokenizer), local_rank=local_rank(cfg)), None


def scoring_policy(cfg: Config, tokenizer, engine, policy):
    """The HF policy for the scoring passes, once sampling is over: the HF engine's own model; a vLLM engine is
    shut down first (its GPU memory back) and the policy loaded."""
    if cfg.sampler == "vllm":
        engine.close()  # shut down, and wait for the GPU memory to come back, before the scoring models load
        policy, _ = modeling.load_causal_lm(cfg.policy, model_dtype(cfg), seed=cfg.seed, tokenizer=tokenizer)
        policy.to(device(cfg))
    return policy


def score(cfg: Config, policy, tokenizer, records: list[tasks.PromptRecord], rows: list[tuple[int, int, Completion]],
          p_ids: list[list[int]], r_ids: list[list[int]], responses: list[str], pad: int) -> dict[str, list | None]:
    """The model passes over every sampled response, one model on the device at a time.

    rows: (prompt index into records, sample index, completion) per response; p_ids/r_ids/responses
    are aligned with rows. Returns per-response arrays: old_logprobs, ref_logprobs and values (T_r,)
    over the response tokens, step_rewards (S_r,) per step; None where ref/critic/prm is not set.
    old and ref log-probs are taken at the sampling temperature (`engines.logprob_temperature`), as
    behavior_logprobs are.
    """
    temperature = logprob_temperature(cfg.sampling.temperature)
    bs, total = cfg.score_batch_sequences, len(rows)
    pixels = images = None
    if any(r.images for r in records):  # each prompt's pixel inputs once, shared by its samples
        vis = vision.Vision.of(tokenizer, policy.config)
        per_prompt = [vis.pixels(r.images or [], f"{cfg.task}, prompt_id={r.prompt_id!r}") for r in records]
        pixels = [per_prompt[i] for i, _, _ in rows]
        images = [records[i].images or [] for i, _, _ in rows]
    if old_from_sampler(cfg):  # the sampling forward already gave them (cfg.old_logprobs)
        old = [np.asarray(c.logprobs, np.float32) for _, _, c in rows]
    else:
        bar = progress(total, "rollout: old logprobs", "resp")
        old = scoring.forward_logprobs(policy, p_ids, r_ids, bs, pad, progress=bar.update, pixels=pixels,
                                       temperature=temperature)
        bar.close()
    ref = values = step_rewards = None
    if cfg.ref:
        ref_model = load_scorer_model(cfg.ref, cfg, scalar=False)
        bar = progress(total, "rollout: ref logprobs", "resp")
        ref = scoring.forward_logprobs(ref_model, p_ids, r_ids, bs, pad, progress=bar.update, pixels=pixels,
                                       temperature=temperature)
        bar.close()
        del ref_model
    if cfg.critic:
        critic = load_scorer_model(cfg.critic, cfg, scalar=True)
        bar = progress(total, "rollout: values", "resp")
        values = scoring.forward_values(critic, p_ids, r_ids, bs, pad, progress=bar.update)
        bar.close()
        del critic
    if cfg.prm == oracle.ORACLE:
        step_rewards = oracle.step_rewards([records[i].source for i, _, _ in rows], [records[i].prompt for i, _, _ in rows],
                                           responses, cfg.step_separator)
    elif cfg.prm:
        step_rewards = scoring.prm_step_rewards(cfg.prm, [records[i].prompt for i, _, _ in rows], responses, bs,
                                                str(device(cfg)), cfg.step_separator, images=images,
                                                dtype=model_dtype(cfg))
    return {"old_logprobs": old, "ref_logprobs": ref, "values": values, "step_rewards": step_rewards}
