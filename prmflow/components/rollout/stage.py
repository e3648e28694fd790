"""Rollout stage: sample responses from the policy, score them, write a rollouts hand-off.

    prmflow rollout --policy outputs/sft --prm outputs/prm --output outputs/rollouts/iter0
    prmflow rollout --policy outputs/ppo/iter3 --ref outputs/sft --critic outputs/critic/iter3 \\
        --iteration 3 --n_samples 8 --sampler vllm --shard 2 --num_shards 8 --output outputs/rollouts/iter3/shard-2
    prmflow rollout --config configs/quickstart-cpu.yaml --set num_prompts=16

Phases, in one process:
1. prompts (prompts.py): the task's rows for this iteration (`select_prompts`), this shard's share
   (index % num_shards == shard), rendered with the chat template and tokenized as SFT did;
   prompts longer than max_prompt_len keep their last tokens (counted and logged) or fail.
2. generate (model_passes.py, with engines.py): HF KV-cache loop or vLLM; behavior_logprobs and
   finish_reason per sample.
3. outcome reward (outcome_rewards.py): the recipe of each row's `source`, a weighted sum of components,
   computed before the model passes so a broken reward fails fast.
4. score (model_passes.py, with response_scores.py): old_logprobs from a fresh full forward of the policy, or,
   with the HF sampler in float32, its own log-probs of the tokens it drew (key old_logprobs), ref_logprobs from
   `ref` when set (KL term), values from `critic` when set, step_ends from the policy's tokens, step_rewards from the
   PRM on the re-tokenized text.
5. write (output.py): DatasetWriter into a temporary sibling, validated, renamed at the end; the
   manifest keeps the config and the metrics, so a re-run with the same config returns at once.

With environment.factory set, every sample is a multi-turn episode instead (agent.py, environment.py,
sampling/episodes.py): the policy and the environment take turns, the environment's rewards are the step and
outcome rewards, and policy_mask tells the policy's tokens from the environment's (docs/agents.md).

With num_shards > 1 each pod writes its own output directory (ITER/shard-0, ITER/shard-1, ...);
the parent reads as one dataset (`schema.open_dataset(ITER)`). Inside one shard, N processes
(`torchrun --nproc-per-node N prmflow rollout ...`, or the keys rank / world_size) split the
generation batches and each writes OUTPUT/rank-<r>; the samples are those of one process. Logprobs are of the
distribution sampled (logits / sampling.temperature), and so are old and ref logprobs; see engines.py.
"""

from __future__ import annotations

import time

import torch

from .. import config as config_lib
from ..models import modeling, vision
from ..data import schema
from ... import tracking
from ...errors import ConfigError, DataError
from . import agent, oracle, model_passes as passes, prompts
from . import outcome_rewards as rewards_lib
from . import response_scores as scoring
from .config import Config
from ..sampling.engines import SamplingParams
from .output import (existing_output, identity, input_digests, output_dir, rollout_metrics, rollouts_table,
                     sample_table)

__all__ = ["Config", "output_dir", "run"]


