"""The built-in arithmetic reasoning task: chains of operations solved one step per line.

    prompt:   "Compute left to right: 7+5*3-4\n"
    solution: "7+5=12\n12*3=36\n36-4=32\nanswer: 32"

Every step is checkable exactly: step k must read `a<op>b=c` where `a` is the previous result
(the first number for k = 0), `<op>b` is the k-th operation of the problem and `c` its value. The
last line `answer: N` is the final step, correct when N is the true result. A shortcut step merges
two consecutive operations into one line, `a<op1>b<op2>c=d` computed left to right
(`7+5*3=36`): it is one step, right when it names those two operations from the previous result
and d is their value (demonstrations take shortcuts when `shortcut_frac` > 0). A step after the first
wrong one is labelled wrong too (the convention of Math-Shepherd and PRM800K: once a prefix is
wrong the solution cannot recover), so the labels of a solution are 1...1 0...0.

Splits are disjoint by construction: a problem belongs to the split chosen by a hash of its text,
so the same problem never appears in two splits, whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

PROMPT_PREFIX = "Compute left to right: "
ANSWER_PREFIX = "answer: "
STEP_SEPARATOR = "\n"
SPLITS = {"train": range(0, 8), "eval": range(8, 9), "test": range(9, 10)}

STEP_RE = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
"""A computation step `a<op>b=c`; groups a, op, b, c (shared with the visual task)."""
SHORTCUT_RE = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
"""A shortcut step `a<op1>b<op2>c=d` (two operations, left to right); groups a, op1, b, op2, c, d."""
ANSWER_RE = re.compile(r"^\s*answer\s*:\s*(-?\d+)\s*$", re.IGNORECASE)
"""The final `answer: N` line with an integer N; group N (shared with the visual task)."""


@dataclass
class ArithmeticConfig:
    min_ops: int = 2
    """Fewest operations in a problem (a problem with k operations has k+1 steps, the answer included)."""
    max_ops: int = 3
    """Most operations in a problem."""
    max_operand: int = 9
    """Operands are drawn from 1..max_operand (multipliers from 2..min(max_operand, 5))."""
    max_value: int = 200
    """Reject problems whose intermediate results leave 0..max_value (keeps numbers short)."""
    direct_answer_frac: float = 0.0
    """Fraction of problems whose reference solution is the `answer: N` line alone, with no working
    (picked by a hash of the problem, so the same problems in every run). Warm-up data from a mixed
    source: SFT learns to skip the steps that often, and RL can learn that working them out pays."""
    prompt_prefix: str = PROMPT_PREFIX
    """Text before the expression in every prompt (`Compute left to right: 7+5*3-4`); an instruct model reads it, a tiny
    character-level preset only pays its 23 tokens (the quickstart sets ''). Every stage of a pipeline must use the same
    prefix."""
    shortcut_frac: float = 0.0
    """Chance that a step of a reference solution merges the next two operations into one line (`7+5*3=36`; picked by a
    hash of the problem and the step); the checker accepts a right one as one step. A risky habit for RL to unlearn:
    docs/results.md#long-chains-with-a-risky-shortcut."""

    def __post_init__(self):
        if not 0.0 <= self.direct_answer_frac <= 1.0:
            from ..errors import ConfigError

            raise ConfigError(f"arithmetic.direct_answer_frac={self.direct_answer_frac} must be in [0, 1].")
        if not 0.0 <= self.shortcut_frac <= 1.0:
            from ..errors import ConfigError

            raise ConfigError(f"arithmetic.shortcut_frac={self.shortcut_frac} must be in [0, 1].")
        last = self.prompt_prefix[-1:]
        if last and (last.isdigit() or last in "+-*" or "\n" in self.prompt_prefix):
            from ..errors import ConfigError

            raise ConfigError(f"arithmetic.prompt_prefix={self.prompt_prefix!r} must not end with a digit or an "
                              f"operator, nor hold a newline (the checker reads the expression at the prompt's end).")


