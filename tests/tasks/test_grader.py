"""One grader: the reward RL optimizes and the accuracy every stage reports agree on every answer form.

Each row is (source, response, reference answer, truth). The reward is the rollout stage's default
recipe (rewards.DEFAULT_RECIPES through score_items, as rollout scores rows); the accuracy is
`tasks.verify`, which SFT eval, prm-label, best-of-N and evaluate call. Both must equal the truth.
"""

from __future__ import annotations

import signal
import threading

import pytest

from prmflow import tasks
from prmflow.tasks import grader
from prmflow.components.rollout import outcome_rewards as rewards
from prmflow.components.rollout.reward_components import RewardInput

TABLE = [
    # integers (the last number when nothing marks the answer)
    ("gsm8k", "The answer is 42", "42", 1.0),
    ("gsm8k", "first 41, then 43", "42", 0.0),
    ("gsm8k", "no number here", "12", 0.0),
    # `answer:` lines
    ("gsm8k", "3 of 4 parts\nanswer: 0.75", "3/4", 1.0),  # the case: was reward 1, accuracy 0
    ("gsm8k", "Answer: -7", "-7", 1.0),
    ("gsm8k", "so the answer: 7", "7", 1.0),
    ("gsm8k", "answer: 8", "-8", 0.0),
    # GSM8K `#### N`, thousands separators
    ("gsm8k", "Natalia sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
    ("gsm8k", "#### 1,234,567", "1234567", 1.0),
    ("gsm8k", "#### 71", "72", 0.0),
    ("gsm8k", "answer: 1,001", "1000", 0.0),
    # \boxed{} (the last one counts)
    ("math", r"so \boxed{12}", "12", 1.0),
    ("math", r"first \boxed{1}, corrected: \boxed{2}", "2", 1.0),
    ("math", r"\boxed{13}", "12", 0.0),
    ("math", r"\boxed{1,000}", "1000", 1.0),
    # LaTeX \frac (in the response or in the reference)
    ("math", r"\boxed{\frac{3}{4}}", "3/4", 1.0),  # the case: was reward 1, accuracy 0
    ("math", r"\boxed{\dfrac{3}{4}}.", "0.75", 1.0),
    ("math", r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", 1.0),
    ("math", r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("math", r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    ("math", r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", 0.0),
    # plain fractions
    ("gsm8k", "answer: 3/4", "0.75", 1.0),
    ("gsm8k", "answer: 6/8", "3/4", 1.0),
    ("gsm8k", "answer: 3/5", "3/4", 0.0),
    ("gsm8k", "so it is 3/4", "0.75", 1.0),  # a bare fraction is the last number, not its denominator
    ("gsm8k", "so it is 3/4", "4", 0.0),
    # decimals (plain numbers compare exactly)
    ("gsm8k", "the total is 3.50 dollars", "3.5", 1.0),
    ("gsm8k", "answer: 2.5", "2.50", 1.0),
    ("gsm8k", "answer: 0.333333", "1/3", 0.0),
    ("gsm8k", "answer: 2.05", "2.5", 0.0),
    # negative numbers
    ("gsm8k", "answer: $-5$", "-5", 1.0),
    ("gsm8k", "answer: 3", "-3", 0.0),
    ("math", r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    ("math", r"\boxed{\frac{1}{2}}", "-0.5", 0.0),
    # other LaTeX math-verify understands
    ("math", r"\boxed{50\%}", "50", 1.0),
    ("math", r"\boxed{\sqrt{4}}", "2", 1.0),
    ("math", r"\boxed{x + 1}", "x+1", 1.0),
    ("math", r"\boxed{x + 2}", "x+1", 0.0),
    # the built-in tasks keep their exact `answer: N` checker (a boxed answer is a format error there)
    ("arithmetic", "7+5=12\nanswer: 12", "12", 1.0),
    ("arithmetic", "7+5=13\nanswer: 13", "12", 0.0),
    ("arithmetic", "7+5=12", "12", 0.0),
    ("arithmetic", r"\boxed{12}", "12", 0.0),
    ("visual", "read: 3 4\n3+4=7\nanswer: 7", "7", 1.0),
    ("visual", "read: 0 9\n0-9=-9\nanswer: -9", "-9", 1.0),
    ("visual", "read: 3 4\n3+4=7\nanswer: 8", "7", 0.0),
    # extraction (issue 61 #19): a trailing comma, a hyphen, \boxed without braces, unit words, GSM8K's first ####
    ("dataset", "she has 18, which is even", "18", 1.0),
    ("gsm8k", "she has 18, which is even", "18", 1.0),
    ("dataset", "so 10-5", "5", 1.0),
    ("dataset", "so 10-5", "-5", 0.0),
    ("dataset", "it is -5", "-5", 1.0),
    ("math", r"so the answer is $\boxed 5$.", "5", 1.0),
    ("math", r"first \boxed{4}, then \boxed 5", "5", 1.0),
    ("dataset", "answer: 18 dollars", "18", 1.0),
    ("math", "The final answer is 18 dollars.", "18", 1.0),
    ("dataset", "answer: 3 pi", "3", 0.0),  # pi is mathematics, not a unit
    ("gsm8k", "#### 18\nThen again: #### 20", "18", 1.0),  # lm-eval's strict match: the first `#### N`
    ("gsm8k", "#### 18\nThen again: #### 20", "20", 0.0),
    ("gsm8k", "#### $1,234.", "1234", 1.0),
]


@pytest.mark.parametrize("source,response,answer,truth", TABLE)
def test_reward_and_accuracy_agree_with_the_truth(source, response, answer, truth):
    recipes = rewards.build_recipes(rewards.DEFAULT_RECIPES)
    scored = rewards.score_items(recipes, [RewardInput("p0", 0, "a question", response, answer, source)])
    accuracy = tasks.verify(tasks.PromptRecord("p0", "a question", answer, source=source), response)
    assert (scored.outcome[0], scored.correct[0], accuracy) == (truth, truth, truth)


def test_an_intractable_answer_is_graded_wrong_without_reaching_sympy(monkeypatch):
    """sympy's comparison of these would not return: the grader must refuse them before it (no time limit
    needed: the comparison is replaced by a recorder, and must never be called)."""
    parse, verify = grader.verifier()
    compared = []
    monkeypatch.setattr(grader, "verifier", lambda: (parse, lambda *a, **k: compared.append(a) or True))
    assert grader.grade("math", r"\boxed{9^{9^{9^{9}}}}", "1") == 0.0
    assert grader.grade("math", r"\boxed{9^{99999999}}", "1") == 0.0
    assert grader.grade("math", r"\boxed{" + "1+" * 400 + "1}", "401") == 0.0  # over MAX_ANSWER_CHARS
    assert compared == []
    assert grader.grade("math", r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}") == 1.0  # a tractable one is compared
    assert len(compared) == 1


def test_grading_works_off_the_main_thread():
    got = []
    worker = threading.Thread(target=lambda: got.append(grader.grade("math", r"\boxed{\frac{3}{4}}", "0.75")))
    worker.start()
    worker.join()
    assert got == [1.0]  # math-verify's signal timeout would raise here


def test_grading_leaves_other_alarm_timers_running():
    signal.setitimer(signal.ITIMER_REAL, 1000.0)  # as pytest-timeout arms one around a test
    try:
        assert grader.grade("math", r"\boxed{\sqrt{4}}", "2") == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert remaining > 900


@pytest.mark.parametrize("source,responses,key", [
    ("dataset", ["answer: 0.75", "#### 3/4", r"\boxed{\frac{3}{4}}", r"\boxed{\dfrac{6}{8}}"], "3/4"),
    ("math", ["answer: 0.75", r"\boxed{\frac{3}{4}}", r"\boxed{\dfrac{6}{8}}", "The final answer is $3/4$."], "3/4"),
    ("math", ["so it is 3/4"], None),  # MATH: a bare number is no final answer
    ("gsm8k", ["#### 1,000", "answer: 1000", "so 1000.0"], "1000"),
    ("arithmetic", ["7+5=12\nanswer: 12", "answer: 012"], "12"),
    ("arithmetic", [r"\boxed{12}", "7+5=12"], None),  # no answer line: a format error
    ("math", ["no number here"], None),
])
def test_answer_key_is_one_value_per_answer(source, responses, key):
    assert {grader.answer_key(source, r) for r in responses} == {key}


# Equivalent forms of a few answers: two forms are equal exactly when they sit in one class. A rational
# answer is its exact value in every notation (0.333333 is not 1/3, whether 1/3 is written plainly or in
# LaTeX); a percentage or a unit word is dropped (MATH's normalization); non-rational ones by value.
CLASSES = [
    ["1/3", r"\frac{1}{3}", r"\dfrac13", r"\frac{2}{6}", r"x=\frac{1}{3}"],
    ["0.333333", "0.3333330"],
    ["0.5", "1/2", r"\frac{1}{2}", "2^{-1}", "0.50"],
    ["50", r"50\%", "50%", "50 dollars", r"50 \text{ dollars}"],
    [r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", r"\sqrt{2}/2"],
    ["0.707107"],
    ["x+1", "1 + x"],
    ["2x", "x+x"],
]
FORMS = [(form, k) for k, forms in enumerate(CLASSES) for form in forms]


def test_answers_match_and_answer_key_are_one_notion_of_equal():
    """Every ordered pair of forms: answers_match and equal answer_keys both say 'equal' exactly when the two
    forms are in one class (the issue's case: 0.333333 matched \\frac{1}{3} but not 1/3, and the keys differed,
    so a majority vote counted two right answers as two different ones)."""
    keys = {form: grader.answer_key("math", rf"so \boxed{{{form}}}") for form, _ in FORMS}
    wrong = [(a, b) for a, i in FORMS for b, j in FORMS
             if (grader.answers_match(a, b), keys[a] == keys[b]) != (i == j, i == j)]
    assert wrong == []
