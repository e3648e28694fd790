"""The memory-agent task: its environment (tool parsing, bad calls as data, the retriever's QA, the rewards),
its splits and seeds, and the expert's demonstrations replayed through a fresh environment."""

import itertools
import json
import re

import pytest

from prmflow import tasks
from prmflow.errors import ConfigError, DataError
from prmflow.tasks import memory_agent as ma
from prmflow.tasks.arithmetic import hash_unit


def start(episode, **config):
    env = ma.MemoryEnvironment(config)
    opening = env.reset({"prompt_id": episode.prompt_id, "answer": episode.to_json()})
    return env, opening


EP = ma.Episode("mem-test", [[("ann", 42), ("bob", 17)], [("cal", 55), ("ann", 60)]])


def insert(content):
    return json.dumps({"name": "memory_insert", "arguments": {"content": content}})


# --- tool parsing ---------------------------------------------------------------------------------

def test_a_turn_is_an_object_a_list_or_qwen_tool_call_blocks_and_each_tool_does_what_it_says():
    env, opening = start(EP)
    assert opening == [{"role": "user", "content": "ann 42, bob 17"}]
    obs = env.step(insert("ann 42, bob 17"))
    assert obs == ma.Observation("ok id 0\ncal 55, ann 60", {"tool_success": 1.0, "content_quality": 1.0}, False)
    assert env.memory == {0: "ann 42, bob 17"}
    # Qwen2.5 writes each call in <tool_call> tags, with text around them; spaces inside the JSON are fine
    turn = ('I update ann.\n<tool_call>\n{"name": "memory_update", "arguments": {"id": 0, "content": "ann 60, bob 17"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "memory_insert", "arguments": {"content": "cal 55"}}\n</tool_call>')
    obs = env.step(turn)
    assert obs == ma.Observation("", {"tool_success": 1.0, "content_quality": 1.0}, True)
    assert env.memory == {0: "ann 60, bob 17", 1: "cal 55"}
    assert env.outcome() == {"qa_accuracy": 1.0, "compression": 1 - 20 / 28, "memory_entries": 2.0}

    env, _ = start(EP)
    env.step("[" + insert("ann 42") + "," + insert("bob 17") + "]")  # a JSON list of calls
    assert env.memory == {0: "ann 42", 1: "bob 17"}
    obs = env.step('{"name":"memory_delete","arguments":{"id":1}}')
    assert env.memory == {0: "ann 42"} and obs.rewards == {"tool_success": 1.0, "content_quality": 0.0}
    assert env.outcome()["qa_accuracy"] == 0.0  # ann's number is stale, bob's deleted, cal never stored


def test_no_call_is_no_change_and_no_credit():
    env, _ = start(EP)
    obs = env.step("[]")
    assert obs == ma.Observation("no call\ncal 55, ann 60", {"tool_success": 0.0, "content_quality": 0.0}, False)
    obs = env.step("I will remember nothing.<tool_call")  # free text around no complete <tool_call> block
    assert obs.text == "" and obs.done and obs.rewards["tool_success"] == 0.0 and env.memory == {}


