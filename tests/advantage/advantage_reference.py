"""Slow, obviously-correct references for the advantage stage, and a random rollouts generator.

Everything here loops over samples and tokens in plain Python on lists, straight from the
definitions in docs/design.md ("Token rewards", "Advantage estimators"); nothing is imported from the stage's math.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Callable

import numpy as np
import pyarrow as pa

PROCESS_BOUND = 2.0  # grpo_progress step credit: no token's process credit above this x |A_out| (x w where A_out = 0)


def random_rollouts(rng: np.random.Generator, n_groups: int = 6, max_size: int = 5, min_size: int = 2,
                    max_len: int = 40, binary_outcome: bool = True, iteration: int = 0,
                    equal_groups: int = 1) -> pa.Table:
    """A rollouts table: groups of min_size..max_size samples, ragged responses, steps, rows shuffled.

    The first `equal_groups` groups get the same outcome and the same step scores (at least one step) in
    every sample.
    """
    rows = []
    for g in range(n_groups):
        size = int(rng.integers(min_size, max_size + 1))
        for i in range(size):
            length = int(rng.choice([1, 2, int(rng.integers(1, max_len + 1)), max_len]))
            old = (-rng.exponential(1.0, length)).astype(np.float32)
            n_steps = int(rng.integers(0, min(length, 5) + 1))
            ends = sorted(rng.choice(length, n_steps, replace=False).tolist())
            # quarter steps make equal (tied) step scores common, as PRMs emitting rounded scores do
            scores = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], n_steps) if rng.random() < 0.5 else rng.random(n_steps)
            outcome = float(rng.integers(0, 2)) if binary_outcome else float(rng.normal())
            if g < equal_groups:  # (a response with no step would be scored 0 by grpo_process: give it one)
                ends = ends or [length - 1]
                scores, outcome = np.full(len(ends), 0.75), 1.0
            rows.append({
                "prompt_id": f"p{g}", "sample_idx": i, "iteration": iteration,
                "prompt": f"prompt {g}", "response": f"response {g}.{i}",
                "prompt_ids": [1, 2, 3], "response_ids": rng.integers(0, 100, length).tolist(),
                "finish_reason": "stop",
                "behavior_logprobs": old.tolist(),
                "old_logprobs": old.tolist(),
                "ref_logprobs": (old + rng.normal(0, 0.3, length)).astype(np.float32).tolist(),
                "values": rng.normal(0, 1, length).astype(np.float32).tolist(),
                "step_ends": ends,
                "step_rewards": np.asarray(scores, np.float32).tolist(),
                "outcome_reward": outcome,
            })
    order = rng.permutation(len(rows))
    return pa.Table.from_pylist([rows[i] for i in order])


# --- token rewards -------------------------------------------------------------------------------

def kl(old: float, ref: float, estimator: str) -> float:
    x = old - ref
    return {"k1": x, "k2": x * x / 2, "k3": math.exp(-x) - 1 + x}[estimator]


def clip(x: float, c: float) -> float:
    return max(-c, min(c, x)) if c > 0 else x


def step_contribs(scores: list[float], mode: str, c: float) -> list[float]:
    if mode == "centered":
        out = [s - 0.5 for s in scores]
    elif mode == "min":
        out = [0.0] * len(scores)
        if scores:
            worst = min(scores)
            k = max(i for i, s in enumerate(scores) if s == worst)
            out[k] = scores[k]
    else:
        out = list(scores)
    return [clip(s, c) for s in out]


def step_ends(row: dict) -> list[int]:
    """The row's step ends as the step estimators (grpo_process, grpo_progress) read them: the last step
    runs to the response's last token."""
    ends = list(row["step_ends"])
    if ends:
        ends[-1] = len(row["response_ids"]) - 1
    return ends


def token_rewards(row: dict, beta: float, kl_est: str, outcome: bool, steps: bool, mode: str, c: float,
                  to_end: bool = False) -> list[float]:
    """to_end: the last step's reward at the last token (a step estimator's steps, `step_ends`)."""
    n = len(row["response_ids"])
    r = [0.0] * n
    for t in range(n):
        r[t] -= beta * kl(row["old_logprobs"][t], row["ref_logprobs"][t], kl_est)
    if steps:
        for end, s in zip(step_ends(row) if to_end else row["step_ends"], step_contribs(row["step_rewards"], mode, c)):
            r[end] += s
    if outcome:
        r[n - 1] += clip(row["outcome_reward"], c)
    return r