def run(cfg: Config) -> dict:
    """Sample, score and write this shard's rollouts to `output_dir(cfg)`. Returns the metrics."""
    out = output_dir(cfg)
    for key in ("policy", "prm", "ref", "critic"):  # named now: a typo in --prm failed after every response was sampled
        path = getattr(cfg, key)
        if path and path != oracle.ORACLE and not modeling.is_tiny(path):
            modeling.check_model_dir(path, key)
    inputs = input_digests(cfg)
    done = existing_output(cfg, out, inputs)
    if done is not None:
        return done
    recipes = rewards_lib.build_recipes(cfg.rewards)
    records = prompts.shard_prompts(cfg)
    if not records:
        raise DataError(f"No prompts to sample for shard {cfg.shard} of {cfg.num_shards} (task {cfg.task!r}, "
                        f"num_prompts={cfg.num_prompts}); raise num_prompts or lower num_shards.")
    for source in sorted({r.source for r in records}):
        rewards_lib.recipe_for(recipes, source)  # every source has a recipe, before any model loads
    torch.manual_seed(cfg.seed)
    tokenizer = modeling.load_tokenizer(cfg.policy)
    passes.check_shared_tokenizer(tokenizer, cfg)
    has_images = any(r.images for r in records)
    if cfg.critic and vision.processor_of(tokenizer) is not None:
        raise ConfigError(f"critic is set, but the policy '{cfg.policy}' is a vision-language model; critics are "
                          f"text-only so far. Use a critic-free estimator (grpo, rloo, reinforce_baseline, grpo_process).")
    window, window_name = modeling.context_window(cfg.policy, cfg.vllm.max_model_len if cfg.sampler == "vllm" else 0)
    prompt_texts, prompt_ids, truncated = prompts.tokenize_prompts(cfg, tokenizer, records, window, window_name)
    params = SamplingParams(n=cfg.n_samples, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                            top_k=cfg.sampling.top_k, max_new_tokens=cfg.sampling.max_new_tokens, stop=list(cfg.stop),
                            seed=passes.sampling_seed(cfg))
    rank, world = cfg.ranks()
    rank_tag = {"prmflow.rank": f"{rank}/{world}"} if world > 1 else {}
    tracker = tracking.start_stage_run(cfg.tracking, "rollout", params=config_lib.flat_dict(cfg), iteration=cfg.iteration,
                                       tags={"prmflow.output": str(out.resolve()),
                                             "prmflow.shard": f"{cfg.shard}/{cfg.num_shards}", **rank_tag})
    if cfg.environment.enabled:
        with tracker:
            metrics = _run_episodes(cfg, tokenizer, records, out, inputs, tracker)
        print(f"rollout: {metrics['rollout/samples']} episodes of {metrics['rollout/prompts']} prompts, reward mean "
              f"{metrics['rollout/reward_mean']:.3f}, {metrics['rollout/turns']:.2f} turns, "
              f"{metrics['perf/tokens_per_s']:.0f} tokens/s -> {out}")
        return metrics
    with tracker:
        images = [r.images or [] for r in records] if has_images else None
        completions, policy, timing = passes.generate(cfg, tokenizer, prompt_ids, params, images)
        if world > 1:  # keep this rank's prompts: the ones it sampled (every prompt gets n_samples >= 1)
            mine = [i for i, c in enumerate(completions) if c]
            if not mine:
                raise DataError(f"rank {rank} of {world} has no prompts: {len(records)} prompts make fewer than {world} "
                                f"generation batches of batch_sequences / n_samples prompts; lower world_size or "
                                f"batch_sequences.")
            records, prompt_texts, prompt_ids, completions = ([xs[i] for i in mine] for xs in
                                                              (records, prompt_texts, prompt_ids, completions))
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
        columns = passes.score(cfg, policy, tokenizer, records, rows, p_ids, r_ids, responses, pad)
        del policy
        score_s = time.perf_counter() - t0

        table = rollouts_table(cfg, records, prompt_texts, rows, p_ids, r_ids, responses,
                               [e for _, e in texts_and_ends], scored, columns)
        metrics = rollout_metrics(cfg, records, rows, responses, scored, columns, truncated)
        metrics.update({"perf/tokens_per_s": n_tokens / max(timing["perf/generate_s"], 1e-9), **timing,
                        "perf/reward_s": reward_s, "perf/score_s": score_s})
        commit(cfg, out, table, metrics, inputs, tracker)
    print(f"rollout: {len(rows)} responses to {len(records)} prompts, reward mean {metrics['rollout/reward_mean']:.3f}, "
          f"accuracy {metrics.get('rollout/accuracy', float('nan')):.3f}, {metrics['perf/tokens_per_s']:.0f} tokens/s -> {out}")
    return metrics


def _run_episodes(cfg: Config, tokenizer, records, out, inputs, tracker) -> dict:
    """environment.factory set: sample episodes, score them, write them (agent.py)."""
    rows, policy, timing, texts = agent.sample(cfg, tokenizer, records)
    t0 = time.perf_counter()
    table, metrics = agent.build_table(cfg, tokenizer, records, rows, policy, texts)
    del policy
    n_tokens = sum(sum(ep.policy_mask) for _, _, ep in rows)
    metrics.update({"perf/tokens_per_s": n_tokens / max(timing["perf/generate_s"], 1e-9), **timing,
                    "perf/score_s": time.perf_counter() - t0})
    return commit(cfg, out, table, metrics, inputs, tracker)


def commit(cfg: Config, out, table, metrics: dict, inputs, tracker) -> dict:
    """Write the rollouts (atomically, with their manifest) and log the metrics and a sample of rows."""
    parents = [p for p in (cfg.policy, cfg.prm, cfg.ref, cfg.critic, cfg.task) if p]
    with schema.DatasetWriter(out, "rollouts", config=identity(cfg), parents=parents,
                              overwrite=cfg.overwrite, extra={"metrics": metrics, "inputs": inputs}) as writer:
        writer.write(table)
    tracker.log_metrics(metrics, step=cfg.iteration)
    tracker.log_table(sample_table(cfg, table), artifact_file=f"rollout_samples_iter{cfg.iteration}_shard{cfg.shard}.json")
    return metrics
