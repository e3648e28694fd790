"""Evaluate a tool-using agent on held-out episodes: its reward components, and best-of-N over episodes by the PRM.

Every held-out prompt is played once greedily and k times sampled through the environment (the rollout's
multi-turn loop). Metrics, from finished episodes (pure functions here, so they are checked by hand):
- eval/<component> (`component_means`): the mean over greedy episodes of each component the environment
  returns; an outcome component as returned, a per-action one first averaged over the episode's actions
  (the memory agent: eval/qa_accuracy, eval/tool_success, eval/content_quality, eval/compression,
  eval/memory_entries); eval/turns, the mean number of policy turns;
- eval/bon_<agg> (`best_of_n`): for each prompt, the sampled episode whose PRM turn scores aggregate highest
  (min, product, last, mean: scoring.bestofn), its `metric` component; ties count as a uniformly random
  choice among the tied (their mean), as for single responses; eval/mean_at_k (a random pick's
  expectation) and eval/best_at_k (the best episode's: the ceiling of any reranker) on the same samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..models import modeling
from ..sampling.engines import HFEngine, SamplingParams
from ..sampling.environment import episode_text, play, weighted
from ..scoring.bestofn import aggregate, pick_value
from ..scoring.prm_scoring import PRMScorer
from . import report


@dataclass
class FinishedEpisode:
    """One episode as evaluate reads it."""

    prompt_id: str
    messages: list[dict]
    """The conversation: opening messages, then each policy turn (assistant) and observation (tool)."""
    step_components: list[dict[str, float]]
    """Each action's reward components (the observation's `rewards`), one per policy turn."""
    outcome: dict[str, float]
    """The episode-level components (`outcome()`)."""
    step_rewards: list[float] = field(default_factory=list)
    """Each action's weighted process reward (environment.step_reward_weights)."""
    turn_scores: list[float] | None = None
    """The PRM's score at the end of each policy turn, when a PRM scored the episode."""
    text: str = ""
    """The episode as a PRM reads it: one step per policy turn (rollout's episode text)."""

    def components(self) -> dict[str, float]:
        """Per-action components averaged over the actions, then the outcome ones (as the rollouts' reward_components)."""
        names = sorted({k for c in self.step_components for k in c})
        n = len(self.step_components)
        out = {k: sum(c.get(k, 0.0) for c in self.step_components) / n for k in names} if n else {}
        out.update(self.outcome)
        return out


def component_means(episodes: list[FinishedEpisode]) -> dict[str, float]:
    """eval/<component>: each component's mean over the episodes (a component an episode lacks counts 0 there);
    eval/turns: the mean number of policy turns."""
    if not episodes:
        return {}
    per = [e.components() for e in episodes]
    names = sorted({k for c in per for k in c})
    out = {f"eval/{k}": sum(c.get(k, 0.0) for c in per) / len(per) for k in names}
    out["eval/turns"] = sum(len(e.step_components) for e in episodes) / len(episodes)
    return out


def best_of_n(groups: list[list[FinishedEpisode]], metric: str, aggregations: list[str]) -> dict[str, float]:
    """Best-of-k over sampled episodes: groups[i] are prompt i's k episodes, each with PRM `turn_scores`.
    Returns eval/bon_<agg> (the PRM's pick's `metric`), eval/mean_at_k and eval/best_at_k, means over prompts."""
    if not groups:
        return {}
    k = len(groups[0])
    out = {f"eval/bon_{how}": 0.0 for how in aggregations}
    out.update({f"eval/mean_at_{k}": 0.0, f"eval/best_at_{k}": 0.0})
    for group in groups:
        if len(group) != k:
            raise ValueError(f"best_of_n: prompt {group[0].prompt_id if group else '?'} has {len(group)} episodes, "
                             f"the others {k}")
        values = [e.components().get(metric, 0.0) for e in group]
        for how in aggregations:
            out[f"eval/bon_{how}"] += pick_value([aggregate(e.turn_scores or [], how) for e in group], values)
        out[f"eval/mean_at_{k}"] += sum(values) / k
        out[f"eval/best_at_{k}"] += max(values)
    return {name: v / len(groups) for name, v in out.items()}


# --- playing the held-out episodes -----------------------------------------------------------------

