"""The one grader: does a response reach the reference answer?

The reward recipe's verifier components (rollout) and every reported accuracy (`tasks.verify`: SFT eval,
prm-label, best-of-N, evaluate) call `grade`, so the accuracy we report measures what RL optimizes
(nanochat's tasks own correctness the same way: the RL reward calls the task's `evaluate`).

Each source is graded in its own convention:
- the built-in tasks (arithmetic, visual): the task's exact checker, `arithmetic.verify` (the
  last `answer: N` line must hold the integer N; no line is a format error);
- `gsm8k` (rows of the gsm8k format): GSM8K's own convention: the final answer is what follows the
  last `#### ` (else the last \\boxed{...}, else an `answer:` line, else the last number), read as
  its last number (`#### $1,234.` and `#### 1234 dollars` are 1234), compared exactly;
- `math` (MATH, MATH-500, PRM800K): the last \\boxed{...}, else a `final answer is X` / `answer: X`
  line; a bare number with neither is no answer (MATH's convention: the boxed answer is the
  answer), compared by `answers_match` (\\frac{1}{2} = 0.5 = 1/2);
- anything else (user datasets): `grade_math`'s default: the last \\boxed{...}, else an `answer:`
  line, else GSM8K's `#### N`, else the last number, compared by `answers_match`.
`answer_key` names the answer a response commits to in the same convention (best-of-N's majority vote).

`answers_match` compares plain numbers (integers, decimals, a/b fractions, negative, with thousands
separators) exactly as rationals, and everything else (\\frac, \\sqrt, %, degrees, intervals,
expressions) with math-verify (https://github.com/huggingface/Math-Verify). The plain-number
path is exact (0.333333 is not 1/3) and takes microseconds where math-verify's sympy takes
milliseconds, which matters when a rollout grades thousands of responses.

math-verify guards its own work with signal.alarm, which raises outside the main thread and
cancels any other SIGALRM timer (pytest-timeout's, for one). We turn those timeouts off and bound
the work ourselves instead: answers over MAX_ANSWER_CHARS are not parsed, and an expression with a
power whose exponent is itself a power, or an integer over MAX_EXPONENT, is not compared (sympy
would try to evaluate 9^{9^{9^{9}}} for ever); such an answer is graded wrong.
"""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction

from . import arithmetic

MAX_ANSWER_CHARS = 300
"""Longest final answer (characters) handed to math-verify; longer ones are graded wrong."""
MAX_EXPONENT = 10_000
"""Largest integer exponent math-verify may evaluate; a bigger power is graded wrong."""

EXACT_SOURCES = ("arithmetic", "visual")
"""Sources graded by the arithmetic task's exact `answer: N` checker (the visual task shares it)."""

_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_ANY_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")  # a trailing /d keeps a bare fraction whole
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*(.+?)\s*$", re.IGNORECASE)
_FINAL_ANSWER_IS = re.compile(r"final answer is[:\s]*\$?(.+?)\$?\s*(?:\.\s*(?:I hope it is correct\.?)?)?\s*$",
                              re.IGNORECASE | re.MULTILINE)
_GSM8K_MARK = re.compile(r"####\s*([^\n]*)")


def grade(source: str, response: str, answer: str) -> float:
    """1.0 when `response` reaches `answer` in the convention of `source` (see the module docstring), else 0.0."""
    if source in EXACT_SOURCES:
        return arithmetic.verify(response, answer)
    return grade_math(response, answer, source)


def grade_math(response: str, answer: str, source: str = "") -> float:
    """1.0 when the response's final answer equals `answer` in the convention of a dataset `source`
    (gsm8k, math, else the default; numbers exactly, LaTeX by math-verify), else 0.0."""
    got = final_answer(response, source)
    if got is None:
        return 0.0
    if source == "gsm8k":
        x, y = last_number(got), plain_number(answer)
        return 1.0 if x is not None and y is not None and x == y else 0.0
    return 1.0 if answers_match(got, answer) else 0.0