@dataclass
class Problem:
    prompt_id: str
    prompt: str
    answer: str
    start: int
    ops: list[tuple[str, int]]
    steps: list[str] = field(default_factory=list)

    @property
    def solution(self) -> str:
        return STEP_SEPARATOR.join(self.steps)


def apply_op(a: int, op: str, b: int) -> int:
    """The value of `a op b` for op in + - *."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def solve(start: int, ops: list[tuple[str, int]], merge: list[bool] | None = None) -> tuple[list[str], int]:
    """(solution lines, result) of (start, ops): one operation per line, except that operation i and i+1
    share one line (a shortcut, left to right) when merge[i] (and operation i is not itself the second half
    of a merged line, nor the last operation); then the `answer: N` line."""
    steps, value, i = [], start, 0
    while i < len(ops):
        take = 2 if merge and merge[i] and i + 1 < len(ops) else 1
        nxt = _value_after(value, ops[i:i + take])
        steps.append(str(value) + "".join(f"{op}{b}" for op, b in ops[i:i + take]) + f"={nxt}")
        value, i = nxt, i + take
    steps.append(f"{ANSWER_PREFIX}{value}")
    return steps, value


def is_shortcut(step: str) -> bool:
    """The step merges two operations into one line (`a<op1>b<op2>c=d`)."""
    return SHORTCUT_RE.match(step) is not None


def split_of(text: str) -> str:
    """The split a problem belongs to, fixed by a hash of its identity `text` (so splits never overlap)."""
    bucket = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 10
    return next(name for name, r in SPLITS.items() if bucket in r)


def hash_unit(text: str) -> float:
    """A number in [0, 1) fixed by `text`."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16) / 16 ** 13


def generate(n: int, seed: int = 0, split: str = "train", cfg: ArithmeticConfig | None = None) -> list[Problem]:
    """`n` distinct problems of `split`, deterministic in (seed, split, cfg)."""
    cfg = cfg or ArithmeticConfig()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {list(SPLITS)}")
    rng = random.Random(f"{seed}:{split}")
    out: list[Problem] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            from ..errors import ConfigError

            raise ConfigError(
                f"the arithmetic task's '{split}' split has about {len(out)} distinct problems with arithmetic.min_ops="
                f"{cfg.min_ops}, max_ops={cfg.max_ops}, max_operand={cfg.max_operand}, max_value={cfg.max_value}, "
                f"and {n} were asked for (the stage's num_prompts): ask for at most {len(out)}, or widen "
                f"arithmetic.max_ops, arithmetic.max_operand or arithmetic.max_value.")
        start = rng.randint(1, cfg.max_operand)
        ops, value, ok = [], start, True
        for _ in range(rng.randint(cfg.min_ops, cfg.max_ops)):
            op = rng.choice("+-*")
            b = rng.randint(2, min(cfg.max_operand, 5)) if op == "*" else rng.randint(1, cfg.max_operand)
            value = apply_op(value, op, b)
            if not 0 <= value <= cfg.max_value:
                ok = False
                break
            ops.append((op, b))
        if not ok:
            continue
        expr = str(start) + "".join(f"{op}{b}" for op, b in ops)
        if expr in seen or split_of(expr) != split:
            continue
        seen.add(expr)
        merge = [hash_unit(f"shortcut:{expr}:{i}") < cfg.shortcut_frac for i in range(len(ops))] if cfg.shortcut_frac else None
        steps, value = solve(start, ops, merge)
        if cfg.direct_answer_frac and hash_unit(f"direct:{expr}") < cfg.direct_answer_frac:
            steps = steps[-1:]
        pid = "arith-" + hashlib.sha1(expr.encode()).hexdigest()[:12]
        out.append(Problem(pid, f"{cfg.prompt_prefix}{expr}\n", str(value), start, ops, steps))
    return out


