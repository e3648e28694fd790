"""The built-in memory-agent task: Mem-alpha's memory-construction trainer in miniature.

An episode is a few chunks of facts, one chunk per turn. On each turn the policy writes memory with
tool calls; the environment executes them and answers with the result and the next chunk:

    user:       ann 42, bob 17
    assistant:  {"name":"memory_insert","arguments":{"content":"ann 42, bob 17"}}
    tool:       ok id 0
                cal 55, dan 21
    assistant:  {"name":"memory_insert","arguments":{"content":"cal 55, dan 21"}}

Tools (arguments a JSON object): `memory_insert {content}` -> a new entry and its id,
`memory_update {id, content}` -> the entry's content replaced, `memory_delete {id}`. A turn is one
call (a JSON object), a JSON list of calls (`[]`: none), or, as Qwen2.5 writes them, `<tool_call>`
blocks each holding one call (text outside them is ignored). The text is parsed as data (json.loads
with limits on length, depth and calls); a malformed turn, an unknown tool or wrong arguments get an
`error: ...` observation and no credit. Nothing the model writes is evaluated or executed.

When the last chunk is done, one question per fact name ("what is ann's number?") is answered from
the memory by a deterministic retriever (`retrieve`): the most recently written entry that holds the
name as a word, and the first number after it. So every reward is exact and checkable. The reward
follows Mem-alpha, r_t = r1 + r2_t + beta*r3 + gamma*r4_t, as named components:
- `qa_accuracy` (r1, episode): the fraction of questions the retriever answers right;
- `compression` (r3, episode): 1 - memory characters / chunk characters, clipped to [0, 1];
- `tool_success` (r2_t, per action): the fraction of the turn's calls that ran (0 with no call);
- `content_quality` (r4_t, per action): the (name, number) pairs the turn wrote that are true now,
  over max(pairs written, facts in the chunk): 1 for a faithful copy, 0.5 for half a chunk, 0 for none.
`memory_entries` (episode) is the memory's size, reported, not a reward unless weighted.

Splits are disjoint by a hash of the episode's facts (as the arithmetic task's). The demonstrations
(`demonstration`) come from a scripted expert run through the environment; `skip_frac` of the chunks
(picked by a hash) are left unstored (`[]`) and `partial_frac` stored only in part (the first fact), so an SFT
policy learns to leave facts out that often and RL can learn that storing them pays (as the arithmetic task's
direct_answer_frac).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

from ..components.sampling.environment import Observation
from .arithmetic import SPLITS, hash_unit, split_of

NAMES = ("ann", "bob", "cal", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lee", "max",
         "ned", "oli", "pam", "ray", "sam", "tom", "uma", "val", "wes", "xia", "zoe")
"""Fact names (one word each, lower case)."""
TOOLS = ("memory_insert", "memory_update", "memory_delete")
ARGUMENTS = {"memory_insert": {"content": str}, "memory_update": {"id": int, "content": str},
             "memory_delete": {"id": int}}
"""Each tool's arguments and their JSON types (all required, no others)."""
WORD_RE = re.compile(r"[a-z]+|\d+")
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
NO_CALL = "[]"
"""The expert's turn when it stores nothing."""
VARIANTS = {"memory_agent": "json", "memory_agent_qwen": "qwen"}
"""Task name (the rows' source) -> how its calls are written: json (the JSON object alone: compact, for the tiny
character model; no system message) or qwen (Qwen2.5's `<tool_call>` blocks, after a system message listing the tools
as Qwen2.5's chat template lists them)."""
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "memory_insert", "description": "Store a new memory entry.",
                                      "parameters": {"type": "object", "properties": {"content": {"type": "string"}},
                                                     "required": ["content"]}}},
    {"type": "function", "function": {"name": "memory_update", "description": "Replace the content of entry id.",
                                      "parameters": {"type": "object", "properties": {
                                          "id": {"type": "integer"}, "content": {"type": "string"}},
                                          "required": ["id", "content"]}}},
    {"type": "function", "function": {"name": "memory_delete", "description": "Delete entry id.",
                                      "parameters": {"type": "object", "properties": {"id": {"type": "integer"}},
                                                     "required": ["id"]}}},
]
"""The tools as OpenAI-style function schemas (what Qwen2.5's template renders inside <tools>)."""
QWEN_SYSTEM = (
    "Store the facts of each message in memory with the tools; at the end, questions about every name are answered "
    "from the memory alone.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOL_SCHEMAS) + "\n</tools>\n\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
"""The qwen variant's system message (Qwen2.5's own tool preamble, bpe_tokenizer.QWEN25_CHAT_TEMPLATE, after the task)."""


@dataclass
class MemoryAgentConfig:
    num_chunks: int = 2
    """Chunks (policy turns) per episode."""
    facts_per_chunk: int = 2
    """Facts `name number` per chunk; every name of an episode is asked about at the end."""
    revise_frac: float = 0.0
    """Chance that a fact of a later chunk gives a new number to a name of an earlier one (the expert then calls
    memory_update on the entry that holds it)."""
    skip_frac: float = 0.6
    """Fraction of chunks the demonstrations leave unstored (`[]`; picked by a hash): imperfect SFT data."""
    partial_frac: float = 0.0
    """Fraction of chunks the demonstrations store only in part, the chunk's first fact (picked by the same hash
    after skip_frac's): imperfect SFT data that still copies."""
    max_action_chars: int = 1000
    """A longer turn is not parsed (error observation, no credit)."""
    max_calls: int = 4
    """Most tool calls in one turn; more is an error (none run)."""
    max_entries: int = 16
    """Most memory entries; an insert beyond them fails."""
    max_entry_chars: int = 200
    """Longest entry content; a longer insert or update fails."""
    max_error_chars: int = 80
    """Error messages in observations are cut to this many characters."""

    def __post_init__(self):
        from ..errors import ConfigError

        for key in ("num_chunks", "facts_per_chunk", "max_action_chars", "max_calls", "max_entries",
                    "max_entry_chars", "max_error_chars"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"memory_agent.{key} is {getattr(self, key)!r}; it must be an integer of at least 1.")
        for key in ("revise_frac", "skip_frac", "partial_frac"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"memory_agent.{key}={getattr(self, key)} must be in [0, 1].")
        if self.skip_frac + self.partial_frac > 1.0:
            raise ConfigError(f"memory_agent.skip_frac + partial_frac = {self.skip_frac + self.partial_frac:g}: a chunk "
                              "is skipped or stored in part, not both: lower one of them so the sum is at most 1.")
        if self.num_chunks * self.facts_per_chunk > len(NAMES):
            raise ConfigError(f"memory_agent: num_chunks x facts_per_chunk = {self.num_chunks * self.facts_per_chunk} "
                              f"names, but there are {len(NAMES)}; lower one of them.")


# --- episodes -------------------------------------------------------------------------------------

@dataclass
class Episode:
    prompt_id: str
    chunks: list[list[tuple[str, int]]]
    """Each chunk's facts (name, number), in order."""

    @property
    def answers(self) -> dict[str, int]:
        """Every name's number after the last chunk (a later fact overrides an earlier one)."""
        out: dict[str, int] = {}
        for chunk in self.chunks:
            out.update(chunk)
        return out

    def truth_after(self, k: int) -> dict[str, int]:
        """Every name's number after chunk k."""
        out: dict[str, int] = {}
        for chunk in self.chunks[:k + 1]:
            out.update(chunk)
        return out

    def to_json(self) -> str:
        return json.dumps({"chunks": [[[n, v] for n, v in c] for c in self.chunks]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, prompt_id: str, text: str) -> "Episode":
        from ..errors import DataError

        try:
            spec = json.loads(text)
            chunks = [[(str(n), int(v)) for n, v in c] for c in spec["chunks"]]
        except (TypeError, ValueError, KeyError) as e:
            raise DataError(f"prompt {prompt_id!r}: its answer is not a memory_agent episode "
                            f"({{\"chunks\": [[[name, number], ...], ...]}}): {e}") from None
        if not chunks or any(not c for c in chunks):
            raise DataError(f"prompt {prompt_id!r}: a memory_agent episode needs at least one chunk, none empty.")
        return cls(prompt_id, chunks)


def chunk_text(chunk: list[tuple[str, int]]) -> str:
    """What the policy reads for a chunk: `ann 42, bob 17`."""
    return ", ".join(f"{n} {v}" for n, v in chunk)


def generate(n: int, seed: int = 0, split: str = "train", cfg: MemoryAgentConfig | None = None) -> list[Episode]:
    """`n` distinct episodes of `split`, deterministic in (seed, split, cfg)."""
    cfg = cfg or MemoryAgentConfig()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {list(SPLITS)}")
    rng = random.Random(f"memory:{seed}:{split}")
    out, seen = [], set()
    while len(out) < n:
        names = rng.sample(NAMES, cfg.num_chunks * cfg.facts_per_chunk)
        chunks = []
        for k in range(cfg.num_chunks):
            chunk = [(name, rng.randint(10, 99)) for name in names[k * cfg.facts_per_chunk:(k + 1) * cfg.facts_per_chunk]]
            if k and rng.random() < cfg.revise_frac:  # a name of an earlier chunk gets a new number
                old = rng.choice([nm for c in chunks for nm, _ in c])
                value = rng.choice([v for v in range(10, 100) if v != dict(p for c in chunks for p in c)[old]])
                chunk[rng.randrange(len(chunk))] = (old, value)
            chunks.append(chunk)
        identity = "|".join(chunk_text(c) for c in chunks)
        if identity in seen or split_of("memory:" + identity) != split:
            continue
        seen.add(identity)
        out.append(Episode("mem-" + hashlib.sha1(identity.encode()).hexdigest()[:12], chunks))
    return out


# --- the memory and its retriever -----------------------------------------------------------------

def words(text: str) -> list[str]:
    """The retriever's tokens: lower-case words and numbers."""
    return WORD_RE.findall(text.lower())


def pairs(text: str) -> list[tuple[str, int]]:
    """(name, number) pairs a text states, in order: a known name directly followed by a number."""
    w = words(text)
    return [(a, int(b)) for a, b in zip(w, w[1:]) if a in NAMES and b.isdigit() and len(b) <= 6]


def retrieve(memory: dict[int, str], order: list[int], name: str) -> int | None:
    """The number the memory gives for `name`: in the most recently written entry (`order`: entry ids, oldest
    write first) holding `name` as a word, the first number after it; None when no entry answers."""
    for entry_id in reversed(order):
        w = words(memory[entry_id])
        for i, tok in enumerate(w):
            if tok == name:
                number = next((t for t in w[i + 1:] if t.isdigit()), None)
                return int(number) if number is not None and len(number) <= 6 else None
    return None


# --- the environment ------------------------------------------------------------------------------

class ToolError(ValueError):
    """A call that cannot run: its message goes back to the policy."""


def parse_calls(action: str, cfg: MemoryAgentConfig) -> list:
    """The turn's calls as parsed JSON values (each still to be checked), or ToolError for a malformed turn."""
    if len(action) > cfg.max_action_chars:
        raise ToolError(f"turn longer than {cfg.max_action_chars} characters")
    blocks = TOOL_CALL_RE.findall(action)
    texts = blocks if blocks else [action.strip()]
    calls = []
    for text in texts:
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise ToolError("JSON nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, an over-long integer, NaN/Infinity
            raise ToolError(f"not a JSON tool call ({getattr(e, 'msg', e)})") from None
        if blocks and not isinstance(value, dict):
            raise ToolError("a <tool_call> must hold one JSON object")
        calls += value if isinstance(value, list) else [value]
    if len(calls) > cfg.max_calls:
        raise ToolError(f"{len(calls)} calls in one turn; at most {cfg.max_calls}")
    return calls


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


def check_call(call) -> tuple[str, dict]:
    """(tool, arguments) of a well-formed call, else ToolError."""
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        raise ToolError('a call is {"name": TOOL, "arguments": {...}}')
    name, args = call["name"], call["arguments"]
    if not isinstance(name, str) or name not in ARGUMENTS:
        raise ToolError(f"unknown tool {str(name)[:30]!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(args, dict):
        raise ToolError(f"{name}: arguments must be a JSON object")
    want = ARGUMENTS[name]
    if set(args) != set(want):
        raise ToolError(f"{name} takes {', '.join(want)}")
    for key, typ in want.items():
        # bool is an int in Python, not in JSON's sense of an id
        if not isinstance(args[key], typ) or isinstance(args[key], bool):
            raise ToolError(f"{name}: {key} must be {'a string' if typ is str else 'an integer'}")
    return name, args


class MemoryEnvironment:
    """One episode of the memory-agent task (a fresh instance per episode; rollout's `environment.factory`
    `prmflow.tasks.memory_agent:MemoryEnvironment`, called with `environment.config`: MemoryAgentConfig keys)."""

    def __init__(self, config: dict | None = None):
        from ..errors import ConfigError

        known = set(MemoryAgentConfig.__dataclass_fields__)
        unknown = sorted(set(config or {}) - known)
        if unknown:
            raise ConfigError(f"environment.config: unknown memory_agent key(s) {unknown}; known: {sorted(known)}.")
        self.cfg = MemoryAgentConfig(**(config or {}))
        self.episode: Episode | None = None

    def reset(self, prompt: dict) -> list[dict]:
        self.episode = Episode.from_json(str(prompt.get("prompt_id")), prompt.get("answer") or "")
        self.call_format = VARIANTS.get(prompt.get("source") or "", "json")  # how the expert writes (both are read)
        self.memory: dict[int, str] = {}
        self.order: list[int] = []  # entry ids, oldest write first
        self.next_id = 0
        self.turn = 0
        system = [{"role": "system", "content": QWEN_SYSTEM}] if self.call_format == "qwen" else []
        return system + [{"role": "user", "content": chunk_text(self.episode.chunks[0])}]

    def step(self, action: str) -> Observation:
        if self.episode is None:
            raise RuntimeError("step() before reset()")
        if self.turn >= len(self.episode.chunks):
            raise RuntimeError("step() after the episode is done")
        written: list[str] = []
        try:
            calls = parse_calls(action, self.cfg)
        except ToolError as e:
            calls, results, ok = [], [self._error(e)], 0
        else:
            results, ok = [], 0
            for call in calls:
                try:
                    results.append(self._run(*check_call(call), written))
                    ok += 1
                except ToolError as e:
                    results.append(self._error(e))
        k, self.turn = self.turn, self.turn + 1
        rewards = {"tool_success": ok / len(calls) if calls else 0.0,
                   "content_quality": self._quality(written, k)}
        done = self.turn >= len(self.episode.chunks)
        if done:
            return Observation("", rewards, True)
        report = "; ".join(results) if results else "no call"
        return Observation(report + "\n" + chunk_text(self.episode.chunks[self.turn]), rewards, False)

    def outcome(self) -> dict[str, float]:
        answers = self.episode.answers
        right = sum(retrieve(self.memory, self.order, name) == value for name, value in answers.items())
        chunk_chars = sum(len(chunk_text(c)) for c in self.episode.chunks)
        memory_chars = sum(len(c) for c in self.memory.values())
        return {"qa_accuracy": right / len(answers),
                "compression": min(1.0, max(0.0, 1.0 - memory_chars / chunk_chars)),
                "memory_entries": float(len(self.memory))}

    # tools
    def _run(self, tool: str, args: dict, written: list[str]) -> str:
        if tool == "memory_insert":
            if len(self.memory) >= self.cfg.max_entries:
                raise ToolError(f"memory full ({self.cfg.max_entries} entries)")
            entry_id, self.next_id = self.next_id, self.next_id + 1
            self._write(entry_id, args["content"], written)
            return f"ok id {entry_id}"
        if args["id"] not in self.memory:
            raise ToolError(f"no entry id {args['id']}")
        if tool == "memory_update":
            self._write(args["id"], args["content"], written)
        else:
            del self.memory[args["id"]]
            self.order.remove(args["id"])
        return "ok"

    def _write(self, entry_id: int, content: str, written: list[str]) -> None:
        if not content.strip():
            raise ToolError("content is empty")
        if len(content) > self.cfg.max_entry_chars:
            raise ToolError(f"content longer than {self.cfg.max_entry_chars} characters")
        self.memory[entry_id] = content
        if entry_id in self.order:
            self.order.remove(entry_id)
        self.order.append(entry_id)
        written.append(content)

    def _quality(self, written: list[str], k: int) -> float:
        stated = {p for c in written for p in pairs(c)}
        truth = self.episode.truth_after(k)
        true = sum(truth.get(n) == v for n, v in stated)
        return true / max(len(stated), len(self.episode.chunks[k]))

    def _error(self, e: ToolError) -> str:
        return "error: " + str(e)[:self.cfg.max_error_chars]


# --- the scripted expert and its demonstrations ---------------------------------------------------

def call_text(tool: str, arguments: dict, call_format: str = "json") -> str:
    """One call as the expert writes it."""
    if call_format == "qwen":  # Qwen2.5's chat template writes tool calls this way
        return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"
    return json.dumps({"name": tool, "arguments": arguments}, separators=(",", ":"))


def expert_action(env: MemoryEnvironment, skip: bool = False, partial: bool = False) -> str:
    """The expert's turn for the chunk the environment shows now: update the entry holding a name the chunk
    revises, insert the chunk's new facts as one entry; `[]` when `skip`; with `partial`, the chunk's first fact
    alone."""
    if skip:
        return NO_CALL
    k, fmt = env.turn, env.call_format
    chunk = env.episode.chunks[k][:1] if partial else env.episode.chunks[k]
    news = dict(chunk)
    fresh, holders = [], []
    for name, value in chunk:
        holder = next((i for i in reversed(env.order) if name in words(env.memory[i])), None)
        if holder is None:
            fresh.append((name, value))
        elif holder not in holders:
            holders.append(holder)
    calls = [("memory_insert", {"content": chunk_text(fresh)})] if fresh else []
    calls += [("memory_update", {"id": i, "content": chunk_text([(n, news.get(n, v)) for n, v in pairs(env.memory[i])])})
              for i in holders]
    texts = [call_text(t, a, fmt) for t, a in calls]
    if fmt == "qwen":
        return "\n".join(texts)
    return texts[0] if len(texts) == 1 else "[" + ",".join(texts) + "]"


def demonstration(episode: Episode, cfg: MemoryAgentConfig | None = None, task: str = "memory_agent") -> list[dict]:
    """The expert's episode of `task` (a VARIANTS name) as chat messages [(system,) user, assistant, tool, assistant,
    ...], run through the environment (every observation is the environment's own); `cfg.skip_frac` of the chunks
    unstored, `cfg.partial_frac` stored in part."""
    cfg = cfg or MemoryAgentConfig()
    env = MemoryEnvironment({k: getattr(cfg, k) for k in MemoryAgentConfig.__dataclass_fields__})
    messages = env.reset({"prompt_id": episode.prompt_id, "answer": episode.to_json(), "source": task})
    while True:
        u = hash_unit(f"skip:{episode.prompt_id}:{env.turn}")
        action = expert_action(env, skip=u < cfg.skip_frac, partial=u < cfg.skip_frac + cfg.partial_frac)
        obs = env.step(action)
        messages.append({"role": "assistant", "content": action})
        if obs.done:
            return messages
        messages.append({"role": "tool", "content": obs.text})


def records(n: int, seed: int = 0, split: str = "train", cfg: MemoryAgentConfig | None = None,
            task: str = "memory_agent"):
    """PromptRecords of `n` episodes of `task` (a VARIANTS name, the rows' source): prompt = the first chunk, answer =
    the episode (JSON, what the environment reads); the expert's demonstration is the SFT target as a chat dataset's
    row holds one: messages = every message but the last assistant turn, response = that turn (SFT trains every
    assistant turn: training/supervised_data.episode_tokens)."""
    from . import PromptRecord

    cfg = cfg or MemoryAgentConfig()
    out = []
    for e in generate(n, seed, split, cfg):
        demo = demonstration(e, cfg, task)
        out.append(PromptRecord(e.prompt_id, chunk_text(e.chunks[0]), e.to_json(), demo[-1]["content"], demo[:-1], task))
    return out


def demonstration_of(record) -> list[dict]:
    """A record's whole demonstration (its messages and its response, the last assistant turn)."""
    return list(record.messages) + [{"role": "assistant", "content": record.response}]


# --- step-labelled episodes for a PRM -------------------------------------------------------------

def turn_steps(actions: list[str], observations: list[str], separator: str = "\n") -> list[str]:
    """An episode as a PRM reads it, one step per policy turn: the observation before turn k (none for the first)
    and the turn's text, whitespace and separators collapsed to single spaces (rollout's episode text)."""
    def clean(s: str) -> str:
        return " ".join(s.replace(separator, " ").split())
    return [((clean(observations[k - 1]) + " " if k else "") + clean(a)).strip() or "(empty turn)"
            for k, a in enumerate(actions)]


def flawed_turn(env: MemoryEnvironment, rng: random.Random) -> str:
    """A plausible bad turn for the chunk shown now: skipped, half stored, a wrong number, or cut JSON."""
    chunk = env.episode.chunks[env.turn]
    kind = rng.randrange(4)
    if kind == 0:
        return NO_CALL
    if kind == 1 and len(chunk) > 1:
        return call_text("memory_insert", {"content": chunk_text(chunk[:1])}, env.call_format)
    if kind == 3:
        return expert_action(env)[:-3]
    wrong = [(n, v if i else (v - 10 + 10) % 90 + 10) for i, (n, v) in enumerate(chunk)]  # the first, 10 off
    return call_text("memory_insert", {"content": chunk_text(wrong)}, env.call_format)


def step_examples(n: int, seed: int = 0, split: str = "train", cfg: MemoryAgentConfig | None = None,
                  task: str = "memory_agent", separator: str = "\n") -> list[dict]:
    """Step-labelled episodes for a PRM: for each of n episodes the expert's (every turn labelled 1) and one with a
    flawed turn at a random position (labels 1 before it, 0 from it on: the episode can no longer answer every
    question, the Math-Shepherd convention); rows {prompt, steps, labels, answer, prompt_id, source}."""
    cfg = cfg or MemoryAgentConfig()
    rng = random.Random(f"memory-prm:{seed}:{split}")
    out = []
    for e in generate(n, seed, split, cfg):
        for bad in (None, rng.randrange(len(e.chunks))):
            env = MemoryEnvironment({k: getattr(cfg, k) for k in MemoryAgentConfig.__dataclass_fields__})
            env.reset({"prompt_id": e.prompt_id, "answer": e.to_json(), "source": task})
            actions, observations = [], []
            while True:
                actions.append(flawed_turn(env, rng) if env.turn == bad else expert_action(env))
                obs = env.step(actions[-1])
                if obs.done:
                    break
                observations.append(obs.text)
            labels = [1.0 if bad is None or k < bad else 0.0 for k in range(len(actions))]
            out.append({"prompt": chunk_text(e.chunks[0]), "steps": turn_steps(actions, observations, separator),
                        "labels": labels, "answer": e.to_json(), "prompt_id": e.prompt_id, "source": task})
    return out
