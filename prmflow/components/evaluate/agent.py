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

from dataclasses import dataclass, field

from ..scoring.bestofn import aggregate, pick_value


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
