"""Multi-turn episodes through the rollout stage, with docs/agents.md's own example environment.

- A scripted policy (an engine that returns chosen ids) calls the calculator, reads its answer and
  answers: the row holds exactly the sampled ids and the observation's fragment ids, although decoding
  and re-encoding the episode gives other ids at the turn boundary (byte-level BPE merges the template's
  newline with the policy's); the ids the PPO stage trains on are those ids.
- Malformed calls, an unknown tool and wrong arguments are data: error observations, tool_success 0.
- The example runs with a real (random) model on the HF engine and on the vLLM stand-in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prmflow.components import config
from prmflow.components.data import schema
from prmflow.components.models import chat, modeling
from prmflow.components.rollout import model_passes as passes, stage
from prmflow.components.sampling.engines import Completion
from prmflow.errors import ConfigError, DataError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
ENV = {"environment.factory": "agent_docs_example:Calculator", "environment.max_turns": 3,
       "environment.max_total_tokens": 1024, "environment.step_reward_weights": {"tool_success": 0.5},
       "environment.outcome_weights": {"correct": 1.0}, "tracking.enabled": False, "num_prompts": 0}


@pytest.fixture
def example(tmp_path, monkeypatch):
    """docs/agents.md's example environment as the module `agent_docs_example`, and a two-row task."""
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S).group(1)
    (tmp_path / "agent_docs_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt_id": "a", "prompt": "1+2", "answer": "3.0"}\n'
                    '{"prompt_id": "b", "prompt": "2+2", "answer": "4.0"}\n')
    return task


@pytest.fixture(scope="module")
def long_policy(tmp_path_factory):
    """tiny-qwen2-bpe (Qwen2.5's template, a tool role) with a 1024-position window, random weights."""
    path = tmp_path_factory.mktemp("policy") / "policy"
    model, tok = modeling.load_causal_lm("tiny-qwen2-bpe", seed=0)
    model.config.max_position_embeddings = 1024
    modeling.save_pretrained(model, tok, path)
    return path


class Scripted:
    """An engine whose policy turns are given: episode k's turn t samples `turns[k][t]` (ids)."""

    def __init__(self, turns):
        self.turns, self.calls = turns, 0

    def generate(self, prompts, params, progress=None, images=None, rank=0, world=1):
        out = []
        for k in range(len(prompts)):
            ids = self.turns[k % len(self.turns)][self.calls]
            out.append([Completion(list(ids), [-0.5] * len(ids), "stop")])
        self.calls += 1
        return out


def run_scripted(monkeypatch, policy, task, tmp_path, turns, **over):
    tok = modeling.load_tokenizer(policy)
    engine = Scripted(turns)
    real = passes.make_engine
    monkeypatch.setattr(passes, "make_engine", lambda cfg, t: (engine, real(cfg, t)[1]))
    cfg = config.load(stage.Config, overrides={**ENV, "policy": str(policy), "task": str(task), "n_samples": 1,
                                               "output": str(tmp_path / "rollouts"), **over})
    stage.run(cfg)
    return tok, schema.read_dataset(tmp_path / "rollouts", "rollouts").to_pylist()


def test_the_trained_ids_are_the_sampled_ids_where_re_encoding_would_change_them(monkeypatch, example, long_policy,
                                                                                  tmp_path):
    tok = modeling.load_tokenizer(long_policy)
    nl, eot = tok.convert_tokens_to_ids("Ċ"), chat.end_of_turn_id(tok)
    # each turn opens with a newline token of its own, right after the template's "assistant\n": re-encoded,
    # the two newlines are one token ("\n\n"), so a decode-and-encode pipeline would train other ids
    add = [nl] + tok.encode('{"name": "add", "arguments": {"a": 1, "b": 2}}') + [eot]
    answer = [nl] + tok.encode('{"name": "answer", "arguments": {"value": "3.0"}}') + [eot]
    tok, rows = run_scripted(monkeypatch, long_policy, example, tmp_path, [(add, answer)])
    a = next(r for r in rows if r["prompt_id"] == "a")
    observation = chat.observation_ids(tok, "3.0")
    assert a["response_ids"] == add + observation + answer
    assert a["policy_mask"] == [1] * len(add) + [0] * len(observation) + [1] * len(answer)
    assert a["step_ends"] == [len(add) - 1, len(a["response_ids"]) - 1]
    assert a["step_rewards"] == [0.5, 0.5] and a["outcome_reward"] == 1.0
    assert dict(a["reward_components"]) == {"tool_success": 1.0, "correct": 1.0}
    assert a["behavior_logprobs"] == [-0.5] * len(add) + [0.0] * len(observation) + [-0.5] * len(answer)
    full = a["prompt_ids"] + a["response_ids"]
    assert tok(tok.decode(full), add_special_tokens=False)["input_ids"] != full  # re-encoding changes them
    b = next(r for r in rows if r["prompt_id"] == "b")
    assert b["outcome_reward"] == 0.0  # answered 3.0 to 2+2

    # what the PPO stage trains on: the same ids
    from prmflow.components.advantage import stage as advantage
    from prmflow.components.ppo import minibatches, stage as ppo

    advantage.run(config.load(advantage.Config, overrides={"input": str(tmp_path / "rollouts"), "estimator": "reinforce",
                                                           "output": str(tmp_path / "adv"), "tracking.enabled": False}))
    samples = minibatches.load_batch(config.load(ppo.Config, overrides={
        "input": str(tmp_path / "adv"), "policy": str(long_policy), "tracking.enabled": False}))
    trained = {tuple(s.prompt_ids + s.response_ids): s for s in samples}
    assert tuple(full) in trained
    assert trained[tuple(full)].trained().tolist() == [bool(m) for m in a["policy_mask"]]


