"""The one grader: does a response reach the reference answer?

The reward recipe's verifier components (rollout) and every reported accuracy (`tasks.verify`: SFT eval,
prm-label, best-of-N, evaluate) call `grade`, so the accuracy we report measures what RL optimizes
(nanochat's tasks own correctness the same way: the RL reward calls the task's `evaluate`).

Each source is graded in its own convention:
- the built-in tasks (arithmetic, visual): the task's exact checker, `arithmetic.verify` (the
  last `answer: N` line must hold the integer N; no line is a format error);
- `gsm8k` (rows of the gsm8k format): GSM8K's own convention: the final answer is the number after
  the first `#### ` (lm-evaluation-harness's strict match, `#### (\\-?[0-9\\.\\,]+)` with its first match
  taken: lm_eval/tasks/gsm8k/gsm8k.yaml, lm_eval/filters/extraction.py RegexFilter group_select=0; we
  also allow a `$` before it: `#### $1,234.` is 1234), else the last \\boxed{...}, else an `answer:`
  line read as its last number, else the last number, compared exactly;
- `math` (MATH, MATH-500, PRM800K): the last \\boxed{...} (or MATH's brace-less `\\boxed 5`, read up to
  the next `$` as lm-evaluation-harness's minerva_math `last_boxed_only_string` does), else a
  `final answer is X` / `answer: X` line; a bare number with neither is no answer (MATH's convention:
  the boxed answer is the answer), compared by `answers_match`;
- anything else (user datasets): `grade_math`'s default: the last \\boxed{...}, else an `answer:`
  line, else GSM8K's `#### N`, else the last number, compared by `answers_match`.
The last-number fallback reads `18, which` as 18 (a comma only joins groups of three digits) and
`so 10-5` as 5 (a minus directly after a digit, letter or bracket is a hyphen, not a sign).
`answer_key` names the answer a response commits to in the same convention (best-of-N's majority vote).

One notion of equal (`answers_match`, `answer_key`): an answer that stands for a rational number is
that number, exactly (0.333333 is not 1/3, in any notation): plain numbers (`-1,234.5`, `3/4`), what
math-verify (https://github.com/huggingface/Math-Verify) parses to a rational (`\\frac{3}{4}`,
`2^{-1}`, `x = 0.75`), a percentage or a trailing unit dropped as MATH's own normalization drops them
(`50\\%` is 50, `18 dollars` is 18: hendrycks/math modeling/math_equivalence.py `_strip_string`).
Two answers where neither is rational (`\\sqrt{2}/2`, intervals, sets, expressions in x) are compared
by math-verify, and keyed by sympy's simplified form. Exact numbers never go through math-verify's
6-digit rounding, which made 0.333333 equal \\frac{1}{3} but not 1/3. The plain-number path takes
microseconds where math-verify's sympy takes milliseconds, which matters when a rollout grades
thousands of responses.

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
_SIGN = r"(?:(?<![\w)\]}])-)?"  # a minus right after a digit, letter or bracket is a hyphen (10-5), not a sign
# a comma only inside thousands groups (18, which -> 18); a trailing /d keeps a bare fraction whole
_ANY_NUMBER = re.compile(_SIGN + r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?|" + _SIGN + r"\.\d+")
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*(.+?)\s*$", re.IGNORECASE)
_FINAL_ANSWER_IS = re.compile(r"final answer is[:\s]*\$?(.+?)\$?\s*(?:\.\s*(?:I hope it is correct\.?)?)?\s*$",
                              re.IGNORECASE | re.MULTILINE)
_GSM8K_MARK = re.compile(r"####\s*\$?\s*(-?[0-9.,]*[0-9])")  # lm-eval's strict match (module docstring), `$` allowed
_PERCENT = re.compile(r"\s*\\?%\s*$")
_UNIT_WORDS = re.compile(r"\s*(\S+)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*)\s*\.?\s*")
_MATH_WORDS = {"pi", "sqrt", "ln", "log", "sin", "cos", "tan", "mod", "and", "or", "infinity", "inf"}
"""Words that are mathematics, not a unit, after a number (`3 pi` is not 3)."""


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

    A rational answer is its exact value (`0.75`, `3/4` and `\\frac{3}{4}` give "3/4", `75\\%` gives
    "75"); another answer math-verify parses is sympy's simplified form; anything else its
    text without spaces. Two keys are equal exactly when `answers_match` says the answers are (module
    docstring), up to math-verify's wider notion of equal between two non-rational expressions.
    """
    if source in EXACT_SOURCES:
        got = arithmetic.extract_answer(response)
        return None if got is None else str(int(got))
    got = final_answer(response, source)
    if got is None:
        return None
    if source == "gsm8k":
        value = last_number(got)
        return None if value is None else str(value)
    value, parsed = answer_value(got)
    if value is not None:
        return str(value)
    if parsed and not isinstance(parsed[0], str):
        return str(_simplified(parsed[0]))
    return re.sub(r"\s+", "", got)


