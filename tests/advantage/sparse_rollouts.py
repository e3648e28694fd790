"""Rollouts of a weak start, where right answers are rare (the regime of docs/experiments/6-sparse-outcomes.md).

Every prompt has one right chain of steps (the same token ids in every sample of the prompt, as the
arithmetic task's right steps are the same text); a sample leaves it at step k with chance P_WRONG[k], and
once a step goes wrong every later step is a wrong step of its own (ids no other sample shares). The last
step is the answer line, right when every step before it is; the outcome is 1 then, else 0. A sample is
right about 10 % of the time, the first train reward of the weak starts (0.06-0.12), and about 40 % of the
groups of 8 hold no right sample at all.

PRMs (the score of the prefix that ends with each step):
- good: a right prefix (every step so far right) scores 0.65, a wrong one 0.35, plus normal noise of sd 0.2
  (step AUC about 0.85 against the step labels, as the weak starts' trained PRM: 0.85-0.88);
- answer-only: every step before the answer 0.5 plus noise, the answer line 0.9 when the sample is right, 0.1
  when not (a PRM that judges the answer and knows nothing of the steps);
- random: uniform;
- late-drop: `good`, but the prefix that ends with a sample's first wrong step still scores as a right one (it
  drops one step late: docs/experiments/5d-a-prm-wrong-in-one-place.md's kind).
"""

from __future__ import annotations

import numpy as np

STEP_TOKENS = 3
SD = 0.2
P_WRONG = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55)
"""The chance that step k goes wrong on a right prefix: later steps fail more often (as the weak starts' single steps
did: 13-14 % as the first step, 34 % as the fourth, docs/experiments/5c-calibration-against-a-flat-map.md), so a
right answer is rare (0.95 x 0.85 x ... x 0.45 = 9.7 %) and most failures come late."""
PRMS = ("good", "answer-only", "random", "late-drop")


def chain_rows(rng: np.random.Generator, prm: str, n_prompts: int = 32, n_samples: int = 8,
               p_wrong: tuple[float, ...] = P_WRONG, iteration: int = 0) -> list[dict]:
    """Rows of the rollouts schema (the columns the advantage stage reads) and, per row, `right_steps`: how many of
    its steps before the answer line are right (the exact step labels, for the tests' checks only)."""
    rows, fresh = [], 10_000
    n_steps = len(p_wrong)
    for g in range(n_prompts):
        right_chain = [[1000 + 50 * g + STEP_TOKENS * k + j for j in range(STEP_TOKENS)] for k in range(n_steps + 1)]
        for i in range(n_samples):
            ids, ends, scores, right = [], [], [], 0
            on_path = True
            for k in range(n_steps + 1):
                answer = k == n_steps
                if on_path and not answer and rng.random() < p_wrong[k]:
                    on_path = False
                    first_wrong = True
                else:
                    first_wrong = False
                if on_path:
                    step = right_chain[k]
                    right += not answer
                else:
                    step = list(range(fresh, fresh + STEP_TOKENS))
                    fresh += STEP_TOKENS
                ids += step
                ends.append(len(ids) - 1)
                scores.append(_score(prm, rng, on_path or (prm == "late-drop" and first_wrong), answer, on_path))
            rows.append({"prompt_id": f"p{g}", "sample_idx": i, "iteration": iteration, "prompt": f"prompt {g}",
                         "response": f"response {g}.{i}", "prompt_ids": [1, 2, 3], "response_ids": ids,
                         "finish_reason": "stop", "step_ends": ends, "step_rewards": scores,
                         "outcome_reward": float(on_path), "right_steps": right})
    return rows


def _score(prm: str, rng: np.random.Generator, looks_right: bool, answer: bool, right: bool) -> float:
    if prm == "random":
        return float(rng.random())
    if prm == "answer-only":
        return (0.9 if right else 0.1) if answer else float(0.5 + 0.05 * rng.standard_normal())
    if prm not in ("good", "late-drop"):
        raise ValueError(f"unknown PRM {prm!r}; one of {PRMS}")
    return float(np.clip((0.65 if looks_right else 0.35) + SD * rng.standard_normal(), 0.0, 1.0))
