"""benchmarks/experiments/agent_copy_probe.py: the probe reads the chunk as SFT trained the policy to (its ids are
a prefix of the expert's demonstration as SFT tokenizes it), and its scores against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"))

import agent_copy_probe as probe  # noqa: E402


def test_the_probe_prompt_is_the_start_of_a_stored_demonstration_as_sft_trains_it():
    from prmflow.components.models import chat, modeling
    from prmflow.components.training import supervised_data
    from prmflow.tasks import memory_agent

    tok = modeling.preset_tokenizer("tiny-llama-tools")
    stored = [r for r in memory_agent.records(20, seed=0, split="test")
              if memory_agent.demonstration_of(r)[1]["content"] != memory_agent.NO_CALL]
    assert stored, "no demonstration stores its first chunk"
    for r in stored:
        ids, labels = supervised_data.episode_tokens(tok, memory_agent.demonstration_of(r), True,
                                                     chat.end_of_turn_id(tok), "test")
        opening, forced = probe.probe_ids(tok, r.prompt)
        assert ids[:len(forced)] == forced  # the forced prefix, then the copy SFT taught
        assert labels[len(opening)] == ids[len(opening)]  # the call's first token is trained: the skip decision point
        n = len(tok(r.prompt, add_special_tokens=False)["input_ids"])
        assert tok.decode(ids[len(forced):len(forced) + n]) == r.prompt  # the chunk copied right after the prefix


def test_scores_against_hand_computed_values():
    s = probe.score(["ann 42, bob 17\"}}", "ann 41, bob 17", "xyz"], ["ann 42, bob 17", "ann 42, bob 17", "abc"])
    assert s["exact_copy"] == 1 / 3
    assert abs(s["char_accuracy"] - (1 + 13 / 14 + 0) / 3) < 1e-12
    assert s["first_fact_copy"] == 1 / 3
    # the first fact alone, then the call closes: right; a longer number after the right digits: wrong
    s = probe.score(["ann 42\"}}", "ann 423, bob 1", "ann 42, bob 99"], ["ann 42, bob 17"] * 3)
    assert s["first_fact_copy"] == 2 / 3 and s["exact_copy"] == 0
