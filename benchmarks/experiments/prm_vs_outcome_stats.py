"""The numbers of benchmarks/experiments/prm_vs_outcome.py, as pure functions (tests/benchmarks checks them by hand).

    response_stats(responses, lengths)    reward-hacking watch of one batch of responses
    mcnemar(a, b)                         exact paired test over prompts (two policies, same prompts)
    summarize(results) -> table rows      final pass@1 over seeds, tests against the reference variant
    format_table(rows), plot_curves(...)  what the console, the README and MLflow show

`results[variant][seed]` is a run: {"points": [...], "final_correct": [0/1 per held-out prompt]}
where point k is the policy after k RL iterations: {"rollouts": responses sampled to make it,
"pass1": held-out greedy pass@1, "train_reward": mean reward of the rollouts it samples next (absent
for the last policy), plus the stats below under "train/" and "eval/" prefixes}.
"""

from __future__ import annotations

import math
import statistics

from scipy import stats as scipy_stats

from prmflow.components.data import steps as steps_lib
from prmflow.tasks import arithmetic

# --- reward hacking watch (PURE, arXiv 2504.15275: summed step rewards taught a policy to drop the separator) --

STAT_KEYS = ("steps_per_response", "response_length", "no_separator", "format_errors", "shortcut_share")


def response_stats(responses: list[str], lengths: list[int], separator: str = "\n") -> dict[str, float]:
    """Means over a batch of responses (lengths: their token counts):

    steps_per_response: steps as the PRM and the advantage stage cut them (`steps.steps`);
    response_length: tokens; no_separator: share whose text (stripped) holds no separator, i.e. one
    step at most; format_errors: share with no `answer: N` line; shortcut_share: of all steps, the
    share that merge two operations into one line (`7+5*3=36`).
    """
    if not responses:
        return {k: float("nan") for k in STAT_KEYS}
    all_steps = [steps_lib.steps(r, separator) for r in responses]
    n_steps = sum(len(s) for s in all_steps)
    return {
        "steps_per_response": n_steps / len(responses),
        "response_length": sum(lengths) / len(lengths),
        "no_separator": sum(separator not in r.strip() for r in responses) / len(responses),
        "format_errors": sum(arithmetic.extract_answer(r) is None for r in responses) / len(responses),
        "shortcut_share": sum(arithmetic.is_shortcut(s) for ss in all_steps for s in ss) / n_steps if n_steps else 0.0,
    }


# --- tests ----------------------------------------------------------------------------------------

def mcnemar(a: list[int], b: list[int]) -> tuple[int, int, float]:
    """(right only under a, right only under b, exact two-sided McNemar p) over the same prompts.

    The exact test is a binomial test of the discordant pairs against 1/2; p = 1 when there are none.
    """
    if len(a) != len(b):
        raise ValueError(f"paired test over prompts needs the same prompts: {len(a)} vs {len(b)} results")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    if only_a + only_b == 0:
        return 0, 0, 1.0
    return only_a, only_b, float(scipy_stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)


def paired_seed_test(a: list[float], b: list[float]) -> float:
    """Two-sided paired t-test over seeds (a[s] and b[s] share seed s); NaN below 2 seeds or with no spread."""
    if len(a) != len(b) or len(a) < 2:
        return float("nan")
    diffs = [x - y for x, y in zip(a, b)]
    if max(diffs) - min(diffs) < 1e-12:  # one difference at every seed, up to float rounding: no spread to test
        return 1.0 if abs(diffs[0]) < 1e-12 else 0.0
    return float(scipy_stats.ttest_rel(a, b).pvalue)


# --- curves and table ----------------------------------------------------------------------------

