"""A visual reasoning task: read two digits from an image, combine them, answer.

    image:    two digits, `left` in the left half and `right` in the right half (RGB PNG bytes)
    prompt:   "Compute left+right with the two digits shown.\n"   (op one of + - *)
    solution: "read: 3 7\n3+7=10\nanswer: 10"

Every step is checkable exactly, as in the arithmetic task (whose answer line, step separator and
labelling convention it shares): step 0 must read `read: L R` with the true digits, step 1
`L<op>R=V` with the true digits and value, step 2 `answer: V`. Labels are 1...1 0...0 from the
first wrong step on; a response that stops early has its first missing step as the error, and a
line after the answer is wrong. A bare `answer: N` response (a direct answer) is labelled [0]
whether N is right or not, because its one step is not the read step: the arithmetic task does
the same with a bare answer line (its step 0 must be a computation). `verify` still scores a right
bare answer 1.0.

There are only 10 * 10 * len(ops) (left, op, right) combinations, so a problem is a combination
plus a rendering variant, and its split is chosen by a hash of that rendering identity: held-out
splits hold new images of combinations the model may have trained on, testing the reading of new
renderings (the arithmetic facts are the same). The image is a function of the identity (and of
the image size and jitter), so no image is in two splits.

The prompt_id `vis-{left}{code}{right}-{12 hex}` (code p/m/t for + - *) encodes the combination so
that the checker works from the id alone (`parse_id`); the model never sees it, only the image and
the prompt text.
"""

from __future__ import annotations

import functools
import hashlib
import io
import random
import re
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

from .arithmetic import (
    ANSWER_PREFIX,
    ANSWER_RE,
    SPLITS,
    STEP_RE,
    STEP_SEPARATOR,
    apply_op,
    extract_answer,  # noqa: F401  (re-exported: this task's API, as arithmetic's)
    hash_unit,
    split_of,
    split_steps,
    verify,  # noqa: F401  (re-exported, as extract_answer)
)

_OP_CODES = {"+": "p", "-": "m", "*": "t"}
_CODE_OPS = {c: op for op, c in _OP_CODES.items()}
_ID_RE = re.compile(r"^vis-(\d)([pmt])(\d)-[0-9a-f]{12}$")
_READ_RE = re.compile(r"^\s*read\s*:\s*(\d+)\s+(\d+)\s*$", re.IGNORECASE)


@dataclass
class VisualConfig:
    ops: str = "+-*"
    """The operations drawn from, a string of + - * (each problem uses one)."""
    image_size: int = 56
    """Side of the square images in pixels; a multiple of 28."""
    jitter: int = 2
    """Largest random shift, in pixels, of each digit from the centre of its half (x and y)."""
    direct_answer_frac: float = 0.0
    """Fraction of problems whose reference solution is the `answer: N` line alone, with no working
    (picked by a hash of the problem, so the same problems in every run), as in the arithmetic task."""

    def __post_init__(self):
        from ..errors import ConfigError

        if not self.ops or set(self.ops) - set(_OP_CODES):
            raise ConfigError(f"visual.ops={self.ops!r} must be a non-empty string of the operations + - *.")
        if self.image_size < 28 or self.image_size % 28:
            raise ConfigError(f"visual.image_size={self.image_size} must be a multiple of 28 (28, 56, 84, ...).")
        if self.jitter < 0:
            raise ConfigError(f"visual.jitter={self.jitter} must be >= 0.")
        if not 0.0 <= self.direct_answer_frac <= 1.0:
            raise ConfigError(f"visual.direct_answer_frac={self.direct_answer_frac} must be in [0, 1].")


@dataclass
class Problem:
    prompt_id: str
    prompt: str
    answer: str
    left: int
    right: int
    op: str
    steps: list[str] = field(default_factory=list)
    image: bytes = field(default=b"", repr=False)
    """RGB PNG bytes."""

    @property
    def solution(self) -> str:
        return STEP_SEPARATOR.join(self.steps)


def solve(left: int, op: str, right: int) -> tuple[list[str], int]:
    """The reference steps and the value of `left op right`."""
    value = apply_op(left, op, right)
    return [f"read: {left} {right}", f"{left}{op}{right}={value}", f"{ANSWER_PREFIX}{value}"], value


@functools.lru_cache(maxsize=None)
def _font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's built-in font (no files, no downloads) at `size` pixels, loaded once per size."""
    return ImageFont.load_default(size=size)


