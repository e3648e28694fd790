import io
import random
from collections import defaultdict

import pytest
from PIL import Image

from prmflow.errors import ConfigError
from prmflow.tasks import visual as vis


def _pixels(png: bytes, size: int) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.mode == "RGB" and img.size == (size, size)
    return img


def _slow_first_error(left, op, right, response):
    """An independent checker: compare each line, spaces removed, with the expected line."""
    value = {"+": left + right, "-": left - right, "*": left * right}[op]
    want = [f"read:{left} {right}", f"{left}{op}{right}={value}", f"answer:{value}"]
    lines = [line for line in response.split("\n") if line.strip()]
    for k, w in enumerate(want):
        if k >= len(lines):
            return k
        got = " ".join(lines[k].split()).replace(": ", ":").replace(" " + op + " ", op).replace(" = ", "=")
        if got != w:
            return k
    return 3 if len(lines) > 3 else None


@pytest.mark.parametrize("size", [28, 56, 84])
def test_images_are_rgb_pngs_of_the_size_with_ink_in_both_halves(size):
    for p in vis.generate(20, seed=4, cfg=vis.VisualConfig(image_size=size)):
        img = _pixels(p.image, size)
        dark = [(x, y) for x in range(size) for y in range(size) if img.getpixel((x, y))[0] < 150]
        assert any(x < size // 2 for x, _ in dark) and any(x >= size // 2 for x, _ in dark)


def test_variants_of_one_combo_are_different_images_and_rendering_is_deterministic():
    assert vis.render_image(3, 7, 56, random.Random(1)) == vis.render_image(3, 7, 56, random.Random(1))
    assert vis.render_image(3, 7, 56, random.Random(1)) != vis.render_image(3, 7, 56, random.Random(2))
    by_combo = defaultdict(list)
    for p in vis.generate(600, seed=0):
        by_combo[(p.left, p.op, p.right)].append(p)
    repeated = [ps for ps in by_combo.values() if len(ps) > 1]
    assert repeated  # 600 problems over 300 combos
    for ps in repeated:
        assert len({p.image for p in ps}) == len(ps)
        assert len({p.prompt_id for p in ps}) == len(ps)


def test_same_seed_same_problems_other_seed_other_images():
    a, b = vis.generate(50, seed=7), vis.generate(50, seed=7)
    assert [(p.prompt_id, p.prompt, p.steps, p.image) for p in a] == [(p.prompt_id, p.prompt, p.steps, p.image) for p in b]
    assert {p.image for p in a}.isdisjoint(p.image for p in vis.generate(50, seed=8))


def test_splits_are_disjoint_renderings_of_shared_combos():
    splits = {s: vis.generate(2000, seed=0, split=s) for s in ("train", "eval", "test")}
    for s, ps in splits.items():
        assert len({p.prompt_id for p in ps}) == 2000
        assert len({p.image for p in ps}) == 2000
    for s, t in (("train", "eval"), ("train", "test"), ("eval", "test")):
        assert {p.prompt_id for p in splits[s]}.isdisjoint(p.prompt_id for p in splits[t])
        assert {p.image for p in splits[s]}.isdisjoint(p.image for p in splits[t])
    train_combos = {(p.left, p.op, p.right) for p in splits["train"]}
    assert all((p.left, p.op, p.right) in train_combos for p in splits["eval"])  # new images, known facts
    # the same split from another seed draws other renderings, still none from another split
    assert {p.prompt_id for p in vis.generate(2000, seed=1, split="eval")}.isdisjoint(p.prompt_id for p in splits["train"])
    with pytest.raises(ValueError, match="unknown split"):
        vis.generate(1, split="dev")


def test_reference_solutions_are_right_and_fully_labelled():
    problems = vis.generate(500, seed=2)
    assert {p.op for p in problems} == {"+", "-", "*"}
    assert any(int(p.answer) < 0 for p in problems)
    for p in problems:
        value = eval(f"{p.left}{p.op}{p.right}")
        assert p.answer == str(value)
        assert p.steps == [f"read: {p.left} {p.right}", f"{p.left}{p.op}{p.right}={value}", f"answer: {value}"]
        assert p.prompt == f"Compute left{p.op}right with the two digits shown.\n"
        assert vis.verify(p.solution, p.answer) == 1.0
        assert vis.first_error(p.prompt_id, p.solution) is None
        assert vis.step_labels(p.prompt_id, p.solution) == [1, 1, 1]
    assert {p.op for p in vis.generate(100, cfg=vis.VisualConfig(ops="-"))} == {"-"}


def test_corrupt_labels_match_an_independent_check():
    rng = random.Random(0)
    kinds = defaultdict(int)
    for p in vis.generate(400, seed=5):
        for _ in range(3):
            response, k = vis.corrupt(p, rng)
            kinds[k] += 1
            assert _slow_first_error(p.left, p.op, p.right, response) == k
            assert vis.step_labels(p.prompt_id, response) == [1] * k + [0] * (3 - k)
            assert vis.verify(response, p.answer) == 0.0  # every kind of slip ends in a wrong answer
    assert min(kinds[k] for k in range(3)) > 250


def test_corrupt_of_zero_times_zero_cannot_misread():
    p = vis.Problem("vis-0t0-000000000000", "", "0", 0, 0, "*", ["read: 0 0", "0*0=0", "answer: 0"])
    rng = random.Random(1)
    assert {vis.corrupt(p, rng)[1] for _ in range(50)} == {1, 2}


@pytest.mark.parametrize("pid, response, answer, labels, reward", [
    ("vis-3p7-0123456789ab", "read: 3 7\n3+7=10\nanswer: 10", "10", [1, 1, 1], 1.0),
    ("vis-3p7-0123456789ab", "read: 3 1\n3+1=4\nanswer: 4", "10", [0, 0, 0], 0.0),  # misread, consistent after
    ("vis-3p7-0123456789ab", "read: 3 7\n3+7=11\nanswer: 11", "10", [1, 0, 0], 0.0),
    ("vis-2m9-0123456789ab", "read: 2 9\n2-9=-7\nanswer: -7", "-7", [1, 1, 1], 1.0),
    ("vis-2m9-0123456789ab", "read: 2 9\n2-9=7\nanswer: 7", "-7", [1, 0, 0], 0.0),  # lost the sign
    ("vis-2m9-0123456789ab", "read: 2 9\n2-9=-7\nanswer: 7", "-7", [1, 1, 0], 0.0),
    ("vis-6t8-0123456789ab", "read: 6 8\n6*8=48\nanswer: 48", "48", [1, 1, 1], 1.0),
    # digits swapped: a right answer, wrong steps
    ("vis-6t8-0123456789ab", "read: 8 6\n8*6=48\nanswer: 48", "48", [0, 0, 0], 1.0),
    ("vis-6t8-0123456789ab", "read: 6 8\n6+8=14\nanswer: 14", "48", [1, 0, 0], 0.0),  # wrong operation
    ("vis-6t8-0123456789ab", " read : 6  8 \n 6 * 8 = 48 \n\n answer : 48 ", "48", [1, 1, 1], 1.0),  # spacing, blank line
])
def test_hand_written_examples(pid, response, answer, labels, reward):
    assert vis.step_labels(pid, response) == labels
    assert vis.first_error(pid, response) == (labels.index(0) if 0 in labels else None)
    assert vis.verify(response, answer) == reward


def test_negative_results_verify_and_label():
    pid = "vis-0m9-aaaaaaaaaaaa"
    assert vis.verify("read: 0 9\n0-9=-9\nanswer: -9", "-9") == 1.0
    assert vis.verify("read: 0 9\n0-9=9\nanswer: 9", "-9") == 0.0
    assert vis.step_labels(pid, "read: 0 9\n0 - 9 = -9\nanswer: -9") == [1, 1, 1]
    assert vis.step_labels(pid, "read: 0 9\n0-9=9\nanswer: -9") == [1, 0, 0]


def test_early_stop_extra_lines_and_bare_answers():
    pid = "vis-4p5-0123456789ab"
    assert vis.first_error(pid, "read: 4 5") == 1 and vis.step_labels(pid, "read: 4 5") == [1]
    assert vis.first_error(pid, "read: 4 5\n4+5=9") == 2
    assert vis.first_error(pid, "") == 0 and vis.step_labels(pid, "") == []
    assert vis.step_labels(pid, "read: 4 5\n4+5=9\nanswer: 9\nanswer: 9") == [1, 1, 1, 0]
    assert vis.step_labels(pid, "Read: 4 5\n4+5=9\nANSWER: 9") == [1, 1, 1]
    assert vis.step_labels(pid, "read: 45\n4+5=9\nanswer: 9") == [0, 0, 0]  # the two digits must be apart
    assert vis.step_labels(pid, "read: 4 5\n4+5=9\nanswer: 9.0") == [1, 1, 0]
    # a bare answer is labelled wrong even when right, as the arithmetic task labels one
    assert vis.first_error(pid, "answer: 9") == 0 and vis.step_labels(pid, "answer: 9") == [0]
    assert vis.verify("answer: 9", "9") == 1.0
    assert vis.step_labels(pid, "answer: 8") == [0]
    with pytest.raises(ValueError, match="not a visual-task prompt_id"):
        vis.first_error("arith-0123456789ab", "answer: 9")


def test_parse_id_round_trip():
    for p in vis.generate(300, seed=3):
        assert vis.parse_id(p.prompt_id) == (p.left, p.op, p.right)
        assert p.prompt_id.startswith(f"vis-{p.left}{ {'+': 'p', '-': 'm', '*': 't'}[p.op] }{p.right}-")
        assert len(p.prompt_id.rsplit("-", 1)[1]) == 12
    assert vis.parse_id("vis-2m9-0123456789ab") == (2, "-", 9)
    assert vis.parse_id("vis-2x9-0123456789ab") is None
    assert vis.parse_id("vis-12p9-0123456789ab") is None
    assert vis.parse_id("arith-0123456789ab") is None


def test_direct_answer_frac():
    plain = vis.generate(2000, seed=3)
    half = vis.generate(2000, seed=3, cfg=vis.VisualConfig(direct_answer_frac=0.5))
    assert [p.prompt_id for p in half] == [p.prompt_id for p in plain]
    bare = [h for h in half if len(h.steps) == 1]
    assert 0.45 < len(bare) / len(half) < 0.55
    for h, p in zip(half, plain):
        assert h.solution in (p.solution, f"answer: {p.answer}")
        assert vis.verify(h.solution, h.answer) == 1.0
    assert all(len(p.steps) == 3 for p in vis.generate(200, seed=3, cfg=vis.VisualConfig(direct_answer_frac=0.0)))
    direct = vis.generate(200, seed=3, cfg=vis.VisualConfig(direct_answer_frac=1.0))
    assert all(p.steps == [f"answer: {p.answer}"] for p in direct)


@pytest.mark.parametrize("kwargs, key", [
    ({"ops": ""}, "visual.ops"), ({"ops": "+/"}, "visual.ops"), ({"ops": "x"}, "visual.ops"),
    ({"image_size": 0}, "visual.image_size"), ({"image_size": 14}, "visual.image_size"),
    ({"image_size": 60}, "visual.image_size"),
    ({"jitter": -1}, "visual.jitter"),
    ({"direct_answer_frac": -0.1}, "visual.direct_answer_frac"), ({"direct_answer_frac": 1.5}, "visual.direct_answer_frac"),
])
def test_bad_config_values_raise_config_error_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        vis.VisualConfig(**kwargs)