MALFORMED = {
    "not json": ("remember ann 42", "not a JSON tool call"),
    "cut json": ('{"name":"memory_insert","arguments":{"content":"ann 42"}', "not a JSON tool call"),
    "python, not json": ("{'name': 'memory_insert', 'arguments': {'content': 'ann 42'}}", "not a JSON tool call"),
    "code": ("__import__('os').system('touch /tmp/prmflow-memenv-pwned')", "not a JSON tool call"),
    "NaN id": ('{"name":"memory_delete","arguments":{"id":NaN}}', "not a JSON tool call"),
    "huge integer": ('{"name":"memory_delete","arguments":{"id":' + "9" * 5000 + "}}", "not a JSON tool call",
                     {"max_action_chars": 10**6}),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "nested too deeply", {"max_action_chars": 10**6}),
    "too long": (insert("ann 42 " * 200), "turn longer than 1000"),
    "too many calls": ("[" + ",".join([insert("ann 42")] * 5) + "]", "5 calls in one turn"),
    "unknown tool": ('{"name":"memory_search","arguments":{"query":"ann"}}', "unknown tool 'memory_search'"),
    "tool name not a string": ('{"name":["memory_insert"],"arguments":{"content":"ann 42"}}', "unknown tool"),
    "no arguments key": ('{"name":"memory_insert","content":"ann 42"}', 'a call is {"name"'),
    "arguments a list": ('{"name":"memory_insert","arguments":["ann 42"]}', "arguments must be a JSON object"),
    "missing argument": ('{"name":"memory_update","arguments":{"content":"ann 42"}}', "memory_update takes id, content"),
    "extra argument": ('{"name":"memory_insert","arguments":{"content":"ann 42","id":0}}', "memory_insert takes content"),
    "content a number": ('{"name":"memory_insert","arguments":{"content":42}}', "content must be a string"),
    "id a string": ('{"name":"memory_delete","arguments":{"id":"0"}}', "id must be an integer"),
    "id a bool": ('{"name":"memory_delete","arguments":{"id":true}}', "id must be an integer"),
    "id a float": ('{"name":"memory_delete","arguments":{"id":0.0}}', "id must be an integer"),
    "no such entry": ('{"name":"memory_update","arguments":{"id":7,"content":"ann 42"}}', "no entry id 7"),
    "empty content": (insert("  "), "content is empty"),
    "qwen block with a list": ("<tool_call>[]</tool_call>", "must hold one JSON object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_bad_call_is_an_error_observation_with_no_credit_and_the_episode_goes_on(case, tmp_path):
    action, message, *config = MALFORMED[case]
    env, _ = start(EP, **(config[0] if config else {}))
    obs = env.step(action)
    first, _, rest = obs.text.partition("\n")
    assert first.startswith("error: ") and any(m in first for m in message.split("|")), obs.text
    assert len(first) <= len("error: ") + env.cfg.max_error_chars
    assert rest == "cal 55, ann 60" and not obs.done  # the next chunk still comes
    assert obs.rewards == {"tool_success": 0.0, "content_quality": 0.0}
    assert env.memory == {}
    assert not (tmp_path / "prmflow-memenv-pwned").exists()
    obs = env.step(insert("cal 55, ann 60"))  # and the episode still works
    assert obs.done and obs.rewards["tool_success"] == 1.0


def test_one_bad_call_of_two_gets_half_the_tool_credit_and_the_good_one_runs():
    env, _ = start(EP)
    obs = env.step("[" + insert("ann 42, bob 17") + ',{"name":"memory_delete","arguments":{"id":3}}]')
    assert obs.text == "ok id 0; error: no entry id 3\ncal 55, ann 60"
    assert obs.rewards == {"tool_success": 0.5, "content_quality": 1.0}


def test_limits_on_entries_and_their_length_are_errors_not_crashes():
    env, _ = start(EP, max_entries=1, max_entry_chars=10)
    obs = env.step("[" + insert("ann 42") + "," + insert("bob 17") + "," + insert("ann 42, bob 17") + "]")
    assert obs.text.split("\n")[0] == "ok id 0; error: memory full (1 entries); error: memory full (1 entries)"
    obs = env.step('{"name":"memory_update","arguments":{"id":0,"content":"ann 42, bob 17"}}')
    assert obs.rewards["tool_success"] == 0.0 and env.memory == {0: "ann 42"}
    with pytest.raises(ConfigError, match=r"unknown memory_agent key\(s\) \['max_entrys'\]"):
        ma.MemoryEnvironment({"max_entrys": 3})
    with pytest.raises(DataError, match="prompt 'p1': its answer is not a memory_agent episode"):
        ma.MemoryEnvironment().reset({"prompt_id": "p1", "answer": "42"})


# --- the retriever and the rewards, against independent references ------------------------------

def reference_answer(writes: list[tuple[int, str]], name: str):
    """The retriever's rule written plainly: replay the writes into a dict, the last write of an entry moves it
    to the newest; the newest entry whose words include the name gives the first number after it."""
    memory, clock = {}, {}
    for t, (entry, content) in enumerate(writes):
        memory[entry] = content
        clock[entry] = t
    for entry in sorted(memory, key=lambda e: -clock[e]):
        tokens = re.sub(r"[^a-z0-9]+", " ", re.sub(r"([a-z])([0-9])|([0-9])([a-z])", r"\1\3 \2\4",
                                                     memory[entry].lower())).split()
        if name in tokens:
            after = tokens[tokens.index(name) + 1:]
            numbers = [t for t in after if t.isdigit()]
            return int(numbers[0]) if numbers else None
    return None


CONTENTS = ["ann 1", "ann 2, bob 3", "Bob:4 ann5", "ann", "annie 7", "x ann y 8", "bob 9"]


def test_the_retriever_answers_as_the_plain_rule_on_every_short_history_of_writes():
    """Every history of up to three writes (insert or overwrite of entries 0 and 1) of the contents above, made
    through the environment's tools in one turn."""
    checked = 0
    for n in range(4):
        for history in itertools.product(itertools.product((0, 1), CONTENTS), repeat=n):
            env, _ = start(ma.Episode("p", [[("ann", 1)]] * 4), max_calls=4)
            calls = []  # the writes as the environment's tools: a new entry is an insert (ids count from 0)
            for entry, content in history:
                if entry not in {e for e, _ in history[:len(calls)]} and entry != len({e for e, _ in history[:len(calls)]}):
                    break
                tool = "memory_update" if entry in {e for e, _ in history[:len(calls)]} else "memory_insert"
                calls.append({"name": tool, "arguments": {"content": content, **({"id": entry} if tool == "memory_update"
                                                                                  else {})}})
            else:
                assert env.step(json.dumps(calls)).rewards["tool_success"] == (1.0 if calls else 0.0)
                for name in ("ann", "bob", "cal"):
                    assert ma.retrieve(env.memory, env.order, name) == reference_answer(list(history), name), (history, name)
                    checked += 1
    assert checked == 3 * (1 + 7 + 7 * 14 + 7 * 14 * 14)  # every history whose first write to entry 1 follows entry 0's


def test_qa_accuracy_is_the_share_of_names_whose_latest_chunk_was_stored_for_every_skip_pattern():
    """The expert stores some chunks and skips the others (every pattern, with and without revisions): a name is
    answered right exactly when the chunk that gives its final number was stored."""
    episodes = ma.generate(30, seed=5, cfg=ma.MemoryAgentConfig(num_chunks=3, revise_frac=0.7))
    assert any(len(e.answers) < 6 for e in episodes)  # some revise a name
    for e in episodes:
        for pattern in itertools.product((False, True), repeat=3):
            env, _ = start(e)
            for skip in pattern:
                env.step(ma.expert_action(env, skip))
            final_chunk = {name: max(k for k, c in enumerate(e.chunks) if name in dict(c)) for name in e.answers}
            want = sum(not pattern[final_chunk[name]] for name in e.answers) / len(e.answers)
            assert env.outcome()["qa_accuracy"] == want, (e, pattern)


QUALITY = [  # (content written on the first chunk "ann 42, bob 17", content_quality)
    ("ann 42, bob 17", 1.0),
    ("bob 17 ann 42", 1.0),
    ("ann 42", 0.5),
    ("ann 43, bob 17", 0.5),
    ("ann 42, bob 17, cal 55", 2 / 3),  # cal's number is not known yet: a guess
    ("ann 42 ann 42 bob 17", 1.0),  # repeats count once
    ("remember them", 0.0),
]


@pytest.mark.parametrize("content,quality", QUALITY)
def test_content_quality_is_true_pairs_over_pairs_written_or_chunk_facts(content, quality):
    env, _ = start(EP)
    assert env.step(insert(content)).rewards["content_quality"] == pytest.approx(quality)


def test_compression_counts_memory_characters_against_chunk_characters():
    env, _ = start(EP)
    env.step(insert("ann 42"))
    env.step(insert("cal 55, ann 60, bob 17 and more words"))
    assert env.outcome()["compression"] == 0.0  # longer than the chunks: clipped
    env, _ = start(EP)
    env.step(insert("ann 42"))
    env.step("[]")
    assert env.outcome()["compression"] == pytest.approx(1 - 6 / 28)


# --- episodes: splits, seeds, demonstrations -------------------------------------------------------

def test_splits_never_share_an_episode_even_where_the_episodes_run_out():
    """One fact per episode: 24 names x 90 numbers = 2,160 episodes in all, so splits drawn at random would share."""
    cfg = ma.MemoryAgentConfig(num_chunks=1, facts_per_chunk=1)
    train = {e.to_json() for e in ma.generate(1500, seed=0, split="train", cfg=cfg)}
    held = {e.to_json() for split in ("eval", "test") for e in ma.generate(150, seed=0, split=split, cfg=cfg)}
    assert len(train) == 1500 and len(held) == 300 and not train & held


def test_splits_never_share_an_episode_and_seeds_fix_the_episodes():
    identity = lambda e: e.to_json()  # noqa: E731
    train = ma.generate(3000, seed=0, split="train")
    held = ma.generate(400, seed=0, split="eval") + ma.generate(400, seed=1, split="test")
    assert not {identity(e) for e in train} & {identity(e) for e in held}
    assert len({identity(e) for e in train}) == 3000
    assert [identity(e) for e in ma.generate(50, seed=0)] == [identity(e) for e in train[:50]]
    assert [identity(e) for e in ma.generate(50, seed=2)] != [identity(e) for e in train[:50]]
    for e in train[:200]:
        names = [n for c in e.chunks for n, _ in c]
        assert len(names) == len(set(names)) == 4 and all(10 <= v <= 99 for c in e.chunks for _, v in c)


@pytest.mark.parametrize("task", sorted(ma.VARIANTS))
def test_demonstrations_replay_to_full_reward_through_a_fresh_environment(task):
    cfg = ma.MemoryAgentConfig(skip_frac=0.0, revise_frac=0.5, num_chunks=3)
    system = 1 if task == "memory_agent_qwen" else 0
    for r in ma.records(40, seed=3, cfg=cfg, task=task):
        e, messages = ma.Episode.from_json(r.prompt_id, r.answer), ma.demonstration_of(r)
        assert [m["role"] for m in messages] == ["system"] * system + ["user", "assistant", "tool", "assistant", "tool",
                                                                       "assistant"]
        env = ma.MemoryEnvironment({})
        assert env.reset(vars(r)) == messages[:1 + system]
        for k, turn in enumerate(messages[1 + system::2]):
            if task == "memory_agent_qwen":
                assert turn["content"].startswith("<tool_call>\n{\"name\": \"memory_")
            obs = env.step(turn["content"])
            assert obs.rewards == {"tool_success": 1.0, "content_quality": 1.0}, (e, turn)
            assert obs.done == (k == 2)
            assert obs.text == (messages[2 + system + 2 * k]["content"] if k < 2 else "")
        assert env.outcome()["qa_accuracy"] == 1.0
        stored = [p for content in env.memory.values() for p in ma.pairs(content)]
        assert sorted(stored) == sorted(e.answers.items())  # every final fact once, no stale number left


def test_skip_frac_leaves_that_share_of_chunks_unstored_and_the_records_carry_the_episode():
    cfg = ma.MemoryAgentConfig(skip_frac=0.4)
    records = ma.records(1000, seed=0, cfg=cfg)
    turns = [m["content"] for r in records for m in ma.demonstration_of(r) if m["role"] == "assistant"]
    assert 0.36 < turns.count("[]") / len(turns) < 0.44
    r = records[0]
    assert r.source == "memory_agent" and r.prompt == r.messages[0]["content"]
    assert ma.Episode.from_json(r.prompt_id, r.answer).to_json() == ma.generate(1, seed=0)[0].to_json()
    assert [x.prompt_id for x in tasks.load("memory_agent", "train", 5, 0)] == [x.prompt_id for x in records[:5]]
    with pytest.raises(ConfigError, match="skip_frac=1.5 must be in"):
        ma.MemoryAgentConfig(skip_frac=1.5)


def test_partial_frac_stores_the_first_fact_alone_and_the_sft_config_reaches_the_demonstrations():
    """Each chunk's kind follows its own hash: below skip_frac skipped, below skip_frac + partial_frac the first fact
    alone (a half-credit store that still copies), else the whole chunk; the sft stage's `memory_agent` section is
    what its records are made with."""
    from prmflow.components import config
    from prmflow.components.sft import stage as sft

    cfg = ma.MemoryAgentConfig(skip_frac=0.2, partial_frac=0.5)
    kinds = {"skip": 0, "partial": 0, "whole": 0}
    for r in ma.records(400, seed=1, cfg=cfg):
        e, turns = ma.Episode.from_json(r.prompt_id, r.answer), ma.demonstration_of(r)[1::2]
        env = ma.MemoryEnvironment({})
        env.reset(vars(r))
        for k, turn in enumerate(turns):
            u = hash_unit(f"skip:{r.prompt_id}:{k}")
            kind = "skip" if u < 0.2 else "partial" if u < 0.7 else "whole"
            kinds[kind] += 1
            want = {"skip": "[]", "partial": ma.call_text("memory_insert", {"content": ma.chunk_text(e.chunks[k][:1])}),
                    "whole": ma.call_text("memory_insert", {"content": ma.chunk_text(e.chunks[k])})}[kind]
            assert turn["content"] == want
            obs = env.step(turn["content"])
            assert obs.rewards == {"skip": {"tool_success": 0.0, "content_quality": 0.0},
                                   "partial": {"tool_success": 1.0, "content_quality": 0.5},
                                   "whole": {"tool_success": 1.0, "content_quality": 1.0}}[kind]
    assert all(n > 100 for n in kinds.values()), kinds
    with pytest.raises(ConfigError, match="skip_frac \\+ partial_frac = 1.1"):
        ma.MemoryAgentConfig(skip_frac=0.6, partial_frac=0.5)
    with pytest.raises(ConfigError, match="partial_frac=-0.1 must be in"):
        ma.MemoryAgentConfig(partial_frac=-0.1)

    c = config.load(sft.Config, overrides={"task": "memory_agent", "num_prompts": 20, "eval_size": 5,
                                           "memory_agent.skip_frac": 0.0, "memory_agent.partial_frac": 1.0})
    train, held_out = sft.load_data(c)
    turns = [m["content"] for r in train + held_out for m in ma.demonstration_of(r) if m["role"] == "assistant"]
    assert len(turns) == 50 and all(len(ma.pairs(json.loads(t)["arguments"]["content"])) == 1 for t in turns)
    assert [r.prompt_id for r in train] == [r.prompt_id for r in tasks.load("memory_agent", "train", 20, 0)]


def test_the_sft_identity_holds_the_memory_agent_section_only_where_a_memory_agent_task_reads_it():
    """An arithmetic SFT output made before the section existed stays this config's (no retraining, no 'different
    config' error); for the memory agent a changed demonstration mix is a different result."""
    from prmflow.components import config
    from prmflow.components.sft import stage as sft

    arith = config.load(sft.Config, overrides={"memory_agent.partial_frac": 0.3})
    assert sft.identity(arith) == {k: v for k, v in config.to_dict(arith).items() if k != "memory_agent"}
    assert sft.identity(arith) == sft.identity(config.load(sft.Config))
    agent = [config.load(sft.Config, overrides={"task": "memory_agent", "memory_agent.partial_frac": f}) for f in (0, .3)]
    assert sft.identity(agent[0]) != sft.identity(agent[1])
    assert sft.identity(agent[1])["memory_agent"]["partial_frac"] == 0.3


def test_the_tools_preset_writes_every_character_of_a_demonstration_and_ends_assistant_turns_with_eos():
    """tiny-llama's alphabet has no `{`, `}` or `_`: a JSON call was <unk>s. tiny-llama-tools adds them after the
    alphabet (every other character keeps its id) and templates turns: text + newline, an assistant turn + eos."""
    from prmflow.components.models import chat, modeling

    tok, base = modeling.load_tokenizer("tiny-llama-tools"), modeling.load_tokenizer("tiny-llama")
    assert [tok.convert_tokens_to_ids(c) for c in modeling.ALPHABET] == [base.convert_tokens_to_ids(c)
                                                                         for c in modeling.ALPHABET]
    cfg = ma.MemoryAgentConfig(revise_frac=0.5, num_chunks=3)
    for r in ma.records(20, seed=1, cfg=cfg):  # the json variant
        messages = ma.demonstration_of(r)
        text = tok.apply_chat_template(messages, tokenize=False)
        assert text == "".join(m["content"] + ("</s>" if m["role"] == "assistant" else "\n") for m in messages)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert chat.end_of_turn_id(tok) == tok.eos_token_id


def test_the_qwen_variant_renders_through_qwen25s_template_as_qwen25_writes_tool_calls_and_results():
    """Qwen2.5's template turns a tool message into <tool_response> inside a user turn; the expert's text is what
    the template itself writes for an assistant message with tool_calls (so a Qwen2.5 model sees its own format)."""
    from prmflow.components.models import modeling

    tok = modeling.load_tokenizer("tiny-qwen2-bpe")  # Qwen2.5-Instruct's chat template, verbatim
    r = ma.records(1, seed=2, cfg=ma.MemoryAgentConfig(skip_frac=0.0), task="memory_agent_qwen")[0]
    messages = ma.demonstration_of(r)
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\nStore the facts") and "<tools>\n{\"type\": \"function\"" in text
    assert f"<|im_start|>user\n<tool_response>\n{messages[3]['content']}\n</tool_response><|im_end|>" in text
    calls = [{"type": "function", "function": json.loads(m["content"].split("\n")[1])} for m in messages
             if m["role"] == "assistant"]
    structured = [dict(m, content="", tool_calls=[calls.pop(0)]) if m["role"] == "assistant" else m for m in messages]
    assert tok.apply_chat_template(structured, tokenize=False) == text


@pytest.mark.parametrize("task", sorted(ma.VARIANTS))
def test_prm_examples_are_turns_as_rollout_writes_them_labelled_until_the_first_flawed_turn(task):
    """Each episode twice: the expert's (all 1) and one with a flawed turn (1 before it, 0 from it). A turn labelled 1
    is the expert's turn; the first 0 is a turn the environment does not fully credit. The steps are what rollout's
    episode text holds for the same turns (sampling/environment.py episode_text)."""
    from prmflow.components.sampling.environment import episode_text
    from prmflow.components.sampling.episodes import Episode as Played

    rows = ma.step_examples(60, seed=1, task=task)
    assert len(rows) == 120
    for expert_row, row in zip(rows[::2], rows[1::2]):
        assert expert_row["labels"] == [1.0, 1.0] and expert_row["prompt_id"] == row["prompt_id"]
        first_bad = row["labels"].index(0.0)
        assert row["labels"] == [1.0] * first_bad + [0.0] * (2 - first_bad)
        env, _ = start(ma.Episode.from_json(row["prompt_id"], row["answer"]))
        env.call_format = ma.VARIANTS[task]
        actions, observations = [], []
        for k in range(2):
            expert = ma.expert_action(env)
            step = row["steps"][k]
            action = expert if k != first_bad else next(a for a in candidates(env) if step.endswith(" ".join(a.split())))
            assert (action == expert) == (k != first_bad)  # after the flawed turn the expert goes on (still 0)
            obs = env.step(action)
            if k == first_bad:
                assert obs.rewards != {"tool_success": 1.0, "content_quality": 1.0}, (row, action)
            actions.append(action)
            observations += [obs.text] if not obs.done else []
        assert row["steps"] == episode_text(Played([], actions=actions, observations=observations), "\n").split("\n")


def candidates(env):
    """Every flawed turn ma.flawed_turn can write for the chunk shown now."""
    class Fixed:
        def __init__(self, k):
            self.k = k

        def randrange(self, _):
            return self.k
    return [ma.flawed_turn(env, Fixed(k)) for k in range(4)]


def test_the_prm_stage_trains_on_the_tasks_turns_and_holds_out_its_eval_split():
    from prmflow.components import config
    from prmflow.components.prm import config as prm_config, step_examples

    cfg = config.load(prm_config.Config, overrides={"task": "memory_agent_qwen", "num_prompts": 50, "eval_size": 20})
    train, held = step_examples.load_data(cfg)
    assert (len(train), len(held)) == (100, 40)
    assert {e.source for e in train + held} == {"memory_agent_qwen"} and all(len(e.steps) == 2 for e in train)
    assert not {e.prompt_id for e in train} & {e.prompt_id for e in held}
    assert [e.steps for e in train] == [r["steps"] for r in ma.step_examples(50, 0, task="memory_agent_qwen")]
    cfg = config.load(prm_config.Config, overrides={"task": "memory_agent", "policy_from_backbone": True})
    with pytest.raises(ConfigError, match="task=memory_agent: policy samples"):
        step_examples.load_data(cfg)


def test_sft_trains_exactly_the_expert_turns_and_verify_refuses_an_episode():
    """The task's rows go through SFT's multi-turn path: the example is the demonstration as the chat template renders
    it, the labels are the assistant turns and their eos only. An episode is scored by playing it (evaluate), so
    verify refuses one, and the sft stage's held-out accuracy is NaN, not the 0 the single-response grader gave the
    episode JSON (slow test below)."""
    from prmflow.components.models import modeling
    from prmflow.components.training import supervised_data as data

    tok = modeling.load_tokenizer("tiny-llama-tools")
    records = tasks.load("memory_agent", "train", 30, 0)
    examples, dropped = data.tokenize(records, tok, 512)
    assert dropped == 0 and len(examples) == 30
    for r, ex in zip(records, examples):
        demo = ma.demonstration_of(r)
        assert tok.decode(ex.input_ids) == tok.apply_chat_template(demo, tokenize=False)
        want = [t for m in demo if m["role"] == "assistant"
                for t in tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        assert [t for t in ex.labels if t != data.IGNORE] == want
    with pytest.raises(ValueError, match="is a memory_agent episode: its environment scores it"):
        tasks.verify(records[0], "anything")


@pytest.mark.slow
def test_the_sft_stage_reports_no_single_response_accuracy_for_episodes(tmp_path, capsys):
    import math

    from prmflow.components import config
    from prmflow.components.sft import stage as sft

    m = sft.run(config.load(sft.Config, overrides={
        "policy": "tiny-llama-tools", "task": "memory_agent", "num_prompts": 32, "eval_size": 8, "max_steps": 2,
        "micro_batch_size": 8, "optim.warmup_steps": 0, "eval_every": 2, "save_every": 0, "output": str(tmp_path / "sft"),
        "tracking.enabled": False}))
    assert math.isnan(m["eval/accuracy"]) and m["eval/loss"] > 0
    assert "accuracy: none for episodes (evaluate scores them)" in capsys.readouterr().out  # not "accuracy nan"