# --- estimators ----------------------------------------------------------------------------------

def returns_to_go(r: list[float], gamma: float) -> list[float]:
    out, g = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g
    return out


def gae(r: list[float], v: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    n = len(r)
    adv, last = [0.0] * n, 0.0
    for t in reversed(range(n)):
        v_next = v[t + 1] if t + 1 < n else 0.0
        delta = r[t] + gamma * v_next - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + b for a, b in zip(adv, v)]


def group_of(row: dict) -> tuple:
    return (row["iteration"], row["prompt_id"])


def stdev(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def reference(rows: list[dict], *, estimator: str, gamma: float = 1.0, lam: float = 0.95, beta: float = 0.0,
              kl_est: str = "k1", outcome: bool = True, steps: bool = True, mode: str = "raw", c: float = 0.0,
              eps: float = 1e-6, whiten: bool = False, adv_clip: float = 0.0, zero_variance: str = "keep",
              zv_weight: float = 0.1, process: tuple[float, float, float] = (0.5, 0.6, 0.8)) -> dict[tuple, dict]:
    """{(iteration, prompt_id, sample_idx): {token_rewards, advantages, returns, kl}} for the kept rows.
    process: grpo_progress's (process_weight, process_auc_min, process_auc_full)."""
    if estimator == "grpo_progress":
        out, _, _ = grpo_progress(rows, *process, eps=eps)
        for row in rows:
            o = out[(row["iteration"], row["prompt_id"], row["sample_idx"])]
            o["returns"] = returns_to_go(o["token_rewards"], gamma)
            o["kl"] = [kl(a, b, kl_est) for a, b in zip(row["old_logprobs"], row["ref_logprobs"])]
        return out
    groups = defaultdict(list)
    for row in rows:
        groups[group_of(row)].append(row)
    outcome_of = {id(r): clip(r["outcome_reward"], c) for r in rows}
    signal = {}  # group -> list of the values its statistics are taken over
    for key, members in groups.items():
        if outcome:
            signal[key] = [outcome_of[id(r)] for r in members]
        else:
            signal[key] = [s for r in members for s in step_contribs(r["step_rewards"], mode, c)]
            if estimator == "grpo_process":  # a response with no step is one step scored 0
                signal[key] += [0.0 for r in members if not r["step_rewards"]]
    zero_var = {k: len(groups[k]) >= 2 and len(set(signal[k])) <= 1 for k in groups}
    out = {}
    for row in rows:
        key = group_of(row)
        if zero_variance == "drop" and zero_var[key]:
            continue
        r = token_rewards(row, beta, kl_est, outcome, steps, mode, c, to_end=estimator == "grpo_process")
        n = len(r)
        sig = signal[key]
        mean, std = statistics.fmean(sig) if sig else 0.0, stdev(sig)
        if len(set(sig)) <= 1:
            std = 0.0
        ret = returns_to_go(r, gamma)
        if estimator == "gae":
            adv, ret = gae(r, row["values"], gamma, lam)
        elif estimator == "reinforce":
            adv = ret
        elif estimator == "reinforce_baseline":
            shifted = list(r)
            shifted[n - 1] -= mean
            adv = returns_to_go(shifted, gamma)
        elif estimator in ("grpo", "dr_grpo", "rloo"):
            R = outcome_of[id(row)]
            if estimator == "grpo":
                a = (R - mean) / (std + eps)
            elif estimator == "dr_grpo":
                a = R - mean
            else:
                others = [outcome_of[id(o)] for o in groups[key] if o is not row]
                a = R - sum(others) / len(others)
            adv = [a] * n
        elif estimator == "grpo_process":
            normalized = [(s - mean) / (std + eps) for s in step_contribs(row["step_rewards"], mode, c)]
            ends = step_ends(row)
            if not ends:  # one step over the whole response, scored 0
                ends, normalized = [n - 1], [(0.0 - mean) / (std + eps)]
            adv = [sum(z for e, z in zip(ends, normalized) if e >= t) for t in range(n)]
        else:
            raise ValueError(estimator)
        kls = [kl(o, f, kl_est) for o, f in zip(row["old_logprobs"], row["ref_logprobs"])]
        out[(row["iteration"], row["prompt_id"], row["sample_idx"])] = {
            "token_rewards": r, "advantages": adv, "returns": ret, "kl": kls, "group": key}
    if whiten:
        flat = [a for o in out.values() for a in o["advantages"]]
        mean, std = statistics.fmean(flat), statistics.pstdev(flat)
        for o in out.values():
            o["advantages"] = [(a - mean) / (std + eps) for a in o["advantages"]]
    for o in out.values():
        if zero_variance == "downweight" and zero_var[o["group"]]:
            o["advantages"] = [a * zv_weight for a in o["advantages"]]
        if adv_clip > 0:
            o["advantages"] = [clip(a, adv_clip) for a in o["advantages"]]
    return out


# --- grpo_progress (step_reward_mode=progress) ------------------------------------------------------

def progress(scores: list[float], outcome: float, phi_prompt: float) -> list[float]:
    """d_k = Phi_k - Phi_{k-1}: Phi_{-1} = the prompt's value, Phi_k = the PRM's score after step k, the last Phi = R."""
    phi = [phi_prompt] + list(scores[:-1]) + [outcome]
    return [phi[k + 1] - phi[k] for k in range(len(scores))]


def isotonic(scores: list[float], outcomes: list[float]) -> Callable[[float], float]:
    """The least-squares non-decreasing fit of outcome on score over bins of at least ceil(sqrt(N))
    prefixes, written out: walk the distinct scores upwards, closing a bin once it holds that many (a
    short last bin joins the one before); then pool-adjacent-violators on the bins' mean outcomes,
    merging a bin with the block before while their means decrease. A score reads the fitted value of the
    first bin whose highest score is >= it (above all bins: the last)."""
    size = math.ceil(math.sqrt(len(scores)))
    bins = [[]]  # each: the (score, outcome) pairs of one bin
    for x in sorted(set(scores)):
        if len(bins[-1]) >= size:
            bins.append([])
        bins[-1] += [(s, y) for s, y in zip(scores, outcomes) if s == x]
    if len(bins) > 1 and len(bins[-1]) < size:
        short = bins.pop()
        bins[-1] += short
    blocks = []  # [sum of outcomes, count, bins pooled]
    for b in bins:
        blocks.append([sum(y for _, y in b), len(b), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n, k = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
            blocks[-1][2] += k
    fitted = [blk[0] / blk[1] for blk in blocks for _ in range(blk[2])]  # one per bin
    tops = [max(s for s, _ in b) for b in bins]

    def phi(v: float) -> float:
        for top, y in zip(tops, fitted):
            if v <= top:
                return y
        return fitted[-1]
    return phi


def pairwise_auc(scores: list[float], labels: list[bool]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def folds(rows: list[dict], k: int = 5) -> dict[str, int]:
    """prompt_id -> fold: its rank among the sorted distinct prompt ids, mod k."""
    return {p: i % k for i, p in enumerate(sorted({r["prompt_id"] for r in rows}))}


def shared_prefix_labels(rows: list[dict]) -> dict[int, list[float | None]]:
    """id(row) -> per step: 1.0 when a response of the same group with outcome >= 0.5 has a step k (the same k)
    ending at the same token with the same token ids up to it, else 0.0; None for every step of a group with no
    such response (no evidence). Written out with list comparisons."""
    groups = defaultdict(list)
    for row in rows:
        groups[group_of(row)].append(row)
    out = {}
    for row in rows:
        won = [o for o in groups[group_of(row)] if o["outcome_reward"] >= 0.5]
        labels = []
        for k, e in enumerate(row["step_ends"]):
            same = [o for o in won if len(o["step_ends"]) > k and o["step_ends"][k] == e
                    and list(o["response_ids"][:e + 1]) == list(row["response_ids"][:e + 1])]
            labels.append((1.0 if same else 0.0) if won else None)
        out[id(row)] = labels
    return out


def chosen_map(rows: list[dict], fold: dict[str, int], f: int,
               labels: dict[int, list] | None = None) -> Callable[[float], float]:
    """The map fold f's scores are read through: the isotonic fit of the (score, outcome) pairs of every step
    but the last of the other folds' rows (0.5 everywhere when there are none), used only where it beats the
    flat map (their mean outcome) on those folds by more than one standard error: each of the other folds
    held out in turn, both maps fitted on the remaining ones, a held-out prompt's gain is the sum over its
    pairs of the flat map's squared error minus the fitted map's; the map wins when the mean gain over the
    held-out prompts is above 1 x its standard error (sample stdev / sqrt(count), at least 2 prompts).
    labels (`shared_prefix_labels`): each step's own label instead of its row's outcome, steps labelled None
    left out."""
    def label_list(o):
        return labels[id(o)] if labels is not None else [o["outcome_reward"]] * len(o["step_rewards"])

    def pairs(keep):
        return [(x, y, o["prompt_id"]) for o in rows if keep(fold[o["prompt_id"]])
                for x, y in zip(o["step_rewards"][:-1], label_list(o)[:-1]) if y is not None]
    train = pairs(lambda k: k != f)
    if not train:
        return lambda v: 0.5
    flat = statistics.fmean(y for _, y, _ in train)
    gains = []
    for g in sorted({fold[p] for _, _, p in train}):
        inner = pairs(lambda k: k not in (f, g))
        if not inner:
            continue
        fitted = isotonic([x for x, _, _ in inner], [y for _, y, _ in inner])
        inner_flat = statistics.fmean(y for _, y, _ in inner)
        for p in sorted({p for _, _, p in train if fold[p] == g}):
            gains.append(sum((inner_flat - y) ** 2 - (fitted(x) - y) ** 2 for x, y, q in train if q == p))
    if len(gains) >= 2 and statistics.fmean(gains) > statistics.stdev(gains) / math.sqrt(len(gains)):
        return isotonic([x for x, _, _ in train], [y for _, y, _ in train])
    return lambda v: flat


def grpo_progress(rows: list[dict], weight: float, auc_min: float, auc_full: float,
                  eps: float = 1e-6, credit: str = "step", calibration: str = "none",
                  lag: int = 1, calibration_labels: str = "outcome") -> tuple[dict[tuple, dict], float, float]:
    """({key: {token_rewards, advantages}}, step AUC, gated weight), straight from the definitions.
    calibration=isotonic: a row's scores read through `chosen_map` of its fold (`folds`); the process term ranks that
    calibrated Phi's own progress, from the mean over the group of its first-step Phi through the last
    step's Phi (no outcome), over the std of all the batch's outcomes instead of the RMS of every step's c.
    credit=step: z_k spread over step k's tokens (the last step runs to the last token) as z_k x Lbar / L_k
    (L_k its tokens, Lbar their mean over the row's steps), times w, the row's whole term scaled down by the
    one factor that takes its most opposed token to 0 when a token would change sign, or its largest token to
    PROCESS_BOUND x |A_out| (x w where A_out = 0) when it is larger, whichever is smaller.
    credit=baseline: token t gets (R - mean) / (std + eps) + w * (the mean Phi after the first step of the
    group's other responses - Phi after step j), j the last step whose recorded last token is before t - lag
    (lag: the separator's bytes);
    tokens before any such step (or of a row whose group has no other response with a step) the first term alone.
    calibration_labels=shared_prefix: the maps are fitted against `shared_prefix_labels` instead of outcomes."""
    groups = defaultdict(list)
    for row in rows:
        groups[group_of(row)].append(row)
    stats = {k: (statistics.fmean([r["outcome_reward"] for r in m]),
                 stdev([r["outcome_reward"] for r in m]) if len({r["outcome_reward"] for r in m}) > 1 else 0.0)
             for k, m in groups.items()}
    fold = folds(rows)
    calibrated = calibration == "isotonic"
    phi_of = {}  # id(row) -> the map its scores are read through
    for row in rows:
        if not calibrated:
            phi_of[id(row)] = lambda v: v
            continue
        phi_of[id(row)] = chosen_map(rows, fold, fold[row["prompt_id"]],
                                     shared_prefix_labels(rows) if calibration_labels == "shared_prefix" else None)
    first = defaultdict(list)  # calibrated: the PRM's Phi after the first step of each response of a group
    for row in rows:
        if row["step_rewards"]:
            first[group_of(row)].append(phi_of[id(row)](row["step_rewards"][0]))
    centered, d_of = {}, {}
    scores, labels = [], []
    for row in rows:
        mean, _ = stats[group_of(row)]
        p = [phi_of[id(row)](x) for x in row["step_rewards"]]
        d = progress(p, row["outcome_reward"], mean)
        if calibrated and p:  # the process term: the calibrated PRM's own progress, no outcome in it
            own = [statistics.fmean(first[group_of(row)])] + p
            process_d = [own[k + 1] - own[k] for k in range(len(p))]
        else:
            process_d = d
        c = [x - statistics.fmean(process_d) for x in process_d] if d else []
        d_of[id(row)], centered[id(row)] = d, c
        scores += list(row["step_rewards"][:-1])
        labels += [row["outcome_reward"] >= 0.5] * max(len(row["step_rewards"]) - 1, 0)
    auc = pairwise_auc(scores, labels)
    if math.isnan(auc) or auc < auc_min:
        w = 0.0
    elif auc >= auc_full:
        w = weight
    else:
        w = weight * (auc - auc_min) / (auc_full - auc_min)
    out = {}
    for row in rows:
        key = group_of(row)
        mean, std = stats[key]
        phi = phi_of[id(row)]
        a_out = (row["outcome_reward"] - mean) / (std + eps)
        members = [x for o in rows for x in centered[id(o)]]  # every step of the input
        scale = math.sqrt(sum(x * x for x in members) / len(members)) if members else 0.0
        if calibrated:  # calibrated progress is read in outcome units: the std of the batch's outcomes
            scale = statistics.pstdev([o["outcome_reward"] for o in rows])
        z = [x / (scale + eps) for x in centered[id(row)]]
        n, ends = len(row["response_ids"]), step_ends(row)
        spans = sorted(set(ends))  # steps ending in the same token are one span
        length = {e: e - ([-1] + spans)[i] for i, e in enumerate(spans)}
        mean_length = statistics.fmean(length.values()) if spans else 0.0
        adv, r, term = [], [0.0] * n, []
        for t in range(n):
            later = [e for e in ends if e >= t]
            if credit == "baseline":  # the recorded ends: the last step does not run on here
                closed = [j for j, e in enumerate(row["step_ends"]) if e < t - lag]
                others = [phi_of[id(o)](o["step_rewards"][0]) for o in groups[key] if o is not row and o["step_rewards"]]
                start = statistics.fmean(others) if others else None
                term.append(start - phi(row["step_rewards"][closed[-1]]) if closed and others else 0.0)
                continue
            span = min(later) if later else None
            p = sum(zk for e, zk in zip(ends, z) if e == span)  # the step t belongs to
            term.append(w * p * mean_length / length[span] if span is not None else 0.0)
        if credit == "baseline":
            adv = [a_out + w * x for x in term]
        else:
            worst = max([(-x if a_out > 0 else x) for x in term] + [0.0]) if a_out != 0 else 0.0
            largest = max([abs(x) for x in term] + [0.0])
            cap = PROCESS_BOUND * (abs(a_out) if a_out != 0 else w)
            factor = min(abs(a_out) / worst if worst > abs(a_out) else 1.0, cap / largest if largest > cap else 1.0)
            adv = [a_out + factor * x for x in term]
            adv = [max(a, 0.0) if a_out > 0 else min(a, 0.0) if a_out < 0 else a for a in adv]
        for e, dk in zip(ends, d_of[id(row)]):
            r[e] += dk
        if not ends:
            r[n - 1] += row["outcome_reward"]
        out[(row["iteration"], row["prompt_id"], row["sample_idx"])] = {"token_rewards": r, "advantages": adv}
    return out, auc, w