def parse_problem(prompt: str) -> tuple[int, list[tuple[str, int]]] | None:
    """Recover (start, ops) from a prompt produced by `generate`; None if it is not one."""
    m = re.search(r"(-?\d+)((?:[+\-*]\d+)+)\s*$", prompt.strip())
    if not m:
        return None
    return int(m.group(1)), [(op, int(b)) for op, b in re.findall(r"([+\-*])(\d+)", m.group(2))]


def extract_answer(response: str) -> str | None:
    """The number on the last `answer: N` line, or None when there is none (a format error)."""
    for line in reversed(response.strip().split(STEP_SEPARATOR)):
        m = ANSWER_RE.match(line)
        if m:
            return m.group(1)
    return None


def verify(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals `answer`, else 0.0."""
    got = extract_answer(response)
    return 1.0 if got is not None and int(got) == int(answer) else 0.0


def split_steps(response: str) -> list[str]:
    """The response's steps: its non-empty lines, in order."""
    return [line for line in response.split(STEP_SEPARATOR) if line.strip()]


def first_error(prompt: str, response: str) -> int | None:
    """Index (into `split_steps(response)`) of the first wrong step; None if every step is right.

    Each line must do the next operation (`a<op>b=c`) or the next two (a shortcut, `a<op1>b<op2>c=d`)
    from the previous result; after the last operation comes the `answer: N` line. A response that
    stops before its answer line has its first missing step as the error (index = number of steps
    present); anything after the answer line is wrong.
    """
    parsed = parse_problem(prompt)
    if parsed is None:
        raise ValueError(f"not an arithmetic-task prompt: {prompt!r}")
    value, ops = parsed
    steps = split_steps(response)
    i = k = 0  # next operation, next line
    while i < len(ops):
        if k >= len(steps):
            return k
        done = _operations_done(steps[k], value, ops, i)
        if done is None:
            return k
        value = _value_after(value, ops[i:i + done])
        i, k = i + done, k + 1
    if k >= len(steps):
        return k
    m = ANSWER_RE.match(steps[k])
    if not m or int(m.group(1)) != value:
        return k
    if len(steps) > k + 1:
        return k + 1  # anything after the answer line is wrong
    return None


def _value_after(value: int, ops: list[tuple[str, int]]) -> int:
    for op, b in ops:
        value = apply_op(value, op, b)
    return value


def _operations_done(line: str, value: int, ops: list[tuple[str, int]], i: int) -> int | None:
    """How many operations (1, or 2 for a shortcut) `line` rightly does from `value` starting at ops[i]; None if wrong."""
    m = STEP_RE.match(line)
    if m:
        op, b = ops[i]
        ok = [int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))] == [value, op, b, apply_op(value, op, b)]
        return 1 if ok else None
    m = SHORTCUT_RE.match(line)
    if m and i + 1 < len(ops):
        (op1, b1), (op2, b2) = ops[i], ops[i + 1]
        got = [int(m.group(1)), m.group(2), int(m.group(3)), m.group(4), int(m.group(5)), int(m.group(6))]
        return 2 if got == [value, op1, b1, op2, b2, _value_after(value, ops[i:i + 2])] else None
    return None


def step_labels(prompt: str, response: str) -> list[int]:
    """Exact 0/1 label of every step of `response`: 1 up to the first error, 0 from it on."""
    n = len(split_steps(response))
    err = first_error(prompt, response)
    return [1 if err is None or k < err else 0 for k in range(n)]


def corrupt(problem: Problem, rng: random.Random) -> tuple[str, int]:
    """A solution of `problem` with one deliberately wrong step, and the index of that step.

    The error is an off-by-a-little result; later steps compute correctly from the wrong value,
    the realistic shape of a reasoning slip.
    """
    k = rng.randrange(len(problem.ops))
    value = problem.start
    steps = []
    for i, (op, b) in enumerate(problem.ops):
        nxt = apply_op(value, op, b)
        if i == k:
            nxt += rng.choice([-3, -2, -1, 1, 2, 3])
        steps.append(f"{value}{op}{b}={nxt}")
        value = nxt
    steps.append(f"{ANSWER_PREFIX}{value}")
    return STEP_SEPARATOR.join(steps), k