@pytest.mark.parametrize("prm", ["", "oracle"])
def test_the_environments_action_rewards_are_the_step_rewards_without_a_trained_prm(monkeypatch, example, long_policy,
                                                                                  tmp_path, prm):
    """prm empty or `oracle` (what the pipeline sends when no trained PRM scores the rollouts): each turn's step
    reward is the environment's weighted action components, as the environment itself computes them."""
    from prmflow.components.sampling import environment as env_lib

    tok = modeling.load_tokenizer(long_policy)
    eot = chat.end_of_turn_id(tok)
    turns = [tok.encode('{"name": "add", "arguments": {"a": 1, "b": 2}}') + [eot], tok.encode("add(1, 2)") + [eot],
             tok.encode('{"name": "answer", "arguments": {"value": "3.0"}}') + [eot]]
    tok, rows = run_scripted(monkeypatch, long_policy, example, tmp_path, [turns], prm=prm)
    weights = ENV["environment.step_reward_weights"]
    for r in rows:  # the environment replayed on the row's own turns, fresh
        env = env_lib.load_factory(ENV["environment.factory"])(ENV.get("environment.config", {}))
        env.reset({"prompt_id": r["prompt_id"], "prompt": r["prompt"], "answer": r["answer"]})
        want = [env_lib.weighted(env.step(tok.decode(t[:-1])).rewards, weights) for t in turns]
        assert r["step_rewards"] == pytest.approx(want) and len(set(want)) > 1


def test_bad_actions_are_error_observations_with_no_tool_success(monkeypatch, example, long_policy, tmp_path):
    tok = modeling.load_tokenizer(long_policy)
    eot = chat.end_of_turn_id(tok)
    actions = ['add(1, 2)', '{"name": "mul", "arguments": {"a": 1, "b": 2}}', '{"name": "add", "arguments": {"a": "x"}}']
    tok, rows = run_scripted(monkeypatch, long_policy, example, tmp_path, [[tok.encode(a) + [eot] for a in actions]],
                             **{"environment.config": {"max_calls": 10}})  # max_turns (3) ends the episodes
    for r in rows:
        assert r["step_rewards"] == [0.0, 0.0, 0.0] and r["outcome_reward"] == 0.0
        assert dict(r["reward_components"]) == {"tool_success": 0.0, "correct": 0.0}
        text = tok.decode(r["response_ids"])
        assert "error: JSONDecodeError" in text and "error: unknown tool 'mul'" in text
        assert len(r["step_ends"]) == 3  # the third error is not appended: max_turns ended the episode
        assert text.count("<tool_response>") == 2


def test_limits_are_errors_naming_the_key_and_the_row(monkeypatch, example, long_policy, tmp_path):
    tok = modeling.load_tokenizer(long_policy)
    turn = tok.encode('{"name": "add", "arguments": {"a": 1, "b": 2}}') + [chat.end_of_turn_id(tok)]
    with pytest.raises(DataError, match=r"prompt_id='a', sample 0, turn 0: .* environment.max_observation_tokens=3"):
        run_scripted(monkeypatch, long_policy, example, tmp_path, [[turn] * 3], **{"environment.max_observation_tokens": 3})
    with pytest.raises(DataError, match=r"prompt_id='a', sample 0: after turn 1 it is .*environment.max_total_tokens=300"):
        run_scripted(monkeypatch, long_policy, example, tmp_path, [[turn] * 3], **{"environment.max_total_tokens": 300})
    assert not (tmp_path / "rollouts").exists()
    _, rows = run_scripted(monkeypatch, long_policy, example, tmp_path, [[turn] * 3],
                           **{"environment.max_total_tokens": 300, "environment.on_limit": "truncate"})
    assert all(r["finish_reason"] == "length" and len(r["step_ends"]) == 2 for r in rows)


