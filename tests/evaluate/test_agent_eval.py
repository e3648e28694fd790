"""Evaluate's agent metrics from finished episodes: component means, best-of-N over episodes by PRM turn scores
(against a brute-force expectation over random tie-breaking), and the per-turn HTML view."""

import itertools
import random
import re

import pytest

from prmflow.components.evaluate import agent_metrics as agent, report
from prmflow.tasks import memory_agent as ma


def play(episode, actions, scores=None):
    """A FinishedEpisode of the memory agent from the policy's turns (the environment's own observations)."""
    env = ma.MemoryEnvironment({})
    messages = env.reset({"prompt_id": episode.prompt_id, "answer": episode.to_json()})
    steps = []
    for action in actions:
        obs = env.step(action)
        messages.append({"role": "assistant", "content": action})
        steps.append(obs.rewards)
        if obs.done:
            break
        messages.append({"role": "tool", "content": obs.text})
    return agent.FinishedEpisode(episode.prompt_id, messages, steps, env.outcome(),
                                 [s["tool_success"] + 0.1 * s["content_quality"] for s in steps], scores)


EPISODES = ma.generate(6, seed=4)


def turns(e, stored):
    return [ma.call_text("memory_insert", {"content": ma.chunk_text(c)}) if keep else "[]"
            for c, keep in zip(e.chunks, stored)]


def test_component_means_are_the_episode_means_of_each_component():
    eps = [play(e, turns(e, stored)) for e, stored in zip(EPISODES, itertools.cycle([(1, 1), (1, 0), (0, 0)]))]
    m = agent.component_means(eps)
    # (1, 1): every fact stored; (1, 0): half; (0, 0): none, and no call, so no tool success
    assert m["eval/qa_accuracy"] == pytest.approx((1 + 0.5 + 0) * 2 / 6)
    assert m["eval/tool_success"] == pytest.approx((1 + 0.5 + 0) * 2 / 6)
    assert m["eval/content_quality"] == pytest.approx((1 + 0.5 + 0) * 2 / 6)
    assert m["eval/memory_entries"] == pytest.approx((2 + 1 + 0) * 2 / 6)
    assert m["eval/turns"] == 2.0
    assert m["eval/compression"] == pytest.approx(sum(
        1 - sum(len(ma.chunk_text(c)) for c, k in zip(e.chunks, s) if k) / sum(len(ma.chunk_text(c)) for c in e.chunks)
        for e, s in zip(EPISODES, itertools.cycle([(1, 1), (1, 0), (0, 0)]))) / 6)


def brute_force_pick(keys, values):
    """The expected value of the first argmax over every order of the candidates (a uniformly random tie-break)."""
    orders = list(itertools.permutations(range(len(keys))))
    return sum(values[max(order, key=lambda i: keys[i])] for order in orders) / len(orders)


def test_best_of_n_over_episodes_picks_the_highest_aggregate_and_averages_ties():
    rng = random.Random(0)
    e = EPISODES[0]
    patterns = [(1, 1), (1, 0), (0, 1), (0, 0)]
    for trial in range(60):
        groups, want = [], {how: 0.0 for how in ("min", "product", "last", "mean")}
        for _ in range(3):
            group = [play(e, turns(e, rng.choice(patterns)), [rng.choice([0.2, 0.5, 0.9]) for _ in range(2)])
                     for _ in range(4)]
            groups.append(group)
            values = [g.outcome["qa_accuracy"] for g in group]
            for how, fn in (("min", min), ("product", lambda s: s[0] * s[1]), ("last", lambda s: s[-1]),
                            ("mean", lambda s: (s[0] + s[1]) / 2)):
                want[how] += brute_force_pick([fn(g.turn_scores) for g in group], values) / 3
        got = agent.best_of_n(groups, "qa_accuracy", ["min", "product", "last", "mean"])
        for how in want:
            assert got[f"eval/bon_{how}"] == pytest.approx(want[how]), (trial, how)
        assert got["eval/mean_at_4"] == pytest.approx(sum(g.outcome["qa_accuracy"] for gr in groups for g in gr) / 12)
        assert got["eval/best_at_4"] == pytest.approx(sum(max(g.outcome["qa_accuracy"] for g in gr) for gr in groups) / 3)
    with pytest.raises(ValueError, match="has 3 episodes, the others 4"):
        agent.best_of_n([groups[0], groups[1][:3]], "qa_accuracy", ["min"])


