"""One arm against its reference over several drawn starts of one regime (docs/experiments/5f-the-start-drawn.md).

    python benchmarks/experiments/prm_vs_outcome_starts.py outputs/prm-vs-outcome outputs/prm-vs-outcome-start1 \
        outputs/prm-vs-outcome-start2 --variant prm-implicit-trained-cv

Each OUTPUT is a finished benchmark (the `output` key of its config) of one start: the same regime with another
`sft.seed` / `prm.seed`. The outputs must differ in those keys and in `output`, `only` and `run_missing` only;
anything else would pool two regimes, and that is refused. Prints, in Markdown, each start's five-seed figures and
the pooled ones: the mean difference at half the rollouts and at the end, a paired t-test over every (start, RL
seed) pair, a t-test over the starts' mean differences, and the bars (ahead at half, not below at the end) read
over the pairs, as `prm_vs_outcome_stats.over_starts` computes them. Each start is labelled with its seeds and, where
its results.json records it, the sha256 of its SFT policy's weights (the same config makes other weights on a CPU with
other float kernels); two outputs with the same weights are refused. Nothing is run: it reads results only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prm_vs_outcome_stats as bench_stats  # noqa: E402

#: keys in which two starts of one regime may differ
START_KEYS = ("output", "only", "run_missing")


def load(outputs: list[Path]) -> dict:
    """{label: results} of each output, refusing outputs that are not starts of one regime."""
    starts, seen, weights, regime = {}, set(), {}, None
    for out in outputs:
        for name in ("results.json", "config.json"):
            if not (out / name).is_file():
                raise FileNotFoundError(f"{out / name}: missing; run benchmarks/experiments/prm_vs_outcome.py with this "
                                        "output first")
        config = json.loads((out / "config.json").read_text())
        seeds = (config["sft"].get("seed", 0), config["prm"].get("seed", 0))
        label = f"{out} (sft.seed {seeds[0]}, prm.seed {seeds[1]})"
        rest = {k: v for k, v in config.items() if k not in START_KEYS}
        for section in ("sft", "prm"):
            rest[section] = {k: v for k, v in rest[section].items() if k != "seed"}
        if regime is None:
            regime, first = rest, out
        elif rest != regime:
            keys = sorted(k for k in set(rest) | set(regime) if rest.get(k) != regime.get(k))
            raise ValueError(f"{out}: not a start of {first}'s regime; config.json differs in {', '.join(keys)} "
                             f"(starts may differ only in sft.seed, prm.seed, {', '.join(START_KEYS)})")
        if seeds in seen:
            raise ValueError(f"{out}: the same start (sft.seed {seeds[0]}, prm.seed {seeds[1]}) as another output; "
                             "pooling it twice would count one draw as two")
        seen.add(seeds)
        saved = json.loads((out / "results.json").read_text())
        sft = saved.get("start", {}).get("weights_sha256", {}).get("sft")  # absent in outputs written before it
        if sft:
            if sft in weights:
                raise ValueError(f"{out}: its SFT policy has the same weights (sha256 {sft}) as {weights[sft]}'s; "
                                 "one start copied under two names would count one draw as two")
            weights[sft] = out
            label = f"{label[:-1]}, SFT sha256 {sft})"
        starts[label] = saved["results"]
    return starts


def table(starts: dict, variant: str, reference: str) -> str:
    r = bench_stats.over_starts(starts, variant, reference)
    p = bench_stats.format_p
    yes = {True: "yes", False: "no"}
    lines = [f"| start | SFT pass@1 | RL seeds | {variant} - {reference} at half the rollouts (paired p) | at the end (p) |",
             "|---|---|---|---|---|"]
    for s in r["starts"]:
        lines.append(f"| {s['label']} | {s['sft_pass1']:.3f} | {s['seeds']} | {100 * s['half'][0]:+.1f} points "
                     f"({p(s['half'][1])}) | {100 * s['end'][0]:+.1f} points ({p(s['end'][1])}) |")
    (bh, be) = r["between_starts"]
    lines.append(f"| **over {r['pairs']} (start, seed) pairs** | | | **{100 * r['half'][0]:+.1f} points ({p(r['half'][1])})**"
                 f" | **{100 * r['end'][0]:+.1f} points ({p(r['end'][1])})** |")
    lines.append(f"| over the {len(r['starts'])} starts' means (t-test) | | | p = {p(bh)} | p = {p(be)} |")
    lines += ["", f"Ahead at half the rollouts over the pairs: {yes[r['ahead_at_half']]}. "
              f"Not below at the end: {yes[r['not_below_at_end']]}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/experiments/prm_vs_outcome_starts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="benchmark outputs, one per start of one regime")
    parser.add_argument("--variant", required=True, help="the arm read against the reference, e.g. prm-implicit-trained-cv")
    parser.add_argument("--reference", default="outcome-only", help="(default: outcome-only)")
    args = parser.parse_args(argv)
    try:
        print(table(load(args.outputs), args.variant, args.reference))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