@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_the_docs_example_runs_through_the_stage(request, monkeypatch, example, long_policy, tmp_path, sampler):
    """A random policy on the real engine (turns end at the stop string "e"): every row is a valid episode. vLLM
    (the stand-in here, the real one on a GPU) starts one engine for every turn."""
    over, engines = {}, []
    if sampler == "vllm":
        vllm = request.getfixturevalue("vllm_module")
        start = vllm.LLM.__init__
        monkeypatch.setattr(vllm.LLM, "__init__", lambda self, *a, **k: (engines.append(1), start(self, *a, **k))[1])
        over = {"sampler": "vllm", "dtype": "float32", "vllm.gpu_memory_utilization": 0.4}
    cfg = config.load(stage.Config, overrides={**ENV, "policy": str(long_policy), "task": str(example), "n_samples": 4,
                                               "stop": ["e"], "sampling.max_new_tokens": 24,
                                               "output": str(tmp_path / "rollouts"), **over})
    metrics = stage.run(cfg)
    rows = schema.read_dataset(tmp_path / "rollouts", "rollouts").to_pylist()
    tok = modeling.load_tokenizer(long_policy)
    assert len(rows) == 8 and metrics["rollout/turns"] > 1
    for r in rows:
        mask, ends = r["policy_mask"], r["step_ends"]
        assert len(mask) == len(r["response_ids"]) and all(mask[e] for e in ends)
        assert len(r["step_rewards"]) == len(ends) and len(r["response"].split("\n")) == len(ends)
        turns = "".join("|" if m else "." for m in mask)
        assert turns.count(".|") == len(ends) - 1 or r["finish_reason"] == "length"  # an observation between turns
        env = tok.decode([t for t, m in zip(r["response_ids"], mask) if not m])
        assert env.count("<tool_response>") == turns.count("|.")
    assert engines == ([1] if sampler == "vllm" else [])
    # a second run with the same config finds its output (resume) and samples nothing
    assert stage.run(cfg) == metrics
    if sampler == "hf":  # the same seed samples the same episodes; another seed others
        again = [config.load(stage.Config, overrides={**ENV, "policy": str(long_policy), "task": str(example),
                                                     "n_samples": 4, "stop": ["e"], "sampling.max_new_tokens": 24,
                                                     "output": str(tmp_path / name), "seed": seed})
                 for name, seed in (("same", 0), ("other", 1))]
        ids = []
        for c in again:
            stage.run(c)
            ids.append([r["response_ids"] for r in schema.read_dataset(c.output, "rollouts").to_pylist()])
        assert ids[0] == [r["response_ids"] for r in rows] != ids[1]


def test_config_refuses_what_episodes_cannot_do(example, tmp_path):
    with pytest.raises(ConfigError, match="environment.factory .* world_size=2"):
        config.load(stage.Config, overrides={**ENV, "task": str(example), "world_size": 2, "rank": 0})
    with pytest.raises(ConfigError, match="environment.max_turns is 0"):
        config.load(stage.Config, overrides={**ENV, "environment.max_turns": 0})
    with pytest.raises(ConfigError, match="environment.max_total_tokens=2048 is more than the policy's 256-token"):
        stage.run(config.load(stage.Config, overrides={**ENV, "policy": "tiny-qwen2-bpe", "task": str(example),
                                                        "environment.max_total_tokens": 2048, "output": str(tmp_path / "r")}))
    with pytest.raises(ConfigError, match="'package.module:attr'"):
        config.load(stage.Config, overrides={**ENV, "environment.factory": "nocolon"})


def test_a_prm_scores_each_turn_and_prm_update_reads_the_turns_as_steps(monkeypatch, example, long_policy, tmp_path,
                                                                       shuffled_prm):
    from prmflow.components.data import steps as steps_lib
    from prmflow.components.prm import online_update
    from prmflow.components.scoring.prm_scoring import PRMScorer

    tok = modeling.load_tokenizer(long_policy)
    eot = chat.end_of_turn_id(tok)
    add, answer = '{"name": "add",\n "arguments": {"a": 1, "b": 2}}', '{"name": "answer", "arguments": {"value": "3.0"}}'
    _, rows = run_scripted(monkeypatch, long_policy, example, tmp_path, [(tok.encode(add) + [eot], tok.encode(answer) + [eot])],
                           prm=str(shuffled_prm))
    # step k of the text: the observation before turn k and the turn, newlines inside made spaces
    want = ['{"name": "add", "arguments": {"a": 1, "b": 2}}', '3.0 ' + answer]
    for r in rows:
        assert steps_lib.steps(r["response"]) == want and len(r["step_ends"]) == 2
        prompt = "1+2" if r["prompt_id"] == "a" else "2+2"
        assert r["step_rewards"] == pytest.approx(PRMScorer(str(shuffled_prm)).score([prompt], [r["response"]])[0], abs=1e-6)
    examples = online_update.rollout_examples(str(tmp_path / "rollouts"), "\n", 0.5)
    assert [(e.steps, e.labels) for e in sorted(examples, key=lambda e: e.prompt_id)] == [(want, [1.0, 1.0]), (want, [0.0, 0.0])]