def test_the_per_turn_page_shows_every_turn_in_order_with_its_rewards_and_escapes_model_text():
    e = EPISODES[1]
    ep = play(e, ["<script>alert(1)</script>", turns(e, (1, 1))[1]], [0.25, 0.75])
    page = report.per_turn_html([vars(ep)])
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    shown = re.findall(r"<span class='role'>(\w+)(?: (\d))?</span>", page)
    assert shown == [("user", ""), ("assistant", "1"), ("tool", ""), ("assistant", "2")]
    first, second = page.split("<span class='role'>assistant 1</span>")[1].split("<span class='role'>assistant 2</span>")
    assert "content_quality 0.00 &middot; tool_success 0.00 &middot; reward 0.000 &middot; PRM 0.250" in first
    assert "error: not a JSON tool call" in first  # the observation after turn 1
    assert "content_quality 1.00 &middot; tool_success 1.00 &middot; reward 1.100 &middot; PRM 0.750" in second
    colours = re.findall(r"style='background:([^']+)'><span class='role'>assistant", page)
    assert colours == [report.score_colour(0.25), report.score_colour(0.75)]  # the PRM's, not the rewards'
    assert "qa_accuracy 0.500" in page


class ScriptedEngine:
    """Stands in for HFEngine: a policy that, for the chunk it is shown (the context's last line), writes the expert's
    insert or skips it; greedy (temperature 0) stores a chunk whose first number is even, sampling stores with
    probability 1/2 (one seeded generator per call)."""

    def __init__(self, model, tokenizer, batch_size=64, device=None):
        self.tok = tokenizer

    def generate(self, prompts, params, progress=None, images=None):
        from prmflow.components.sampling.engines import Completion

        out, rng = [], random.Random(params.seed)  # drawn in order, as a batch's rows draw from one generator
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=True)
            chunk = text.rstrip("\n").split("\n")[-1]
            if params.temperature == 0:
                store = int(chunk.split(",")[0].split()[1]) % 2 == 0
            else:
                store = rng.random() < 0.5
            action = ma.call_text("memory_insert", {"content": chunk}) if store else "[]"
            new = self.tok(action, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Completion(new, [0.0] * len(new), "stop")])
        return out


def test_the_stage_plays_held_out_episodes_and_reports_the_components_best_of_n_and_the_baseline(tmp_path, monkeypatch):
    """evaluate with environment.factory: greedy episodes give eval/<component> (QA accuracy = the share of names in
    stored chunks, computed here from the episodes' facts), a flat PRM makes best-of-k a random pick (= mean_at_k),
    the baseline's accuracy is the same policy's, and per_step.html and samples.jsonl hold every turn."""
    import json

    from prmflow.components import config
    from prmflow.components.evaluate import stage
    from prmflow.components.models import modeling

    policy = tmp_path / "policy"
    model, tok = modeling.load_causal_lm("tiny-llama-tools")
    modeling.save_pretrained(model, tok, policy)
    prm = tmp_path / "prm"
    scalar, tok = modeling.load_scalar_model(policy)  # a zero head: every turn scores 0.5
    modeling.save_pretrained(scalar, tok, prm)
    monkeypatch.setattr(agent, "HFEngine", ScriptedEngine)
    cfg = config.load(stage.Config, overrides={
        "policy": str(policy), "baseline": str(policy), "prm": str(prm), "task": "memory_agent", "num_prompts": 12,
        "n_samples": 4, "sampling.max_new_tokens": 80, "output": str(tmp_path / "eval"), "tracking.enabled": False,
        "environment.factory": "prmflow.tasks.memory_agent:MemoryEnvironment", "environment.max_turns": 2,
        "environment.step_reward_weights": {"tool_success": 1.0, "content_quality": 0.5}, "device": "cpu"})
    m = stage.run(cfg)
    held = ma.generate(12, seed=0, split="test")
    stored = [[c[0][1] % 2 == 0 for c in e.chunks] for e in held]
    want = [sum(s for s in stored_e) / 2 for stored_e in stored]  # two names per chunk, four per episode
    assert m["eval/qa_accuracy"] == pytest.approx(sum(want) / 12) == m["eval/accuracy"] == m["eval/baseline_accuracy"]
    assert m["eval/tool_success"] == pytest.approx(sum(want) / 12)  # a skip is no call: no success
    assert m["eval/memory_entries"] == pytest.approx(sum(sum(s) for s in stored) / 12)
    assert m["eval/turns"] == 2.0
    for how in ("min", "product", "last", "mean"):
        assert m[f"eval/bon_{how}"] == pytest.approx(m["eval/mean_at_4"])
    assert 0 < m["eval/mean_at_4"] < m["eval/best_at_4"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == [e.prompt_id for e in held]
    assert [r["correct"] for r in rows] == pytest.approx(want)
    assert [r["turn_scores"] for r in rows] == [[0.5, 0.5]] * 12
    page = (tmp_path / "eval" / "per_step.html").read_text()
    assert page.count("<span class='role'>assistant 2</span>") == len(rows[:cfg.log_samples])