def render_image(left: int, right: int, size: int, rng: random.Random, jitter: int = 2) -> bytes:
    """PNG bytes of a size x size RGB image: `left` and `right` each in a dark random gray on a
    light random gray background, in a random font size, centred in its own square cell of the top
    half (side size/2) and shifted by up to `jitter` pixels (less where the digit would leave its
    cell); the bottom half stays empty. One digit per cell means a vision tower whose patches are
    cells (the tiny VL preset: 28-pixel patches) sees each digit whole in one patch; a digit split
    across two patches took the tiny model far longer to learn to read. Deterministic in rng's state."""
    img = Image.new("RGB", (size, size), (rng.randint(215, 255),) * 3)
    draw = ImageDraw.Draw(img)
    half = size // 2
    for digit, x0 in ((left, 0), (right, half)):
        font = _font(round(size * rng.uniform(0.34, 0.38)))
        x1, y1, x2, y2 = draw.textbbox((0, 0), str(digit), font=font)
        jx = max(0, min(jitter, (half - (x2 - x1)) // 2))
        jy = max(0, min(jitter, (half - (y2 - y1)) // 2))
        x = x0 + (half - (x2 - x1)) / 2 - x1 + rng.randint(-jx, jx)
        y = (half - (y2 - y1)) / 2 - y1 + rng.randint(-jy, jy)
        draw.text((x, y), str(digit), fill=(rng.randint(0, 90),) * 3, font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def generate(n: int, seed: int = 0, split: str = "train", cfg: VisualConfig | None = None) -> list[Problem]:
    """`n` problems of `split` with distinct prompt_ids, deterministic in (seed, split, cfg)."""
    cfg = cfg or VisualConfig()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {list(SPLITS)}")
    rng = random.Random(f"visual:{seed}:{split}")
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < n:
        left, op, right = rng.randint(0, 9), rng.choice(cfg.ops), rng.randint(0, 9)
        identity = f"{left}{op}{right}:{rng.getrandbits(32)}"
        pid = f"vis-{left}{_OP_CODES[op]}{right}-" + hashlib.sha1(identity.encode()).hexdigest()[:12]
        if pid in seen or split_of(identity) != split:
            continue
        seen.add(pid)
        steps, value = solve(left, op, right)
        if cfg.direct_answer_frac and hash_unit(f"direct:{identity}") < cfg.direct_answer_frac:
            steps = steps[-1:]
        image = render_image(left, right, cfg.image_size, random.Random(f"render:{identity}"), cfg.jitter)
        prompt = f"Compute left{op}right with the two digits shown.\n"
        out.append(Problem(pid, prompt, str(value), left, right, op, steps, image))
    return out


def parse_id(prompt_id: str) -> tuple[int, str, int] | None:
    """(left, op, right) of a prompt_id made by `generate`; None if it is not one."""
    m = _ID_RE.match(prompt_id)
    return (int(m.group(1)), _CODE_OPS[m.group(2)], int(m.group(3))) if m else None


def first_error(prompt_id: str, response: str) -> int | None:
    """Index (into `split_steps(response)`) of the first wrong step; None if every step is right.

    A response that stops before its answer line has its first missing step as the error (index
    = number of steps present); a bare `answer: N` response has error 0 (see the module docstring).
    """
    parsed = parse_id(prompt_id)
    if parsed is None:
        raise ValueError(f"not a visual-task prompt_id: {prompt_id!r}")
    left, op, right = parsed
    value = apply_op(left, op, right)
    checks = [(_READ_RE, [left, right]), (STEP_RE, [left, op, right, value]), (ANSWER_RE, [value])]
    steps = split_steps(response)
    for k, (regex, want) in enumerate(checks):
        if k >= len(steps):
            return k
        m = regex.match(steps[k])
        if not m or [g if g in _OP_CODES else int(g) for g in m.groups()] != want:
            return k
    return len(checks) if len(steps) > len(checks) else None


def step_labels(prompt_id: str, response: str) -> list[int]:
    """Exact 0/1 label of every step of `response`: 1 up to the first error, 0 from it on."""
    err = first_error(prompt_id, response)
    return [1 if err is None or k < err else 0 for k in range(len(split_steps(response)))]


def corrupt(problem: Problem, rng: random.Random) -> tuple[str, int]:
    """A full solution of `problem` with one deliberately wrong step, and the index of that step.

    One of: a misread digit (step 0; the computation follows the misread digits, so the answer is
    wrong too), a wrong result (step 1; the answer line follows it), or a wrong answer line (step 2).
    A misread is only drawn where some misread changes the value (not 0*0).
    """
    left, op, right = problem.left, problem.op, problem.right
    value = apply_op(left, op, right)
    misreads = [(a, b) for a in range(10) for b in range(10)
                if (a == left) != (b == right) and apply_op(a, op, b) != value]
    k = rng.randrange(3) if misreads else rng.randrange(1, 3)
    if k == 0:
        left, right = rng.choice(misreads)
    shown = apply_op(left, op, right) + (rng.choice([-3, -2, -1, 1, 2, 3]) if k == 1 else 0)
    answer = shown + (rng.choice([-2, -1, 1, 2]) if k == 2 else 0)
    steps = [f"read: {left} {right}", f"{left}{op}{right}={shown}", f"{ANSWER_PREFIX}{answer}"]
    return STEP_SEPARATOR.join(steps), k
