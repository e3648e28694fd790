"""The rollout of multi-turn episodes (environment.factory set): every sample is an episode.

Per prompt row, n_samples episodes, each with a fresh environment (sampling/environment.py) reset on the row. The
episodes run turn-synchronously on the configured engine (sampling/episodes.py); then the rows are scored as
single-turn rows are (old/ref log-probs and values over every response token, policy and environment: the
trainer reads only the policy's) and written with:
- response_ids: every turn's sampled ids and the environment's ids as appended; policy_mask 1 / 0 over them;
- behavior_logprobs: the sampler's log-probs at policy tokens, 0 at environment tokens;
- step_ends: the last token of each policy turn; step_rewards: each action's weighted components
  (environment.step_reward_weights), or, with `prm` set, the PRM's score of each turn;
- outcome_reward: the weighted episode-level components (environment.outcome_weights); reward_components:
  the outcome components and each per-action component's mean over the episode's actions;
- response: the episode as steps for the PRM and for reading: step k is the observation before turn k (none
  for the first) and turn k's text, separators inside replaced by spaces, steps joined by step_separator, so a
  PRM (rollout scoring, prm-update) reads one step per policy turn, ending where step_ends end.
The outcome reward table (`rewards`) is not used: the environment is the reward.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyarrow as pa

from ... import tasks
from ..data import steps as steps_lib
from ..sampling.engines import Completion, SamplingParams
from ..sampling import environment as env_lib
from ..sampling.environment import episode_text
from ..sampling.episodes import Episode
from ..models import modeling
from . import model_passes as passes
from . import oracle
from . import outcome_rewards as rewards_lib
from .config import Config
from .output import rollouts_table

def sample(cfg: Config, tokenizer, records: list[tasks.PromptRecord]):
    """Run every episode (`environment.play`). Returns (rows (prompt index, sample index, episode), the HF policy
    for scoring, timings, the opening texts per row)."""
    params = SamplingParams(n=1, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                            top_k=cfg.sampling.top_k, max_new_tokens=cfg.sampling.max_new_tokens,
                            stop=list(cfg.stop), seed=passes.sampling_seed(cfg))
    window = modeling.context_window(cfg.policy, cfg.vllm.max_model_len if cfg.sampler == "vllm" else 0)
    t0 = time.perf_counter()
    engine, policy = passes.make_engine(cfg, tokenizer)
    load_s = time.perf_counter() - t0
    bar = passes.progress(len(records) * cfg.n_samples * cfg.environment.max_turns,
                          f"rollout iter {cfg.iteration}: episodes", "turn")
    t0 = time.perf_counter()
    played = env_lib.play(cfg.environment, engine, tokenizer, records, cfg.n_samples, params, cfg.chat_template,
                          window, progress=bar.update, where=f"policy '{cfg.policy}'")
    generate_s = time.perf_counter() - t0
    bar.close()
    policy = passes.scoring_policy(cfg, tokenizer, engine, policy)
    return [(p.prompt, p.sample, p.episode) for p in played], policy, \
        {"perf/load_s": load_s, "perf/generate_s": generate_s}, [p.opening for p in played]


def build_table(cfg: Config, tokenizer, records, rows, policy, texts):
    """Score the episodes (model passes) and lay them out as a rollouts table; returns (table, metrics)."""
    ecfg = cfg.environment
    episodes = [ep for _, _, ep in rows]
    completions = [(i, j, Completion(ep.response_ids, ep.logprobs, ep.finish_reason)) for i, j, ep in rows]
    responses = [episode_text(ep, cfg.step_separator) for ep in episodes]
    for k, ep in enumerate(episodes):  # the PRM's steps and step_ends must be the same turns
        n = len(steps_lib.steps(responses[k], cfg.step_separator))
        if n != len(ep.step_ends):
            raise RuntimeError(f"episode {k}: {n} steps in its text but {len(ep.step_ends)} policy turns")
    step_rewards = [[env_lib.weighted(c, ecfg.step_reward_weights) for c in ep.step_components] for ep in episodes]
    outcome = [env_lib.weighted(ep.outcome, ecfg.outcome_weights) for ep in episodes]
    components = [env_lib.episode_components(ep.step_components, ep.outcome, ecfg) for ep in episodes]
    scored = rewards_lib.Scored(outcome, components, [None] * len(episodes))
    p_ids = [ep.prompt_ids for ep in episodes]
    r_ids = [ep.response_ids for ep in episodes]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trained_prm = cfg.prm not in ("", oracle.ORACLE)  # else the environment is the checker: its action rewards
    prm_cfg = cfg if trained_prm else dataclasses.replace(cfg, prm="")
    # the PRM reads the task's prompt as written and the turns as steps (episode_text)
    columns = passes.score(prm_cfg, policy, tokenizer, records, completions, p_ids, r_ids, responses, pad)
    if not trained_prm:
        columns["step_rewards"] = step_rewards
    table = rollouts_table(cfg, records, [""] * len(records), completions, p_ids, r_ids, responses,
                           [ep.step_ends for ep in episodes], scored, columns)
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(texts, pa.string()))
    table = table.append_column("policy_mask", pa.array([ep.policy_mask for ep in episodes], pa.list_(pa.int8())))
    return table, metrics(cfg, episodes, outcome, components, columns, len(records))


def metrics(cfg: Config, episodes: list[Episode], outcome, components, columns, n_prompts: int) -> dict:
    """The `rollout/` metrics of an episode rollout, over policy tokens where per token."""
    reward = np.asarray(outcome, np.float64)
    mask = [np.asarray(ep.policy_mask, bool) for ep in episodes]
    m = {"rollout/reward_mean": float(reward.mean()), "rollout/reward_std": float(reward.std()),
         "rollout/prompts": n_prompts, "rollout/samples": len(episodes),
         "rollout/response_length": float(np.mean([mk.sum() for mk in mask])),
         "rollout/episode_length": float(np.mean([len(ep.response_ids) for ep in episodes])),
         "rollout/turns": float(np.mean([len(ep.step_ends) for ep in episodes])),
         "rollout/finish_length_frac": float(np.mean([ep.finish_reason == "length" for ep in episodes])),
         "rollout/truncated_prompts": 0}
    for name in sorted({n for c in components for n in c}):
        m[f"rollout/reward/{name}"] = float(np.mean([c[name] for c in components if name in c]))
    flat = [s for row in columns["step_rewards"] for s in row]
    m["rollout/step_reward_mean"] = float(np.mean(flat)) if flat else float("nan")
    m["rollout/steps_per_response"] = len(flat) / len(episodes)
    old = np.concatenate([np.asarray(o)[mk] for o, mk in zip(columns["old_logprobs"], mask)])
    behavior = np.concatenate([np.asarray(ep.logprobs, np.float32)[mk] for ep, mk in zip(episodes, mask)])
    m["rollout/logprob_gap"] = float(np.abs(old - behavior).mean())
    m["rollout/neg_logprob_mean"] = float(-old.mean())
    if columns["ref_logprobs"] is not None:
        ref = np.concatenate([np.asarray(r)[mk] for r, mk in zip(columns["ref_logprobs"], mask)])
        m["rollout/kl_k1"] = float((old - ref).mean())
    if columns["values"] is not None:
        m["rollout/value_mean"] = float(np.concatenate([np.asarray(v)[mk] for v, mk in zip(columns["values"], mask)]).mean())
    return m