# --- extraction ----------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, with nested braces, or of a brace-less
    `\\boxed 5` (up to the next `$` or line end, as lm-evaluation-harness's minerva_math
    `last_boxed_only_string` reads it); None if none."""
    marks = list(re.finditer(r"\\(?:boxed|fbox)(?:\s*(\{)|\s+(?=[^\s{]))", text))
    if not marks:
        return None
    last = marks[-1]
    if last.group(1) is None:  # \boxed 5
        content = re.split(r"[$\n]", text[last.end():], maxsplit=1)[0].strip().rstrip(".").strip()
        return content or None
    i, depth = last.end(), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(response: str, source: str = "") -> str | None:
    """The answer a response commits to in the convention of `source` (module docstring); by default
    the last \\boxed{}, else an `answer:` line, else `#### x`, else the last number."""
    if source == "gsm8k":
        mark = _GSM8K_MARK.search(response)  # the first `#### N`, as lm-eval's strict match takes it
        if mark:
            return mark.group(1)
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
    return plain_number(numbers[-1]) if numbers else None


def answer_value(text: str) -> tuple[Fraction | None, list | None]:
    """(the exact value of `text` when it stands for a rational number, math-verify's parse of it or None).

    The value comes from a plain number, else from what math-verify parses after a trailing
    percentage or unit words are dropped (MATH's normalization, module docstring): a number with no
    symbol left (`\\frac{1}{3}`, `2^{-1}`, `50\\%` -> 50, `18 dollars` -> 18) or `x = <number>`.
    Decimals inside LaTeX count as the decimals written (0.333333 stays 333333/1000000).
    """
    x = plain_number(text)
    if x is not None:
        return x, None
    s = _PERCENT.sub("", text)
    m = _UNIT_WORDS.fullmatch(s)
    if m and plain_number(m.group(1)) is not None and not set(m.group(2).lower().split()) & _MATH_WORDS:
        s = m.group(1)
    x = plain_number(s)
    if x is not None or len(s) > MAX_ANSWER_CHARS:
        return x, None
    parse, _ = verifier()
    parsed = parse(f"\\boxed{{{s}}}", parsing_timeout=None)
    if not parsed or not all(map(_tractable, parsed)):
        return None, None
    return _rational(parsed[0]), parsed


def answers_match(given: str, reference: str) -> bool:
    """True when `given` equals `reference`: a rational answer (either side) by its exact value, two
    non-rational ones by math-verify (module docstring)."""
    x, pred = answer_value(given)
    y, gold = answer_value(reference)
    if x is not None or y is not None:
        return x == y
    if not (gold and pred):
        return False
    _, verify = verifier()
    return bool(verify(gold, pred, timeout_seconds=None))  # math-verify's order: gold first


def _exact(expr):
    """`expr` with every float replaced by the decimal it was written as (0.5 -> 1/2), as a rational."""
    import sympy

    return expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})


def _rational(expr) -> Fraction | None:
    """The exact value of a parsed answer that is a rational number (or `symbol = rational`), else None."""
    import sympy

    if isinstance(expr, sympy.Equality) and isinstance(expr.lhs, sympy.Symbol):
        expr = expr.rhs  # `x = 2` answers 2, as math-verify reads it
    if not isinstance(expr, sympy.Expr) or not expr.is_number:
        return None
    expr = _exact(expr)
    if expr.is_rational is False:  # sympy's assumptions see sqrt(2)/2 or 2*pi at once; simplify would take ms
        return None
    value = expr if expr.is_Rational else sympy.simplify(expr)
    return Fraction(int(value.p), int(value.q)) if value.is_Rational else None


def _simplified(expr):
    """A parsed non-rational answer in sympy's simplified form (its key); sets, matrices, ... as they are."""
    import sympy

    return sympy.simplify(_exact(expr)) if isinstance(expr, sympy.Expr) else expr


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