def answer_key(source: str, response: str) -> str | None:
    """A canonical text of the answer `response` commits to (equal keys: the same answer, for majority
    votes), in the convention of `source`; None when it commits to none (a format error).

    Plain numbers and what math-verify parses become the value's text (`0.75`, `3/4` and `\\frac{3}{4}`
    all give "3/4"); anything else its text without spaces.
    """
    if source in EXACT_SOURCES:
        got = arithmetic.extract_answer(response)
        return None if got is None else str(int(got))
    got = final_answer(response, source)
    if got is None:
        return None
    value = last_number(got) if source == "gsm8k" else plain_number(got)
    if value is not None:
        return str(value)
    if len(got) <= MAX_ANSWER_CHARS:
        parse, _ = verifier()
        parsed = parse(f"\\boxed{{{got}}}", parsing_timeout=None)
        if parsed and _tractable(parsed[0]) and not isinstance(parsed[0], str):
            return str(parsed[0])
    return re.sub(r"\s+", "", got)


# --- extraction ----------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, with nested braces; None if none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(response: str, source: str = "") -> str | None:
    """The answer a response commits to in the convention of `source` (module docstring); by default
    the last \\boxed{}, else an `answer:` line, else `#### x`, else the last number."""
    if source == "gsm8k":
        marks = _GSM8K_MARK.findall(response)
        if marks and marks[-1].strip():
            return marks[-1].strip()
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    if source == "math":
        m = list(_FINAL_ANSWER_IS.finditer(response))
        if m:
            return m[-1].group(1)
    for line in reversed(response.strip().splitlines()):
        m = _ANSWER_LINE.match(line)
        if m:
            return m.group(1)
    if source == "math":
        return None
    m = re.search(r"####\s*(.+?)\s*$", response.strip())
    if m:
        return m.group(1)
    numbers = _ANY_NUMBER.findall(response)
    return numbers[-1] if numbers else None


# --- comparison ----------------------------------------------------------------------------------

def plain_number(text: str) -> Fraction | None:
    """The exact value of `text` when it is a plain number (`-1,234.5`, `3/4`, `$7$`, `12.`); None otherwise."""
    s = re.sub(r"\s+", "", text).strip("$").rstrip(".")
    num, slash, den = s.partition("/")
    if not _PLAIN_NUMBER.fullmatch(num) or (slash and not re.fullmatch(r"\d+", den)):
        return None
    value = Fraction(num.replace(",", ""))
    if slash:
        return value / int(den) if int(den) else None
    return value


def last_number(text: str) -> Fraction | None:
    """The exact value of the last plain number in `text` (`$1,234.` -> 1234, `18 dollars` -> 18); None if none."""
    numbers = _ANY_NUMBER.findall(text)
    return plain_number(numbers[-1].rstrip(",")) if numbers else None


def answers_match(given: str, reference: str) -> bool:
    """True when `given` equals `reference`: plain numbers as exact rationals, anything else by math-verify."""
    x, y = plain_number(given), plain_number(reference)
    if x is not None and y is not None:
        return x == y
    if max(len(given), len(reference)) > MAX_ANSWER_CHARS:
        return False
    parse, verify = verifier()
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    pred = parse(f"\\boxed{{{given}}}", parsing_timeout=None)
    if not (gold and pred) or not all(map(_tractable, gold + pred)):
        return False
    return bool(verify(gold, pred, timeout_seconds=None))  # math-verify's order: gold first


def _tractable(expr) -> bool:
    """Whether sympy can compare `expr` in bounded time (no tower of powers, no huge integer exponent)."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return True  # an unparsed string: compared as text
    for power in expr.atoms(sympy.Pow):
        if power.exp.has(sympy.Pow) or (power.exp.is_Integer and abs(power.exp) > MAX_EXPONENT):
            return False
    return True


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; we bound the work ourselves (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def verifier():
    """math-verify's (parse, verify), imported on first use (it brings sympy: about a second)."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutWarning())
    return parse, verify