def play_policy(policy: str, records, cfg, n_samples: int, temperature: float) -> list[list[FinishedEpisode]]:
    """`n_samples` episodes per record of `policy` in `cfg.environment` (greedy at temperature 0), on the HF engine;
    one list per record."""
    device, dtype = modeling.placement(cfg.device, cfg.dtype)
    tokenizer = modeling.load_tokenizer(policy)
    model, _ = modeling.load_causal_lm(policy, dtype, seed=cfg.seed, tokenizer=tokenizer)
    engine = HFEngine(model.to(device), tokenizer, cfg.batch_sequences, device)
    params = SamplingParams(n=1, temperature=temperature, top_p=cfg.sampling.top_p if temperature else 1.0,
                            top_k=cfg.sampling.top_k if temperature else 0, max_new_tokens=cfg.sampling.max_new_tokens,
                            seed=cfg.seed)
    played = play(cfg.environment, engine, tokenizer, records, n_samples, params, cfg.chat_template,
                  window=modeling.context_window(policy), where=f"policy '{policy}'")
    groups: list[list[FinishedEpisode]] = [[] for _ in records]
    for p in played:
        ep = p.episode
        messages = [{"role": "user", "content": p.opening}]
        for k, action in enumerate(ep.actions):
            messages.append({"role": "assistant", "content": action})
            if k < len(ep.observations):
                messages.append({"role": "tool", "content": ep.observations[k]})
        groups[p.prompt].append(FinishedEpisode(
            records[p.prompt].prompt_id, messages, ep.step_components, ep.outcome,
            [weighted(c, cfg.environment.step_reward_weights) for c in ep.step_components],
            text=episode_text(ep, cfg.step_separator)))
    return groups


def score_turns(scorer: PRMScorer, records, groups: list[list[FinishedEpisode]]) -> None:
    """Set every episode's turn_scores: the PRM's score of each policy turn (one step per turn, as rollout writes)."""
    if len(groups) != len(records):
        raise ValueError(f"score_turns: {len(groups)} groups of episodes for {len(records)} records")
    flat = [(r, e) for r, g in zip(records, groups) for e in g]
    scores = scorer.score([r.prompt for r, _ in flat], [e.text for _, e in flat])
    for (_, e), s in zip(flat, scores):
        e.turn_scores = s


def evaluate(cfg, records) -> tuple[dict, list[dict], str]:
    """(eval/* and perf/* metrics, one row per greedy episode for samples.jsonl, the per-turn page) of cfg.policy."""
    t0 = time.perf_counter()
    greedy = [g[0] for g in play_policy(cfg.policy, records, cfg, 1, 0.0)]
    sampled = play_policy(cfg.policy, records, cfg, cfg.n_samples, cfg.sampling.temperature)
    metrics = {"perf/sample_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    if cfg.prm:
        device, dtype = modeling.placement(cfg.device, cfg.dtype)
        scorer = PRMScorer(cfg.prm, step_separator=cfg.step_separator, device=str(device), dtype=dtype)
        for groups in (sampled, [[e] for e in greedy]):  # each aligned with records
            score_turns(scorer, records, groups)
        metrics["perf/score_s"] = time.perf_counter() - t0
    metrics.update(component_means(greedy))
    metrics["eval/accuracy"] = metrics.get(f"eval/{cfg.agent_metric}", 0.0)
    metrics.update(best_of_n(sampled, cfg.agent_metric, cfg.aggregations if cfg.prm else []))
    if cfg.baseline:
        t0 = time.perf_counter()
        base = component_means([g[0] for g in play_policy(cfg.baseline, records, cfg, 1, 0.0)])
        metrics["perf/baseline_s"] = time.perf_counter() - t0
        metrics["eval/baseline_accuracy"] = base.get(f"eval/{cfg.agent_metric}", 0.0)
        metrics.update({f"eval/baseline_{k[5:]}": v for k, v in base.items() if k != f"eval/{cfg.agent_metric}"})
    rows = [{"prompt_id": e.prompt_id, "messages": e.messages, "step_components": e.step_components,
             "step_rewards": e.step_rewards, "turn_scores": e.turn_scores, "outcome": e.outcome,
             "correct": e.components().get(cfg.agent_metric, 0.0)} for e in greedy]
    return metrics, rows, report.per_turn_html(rows[:cfg.log_samples])