def curve(runs: dict, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(rollouts, mean, min, max) of `key` over the seeds of one variant, at the points every seed has."""
    points = [r["points"] for r in runs.values()]
    n = min(len(p) for p in points)
    xs, mean, lo, hi = [], [], [], []
    for k in range(n):
        vals = [p[k][key] for p in points if p[k].get(key) is not None]
        if not vals:
            continue
        xs.append(points[0][k]["rollouts"])
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return xs, mean, lo, hi


def rollouts_to_reach(xs: list[int], ys: list[float], target: float) -> int | None:
    """The first rollout count at which the curve ys is >= target; None if it never is."""
    return next((x for x, y in zip(xs, ys) if y >= target - 1e-12), None)


def summarize(results: dict, reference: str) -> list[dict]:
    """One row per variant: final pass@1 over seeds, the seed mean at half the rollouts (the point at or
    before the middle; half_seed_p: its paired t-test over seeds against `reference`), rollouts to reach
    `reference`'s final mean pass@1, the paired tests against `reference` (McNemar per shared seed, t-test over
    seeds) and the last policy's reward-hacking stats (mean over seeds)."""
    ref_runs = results[reference]
    ref_final = {s: r["points"][-1]["pass1"] for s, r in ref_runs.items()}
    target = curve(ref_runs, "pass1")[1][-1]
    rows = []
    for name, runs in results.items():
        seeds = sorted(runs)
        finals = [runs[s]["points"][-1]["pass1"] for s in seeds]
        xs, mean, _, _ = curve(runs, "pass1")
        row = {"variant": name, "seeds": len(seeds), "pass1_mean": sum(finals) / len(finals),
               "pass1_min": min(finals), "pass1_max": max(finals),
               "pass1_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
               "rollouts": xs[-1], "rollouts_to_reference": rollouts_to_reach(xs, mean, target),
               "half_rollouts": xs[(len(xs) - 1) // 2], "half_pass1_mean": mean[(len(xs) - 1) // 2],
               "mcnemar": [], "seed_p": float("nan"), "half_seed_p": float("nan")}
        last = [runs[s]["points"][-1] for s in seeds]
        for key in STAT_KEYS:
            vals = [p.get(f"eval/{key}") for p in last if p.get(f"eval/{key}") is not None]
            row[key] = sum(vals) / len(vals) if vals else float("nan")
        if name != reference:
            shared = [s for s in seeds if s in ref_runs]
            row["mcnemar"] = [(s, *mcnemar(runs[s]["final_correct"], ref_runs[s]["final_correct"])) for s in shared]
            row["seed_p"] = paired_seed_test([runs[s]["points"][-1]["pass1"] for s in shared], [ref_final[s] for s in shared])
            half = (len(xs) - 1) // 2  # the same point of the reference (same iterations)
            row["half_seed_p"] = paired_seed_test([runs[s]["points"][half]["pass1"] for s in shared],
                                                  [ref_runs[s]["points"][half]["pass1"] for s in shared])
        rows.append(row)
    return rows


def format_p(p: float) -> str:
    return "n/a" if p is None or math.isnan(p) else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def format_table(rows: list[dict], reference: str) -> str:
    """The final table in Markdown (the README's and the console's)."""
    head = ("| variant | final pass@1, mean (min-max) over seeds | pass@1 at half the rollouts | rollouts to reach "
            f"{reference}'s final | vs {reference}: McNemar per seed (only this / only ref, p) | t-test over seeds p "
            "| steps / response | shortcut steps | no separator | format errors |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        reach = "-" if r["rollouts_to_reference"] is None else f"{r['rollouts_to_reference']} of {r['rollouts']}"
        tests = "; ".join(f"s{s}: {a}/{b}, p={format_p(p)}" for s, a, b, p in r["mcnemar"]) or "(reference)"
        half_p = "; p=" + format_p(r["half_seed_p"]) if r["mcnemar"] else ""
        lines.append(f"| {r['variant']} | {r['pass1_mean']:.3f} ({r['pass1_min']:.3f}-{r['pass1_max']:.3f}) "
                     f"| {r['half_pass1_mean']:.3f} ({r['half_rollouts']}{half_p}) | {reach} "
                     f"| {tests} | {format_p(r['seed_p']) if r['mcnemar'] else '-'} | {r['steps_per_response']:.2f} "
                     f"| {r['shortcut_share']:.3f} | {r['no_separator']:.3f} | {r['format_errors']:.3f} |")
    return "\n".join(lines)


#: the bars the table of bars applies (docs/experiments/5-shortcut-regime.md): p-values of paired tests, points of pass@1
ALPHA, MAX_DEFICIT = 0.05, 0.01


def ahead(diff: float, p: float) -> bool:
    """The bar "ahead": a higher mean and paired t p < ALPHA."""
    return diff > 0 and p < ALPHA


def not_below(diff: float, p: float) -> bool:
    """The bar "not below": no paired t p < ALPHA below, and the mean no more than MAX_DEFICIT below."""
    return not (diff < 0 and p < ALPHA) and diff >= -MAX_DEFICIT - 1e-12


def bars(rows: list[dict], reference: str) -> str:
    """Each variant against `reference` by the bars the claims are held to, in Markdown: ahead at half the rollouts
    (higher seed mean and paired t p < ALPHA); not below at the end (no paired t p < ALPHA below and the seed mean no
    more than MAX_DEFICIT below); within noise (not below at the end and no seed's McNemar p < ALPHA below)."""
    ref = next(r for r in rows if r["variant"] == reference)
    lines = [f"| variant (vs {reference}) | at half the rollouts: difference (p) | ahead at half | at the end: difference "
             "(p) | not below at the end | seeds significantly below (McNemar) | within noise |", "|" + "---|" * 7]
    yes = {True: "yes", False: "no"}
    for r in rows:
        if r["variant"] == reference:
            continue
        half = r["half_pass1_mean"] - ref["half_pass1_mean"]
        end = r["pass1_mean"] - ref["pass1_mean"]
        is_ahead, level = ahead(half, r["half_seed_p"]), not_below(end, r["seed_p"])
        below = [f"s{s}" for s, a, b, p in r["mcnemar"] if b > a and p < ALPHA]
        lines.append(f"| {r['variant']} | {100 * half:+.1f} points ({format_p(r['half_seed_p'])}) | {yes[is_ahead]} "
                     f"| {100 * end:+.1f} points ({format_p(r['seed_p'])}) | {yes[level]} | {', '.join(below) or '-'} "
                     f"| {yes[level and not below]} |")
    return "\n".join(lines)


def plot_curves(results: dict, path, title: str = "") -> None:
    """PNG: held-out pass@1 and train reward against rollouts consumed, seed mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for name, runs in results.items():
        for ax, key in zip(axes, ("pass1", "train_reward")):
            xs, mean, lo, hi = curve(runs, key)
            line, = ax.plot(xs, mean, marker="o", ms=3, label=f"{name} ({len(runs)} seeds)")
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    axes[0].set(xlabel="rollouts consumed (responses sampled)", ylabel="held-out pass@1 (greedy)")
    axes[1].set(xlabel="rollouts consumed before the batch", ylabel="train reward (batch mean)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- is the shortcut a risky habit? (issue 46's regimes: a habit is only worth unlearning where merging loses) ---

def step_failures(prompts: list[str], responses: list[str], outcomes: list[float], positions: int = 5) -> dict:
    """How a batch of arithmetic responses fails, by the checker's first error.

    Returns {"success_by_merged": {m: (responses, success rate)} for m = 0, 1, 2 and "3+" merged lines,
    "single_by_position": {k: (steps reached, share failing)} for single-operation lines at line k (the last
    bucket "K+" pools the later lines), "merged": (merged lines reached, share failing)}. A step is "reached"
    when no earlier line of its response is wrong, and "failing" when it is the first wrong one: the rate at
    which a policy that got that far makes its first mistake on that kind of line.
    """
    by_merged: dict = {}
    single: dict = {}
    merged = [0, 0]
    for prompt, response, outcome in zip(prompts, responses, outcomes):
        steps = arithmetic.split_steps(response)
        m = sum(arithmetic.is_shortcut(s) for s in steps)
        key = m if m < 3 else "3+"
        n, ok = by_merged.get(key, (0, 0))
        by_merged[key] = (n + 1, ok + outcome)
        err = arithmetic.first_error(prompt, response)
        for k, step in enumerate(steps[:len(steps) if err is None else err + 1]):
            failed = int(k == err)
            if arithmetic.is_shortcut(step):
                merged[0] += 1
                merged[1] += failed
            elif arithmetic.STEP_RE.match(step):
                slot = k if k < positions - 1 else f"{positions - 1}+"
                reached, fails = single.get(slot, (0, 0))
                single[slot] = (reached + 1, fails + failed)
    order = lambda d: dict(sorted(d.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0]))))  # noqa: E731
    return {"success_by_merged": order({k: (n, ok / n) for k, (n, ok) in by_merged.items()}),
            "single_by_position": order({k: (n, f / n) for k, (n, f) in single.items()}),
            "merged": (merged[0], merged[1] / merged[0] if merged[0] else 0.0)}


# --- after half the budget: still climbing, or one plateau reached sooner? (issue 46's late-run question) ---

def second_half(results: dict, variant: str, reference: str) -> dict:
    """How `variant` and `reference` move from half the rollouts (the point summarize calls half) to the end,
    over the seeds both have: {"seeds", "half": (variant, reference) seed means there, "end": the same at the
    last point, "change": {arm: (mean end - half, paired t-test p)}, "variant_half_vs_reference_end": (variant's
    mean at half, reference's at the end, paired p), "best": (each arm's best point from half on, seed mean),
    "last_train_reward": `last_train_reward`}.
    Neither arm moving after half, and the variant's half equal to the reference's end, reads as one level
    that the variant reached sooner; an arm still climbing reads as a budget that ended first."""
    runs, ref = results[variant], results[reference]
    seeds = sorted(set(runs) & set(ref))
    if not seeds:
        raise ValueError(f"{variant} and {reference} share no seed")

    def pass1(arm: dict) -> list[list[float]]:
        return [[p["pass1"] for p in arm[s]["points"]] for s in seeds]

    a, b = pass1(runs), pass1(ref)
    n = min(len(c) for c in a + b)
    half = (n - 1) // 2
    mean = lambda vals: sum(vals) / len(vals)  # noqa: E731
    col = lambda curves, k: [c[k] for c in curves]  # noqa: E731
    return {"seeds": len(seeds),
            "half": (mean(col(a, half)), mean(col(b, half))),
            "end": (mean(col(a, n - 1)), mean(col(b, n - 1))),
            "change": {name: (mean(col(c, n - 1)) - mean(col(c, half)), paired_seed_test(col(c, n - 1), col(c, half)))
                       for name, c in ((variant, a), (reference, b))},
            "variant_half_vs_reference_end": (mean(col(a, half)), mean(col(b, n - 1)),
                                              paired_seed_test(col(a, half), col(b, n - 1))),
            "best": (mean([max(c[half:n]) for c in a]), mean([max(c[half:n]) for c in b])),
            "last_train_reward": last_train_reward(runs, ref, seeds)}


def last_train_reward(runs: dict, ref: dict, seeds: list) -> tuple[float, float, float] | None:
    """(variant, reference, paired p) of the mean train reward at the last point both have one: the reward of the
    rollouts the last trained policy sampled (temperature as configured), on the same prompts in both arms at a
    seed. None when the runs record none."""
    def rewards(arm: dict) -> list[list[float]]:
        return [[p["train_reward"] for p in arm[s]["points"] if p.get("train_reward") is not None] for s in seeds]

    a, b = rewards(runs), rewards(ref)
    k = min(len(c) for c in a + b) - 1
    if k < 0:
        return None
    x, y = [c[k] for c in a], [c[k] for c in b]
    return sum(x) / len(x), sum(y) / len(y), paired_seed_test(x, y)


# --- over drawn starts: one start is one draw (docs/experiments/5e-rebuilt-from-a-clean-checkout.md, 5f-the-start-drawn.md) ---

def over_starts(starts: dict, variant: str, reference: str) -> dict:
    """`variant` against `reference` over several starts of one regime: `starts[label]` is that start's `results`
    (one benchmark output's results.json; its RL seeds pair the two arms within the start). Returns {"starts": per
    start {"label", "sft_pass1" (the shared first point), "seeds", "half": (difference of seed means, paired t p),
    "end": the same at the last point}, "pairs": how many (start, seed) pairs, "half" and "end": (mean difference,
    paired t-test p over every pair), "between_starts": (half, end) one-sample t-test p of the starts' mean
    differences (NaN below 2 starts), "ahead_at_half", "not_below_at_end": the bars of `bars` read over the pairs}.
    Half is the point summarize calls half, of the shortest curve."""
    per_start, a_half, b_half, a_end, b_end = [], [], [], [], []
    for label, results in starts.items():
        for arm in (variant, reference):
            if arm not in results:
                raise ValueError(f"start {label}: no runs of '{arm}' (there: {', '.join(results) or 'none'})")
        runs, ref = results[variant], results[reference]
        seeds = sorted(set(runs) & set(ref))
        if not seeds:
            raise ValueError(f"start {label}: {variant} and {reference} share no seed")
        curves = [[p["pass1"] for p in arm[s]["points"]] for arm in (runs, ref) for s in seeds]
        n = min(len(c) for c in curves)
        half = (n - 1) // 2
        va, vb = curves[:len(seeds)], curves[len(seeds):]
        firsts = {c[0] for c in curves}
        if len(firsts) != 1:
            raise ValueError(f"start {label}: the runs do not share a first point ({sorted(firsts)}); they are not one start")
        row = {"label": label, "sft_pass1": firsts.pop(), "seeds": len(seeds)}
        for key, k, xs, ys in (("half", half, a_half, b_half), ("end", n - 1, a_end, b_end)):
            x, y = [c[k] for c in va], [c[k] for c in vb]
            row[key] = ((sum(x) - sum(y)) / len(x), paired_seed_test(x, y))
            xs += x
            ys += y
        per_start.append(row)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    half = (mean(a_half) - mean(b_half), paired_seed_test(a_half, b_half))
    end = (mean(a_end) - mean(b_end), paired_seed_test(a_end, b_end))

    def between(key: str) -> float:  # the starts' mean differences against 0: a one-sample t-test
        d = [r[key][0] for r in per_start]
        return paired_seed_test(d, [0.0] * len(d))

    return {"starts": per_start, "pairs": len(a_half), "half": half, "end": end,
            "between_starts": (between("half"), between("end")),
            "ahead_at_half": ahead(*half), "not_below_at_end": not_below(*end)}
