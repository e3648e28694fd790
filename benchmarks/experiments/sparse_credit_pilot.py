"""The advantage stage alone on simulated weak-start batches: what the map fitted on outcomes and the map fitted on
shared-prefix labels do to the advantages (docs/experiments/6-sparse-outcomes.md, "Pilot").

    python benchmarks/experiments/sparse_credit_pilot.py --batches 20

Batches come from tests/advantage/sparse_rollouts.py (32 prompts x 8 samples, about 10 % right; PRMs good, answer-only,
random, late-drop). For each PRM and each calibration_labels value (outcome: the recipe; shared_prefix: the candidate)
it runs the stage with `estimator: grpo_progress` and with `estimator: grpo` on the same batch and prints, in Markdown,
over the batches: how many read a map (spread > 0 at a fold), the mean spread, label AUC and labelled share, the mean
absolute change per token against GRPO, and the mean advantage of a failure's first wrong step and of the right steps
before it in the groups where every response failed (GRPO's is 0 there). No policy, no RL: a property of the credit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "advantage"))

import sparse_rollouts  # noqa: E402

from prmflow.components.advantage import stage  # noqa: E402
from prmflow.components.data import schema  # noqa: E402
from prmflow.tracking import TrackingConfig  # noqa: E402


def advantages(rows: list[dict], work: Path, **keys) -> tuple[dict, dict]:
    """(summary, {(prompt_id, sample_idx): advantages}) of the stage run on `rows` with `keys`."""
    with schema.DatasetWriter(work / "rollouts", "rollouts") as w:
        w.write(pa.Table.from_pylist(rows))
    summary = stage.run(stage.Config(input=str(work / "rollouts"), output=str(work / "advantages"),
                                     tracking=TrackingConfig(enabled=False), **keys))
    out = schema.read_dataset(work / "advantages", "advantages").to_pylist()
    return summary, {(r["prompt_id"], r["sample_idx"]): np.array(r["advantages"]) for r in out}


def row_of_table(prm: str, labels: str, batches: int) -> str:
    read, spread, label_auc, share, change, first_wrong, right_before = [], [], [], [], [], [], []
    for seed in range(batches):
        rows = sparse_rollouts.chain_rows(np.random.default_rng(seed), prm)
        right = {(r["prompt_id"], r["sample_idx"]): r.pop("right_steps") for r in rows}
        with tempfile.TemporaryDirectory() as d:
            s, new = advantages(rows, Path(d) / "new", estimator="grpo_progress", calibration_labels=labels)
            _, grpo = advantages(rows, Path(d) / "grpo", estimator="grpo")
        read.append(s["advantage/prm_calibrated_spread"] > 0)
        spread.append(s["advantage/prm_calibrated_spread"])
        label_auc.append(s.get("advantage/prm_label_auc", np.nan))
        share.append(s.get("advantage/labelled_share", np.nan))
        change.append(np.concatenate([np.abs(new[k] - grpo[k]) for k in grpo]).mean())
        failed = {r["prompt_id"] for r in rows} - {r["prompt_id"] for r in rows if r["outcome_reward"] > 0}
        for r in rows:
            key, ends = (r["prompt_id"], r["sample_idx"]), r["step_ends"]
            if r["prompt_id"] in failed:
                j = right[key]
                start = ends[j - 1] + 1 if j else 0
                first_wrong.append(new[key][start:ends[j] + 1].mean())
                if j:
                    right_before.append(new[key][:start].mean())
    shared = labels == "shared_prefix"
    return (f"| {prm} | {labels} | {sum(read)} of {batches} | {np.mean(spread):.3f} | "
            f"{f'{np.nanmean(label_auc):.3f}' if shared else '-'} | {f'{np.nanmean(share):.2f}' if shared else '-'} | "
            f"{np.mean(change):.4f} | {np.mean(first_wrong):+.3f} / {np.mean(right_before):+.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="simulated batches per PRM (seeds 0..N-1)")
    args = parser.parse_args(argv)
    print("| PRM | labels | map read (batches) | spread | label AUC | labelled share | mean abs change per token vs "
          "GRPO | all-wrong groups: first wrong step / right steps before it |")
    print("|---|---|---|---|---|---|---|---|")
    for prm in sparse_rollouts.PRMS:
        for labels in ("outcome", "shared_prefix"):
            print(row_of_table(prm, labels, args.batches), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
