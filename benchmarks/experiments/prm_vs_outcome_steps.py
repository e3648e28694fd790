"""Is the shortcut of a prm_vs_outcome regime a habit worth unlearning? Read from a finished benchmark's rollouts.

    python benchmarks/experiments/prm_vs_outcome_steps.py outputs/prm-vs-outcome outputs/prm-vs-outcome-chains
    python benchmarks/experiments/prm_vs_outcome_steps.py outputs/prm-vs-outcome --variant outcome-only --iteration 3

For each OUTPUT: the training rollouts of one variant at one iteration, pooled over its seeds
(OUTPUT/runs/VARIANT/seed-*/iterK/rollouts), as `prm_vs_outcome_stats.step_failures` counts them: how often a
response succeeds with 0, 1, 2 and 3+ merged lines, and how often a single-operation line at each position and a
merged line is the first mistake of a response that got that far. Step credit has something to teach where
merging fails far more often than the two single steps it replaces; where single steps fail nearly as often
(a policy that never learned them), neither outcome-only nor a PRM has a cheap habit to unlearn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prm_vs_outcome_stats as bench_stats  # noqa: E402

from prmflow.components.data import schema  # noqa: E402


def table(outputs: list[Path], variant: str, iteration: int) -> str:
    rows = []
    for out in outputs:
        dirs = sorted(out.glob(f"runs/{variant}/seed-*/iter{iteration}/rollouts"))
        if not dirs:
            raise FileNotFoundError(f"{out}: no rollouts at runs/{variant}/seed-*/iter{iteration}/rollouts; "
                                    f"run benchmarks/experiments/prm_vs_outcome.py with this output first, or name another "
                                    f"--variant / --iteration")
        t = schema.read_dataset(dirs, "rollouts", ["prompt", "response", "outcome_reward"])
        f = bench_stats.step_failures(t.column("prompt").to_pylist(), t.column("response").to_pylist(),
                                      t.column("outcome_reward").to_pylist())
        success = ", ".join(f"{k}: {r:.2f} ({n})" for k, (n, r) in f["success_by_merged"].items())
        single = ", ".join(f"{k}: {r:.2f} ({n})" for k, (n, r) in f["single_by_position"].items())
        rows.append(f"| {out} | {len(dirs)} | {t.num_rows} | {success} | {single} | {f['merged'][1]:.2f} ({f['merged'][0]}) |")
    head = ("| output | seeds | responses | success by merged lines (responses) | single line fails first, by line "
            "(reached) | merged line fails first (reached) |\n|---|---|---|---|---|---|")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/experiments/prm_vs_outcome_steps.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="benchmark outputs (the `output` key of its config)")
    parser.add_argument("--variant", default="outcome-only", help="whose rollouts (default: outcome-only)")
    parser.add_argument("--iteration", type=int, default=0, help="which iteration's rollouts (default 0: the SFT policy's)")
    args = parser.parse_args(argv)
    try:
        print(table(args.outputs, args.variant, args.iteration))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
