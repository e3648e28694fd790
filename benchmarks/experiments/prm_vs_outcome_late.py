"""After half the budget, does a prm_vs_outcome arm still climb, or has it reached the level its reference ends at?

    python benchmarks/experiments/prm_vs_outcome_late.py outputs/prm-vs-outcome outputs/prm-vs-outcome-mixed

For each OUTPUT (a finished benchmark's `output`): every variant against the reference, over the seeds both ran,
as `prm_vs_outcome_stats.second_half` reads OUTPUT/results.json: held-out pass@1 at half the rollouts and at
the end, each arm's change from one to the other (paired t-test over seeds), the variant at half against the
reference at the end, each arm's best point from half on, and the train reward of the last batch each arm sampled
(held-out pass@1 is greedy; the rollouts are sampled). A variant that is level with the reference at the
end but got there by half the budget, with neither arm moving after, was faster to one level, not worse late.
Nothing is run: it reads results only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prm_vs_outcome_stats as bench_stats  # noqa: E402


def sampled(last: tuple[float, float, float] | None) -> str:
    return "-" if last is None else f"{last[0]:.3f} / {last[1]:.3f} (p={bench_stats.format_p(last[2])})"


def table(outputs: list[Path], reference: str) -> str:
    rows = []
    for out in outputs:
        path = out / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no results; run benchmarks/experiments/prm_vs_outcome.py with this output first")
        results = json.loads(path.read_text())["results"]
        if reference not in results:
            raise FileNotFoundError(f"{path}: no runs of the reference '{reference}'; name it with --reference "
                                    f"(variants there: {', '.join(results)})")
        for variant in results:
            if variant == reference:
                continue
            s = bench_stats.second_half(results, variant, reference)
            (dv, pv), (dr, pr) = s["change"][variant], s["change"][reference]
            vh, rend, p = s["variant_half_vs_reference_end"]
            rows.append(f"| {out} | {variant} | {s['seeds']} | {s['half'][0]:.3f} / {s['half'][1]:.3f} | "
                        f"{s['end'][0]:.3f} / {s['end'][1]:.3f} | {dv:+.3f} (p={bench_stats.format_p(pv)}) / "
                        f"{dr:+.3f} (p={bench_stats.format_p(pr)}) | {vh:.3f} vs {rend:.3f} (p={bench_stats.format_p(p)}) | "
                        f"{s['best'][0]:.3f} / {s['best'][1]:.3f} | {sampled(s['last_train_reward'])} |")
    head = ("| output | variant | seeds | pass@1 at half: variant / reference | at the end | change half -> end "
            "(paired p over seeds) | variant at half vs reference at end | best from half on | train reward of the last "
            "sampled batch |\n|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/experiments/prm_vs_outcome_late.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="benchmark outputs (the `output` key of its config)")
    parser.add_argument("--reference", default="outcome-only", help="the arm the others are read against "
                                                                    "(default: outcome-only)")
    args = parser.parse_args(argv)
    try:
        print(table(args.outputs, args.reference))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
