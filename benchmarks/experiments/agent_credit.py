"""Per-turn credit against outcome-only GRPO for the memory agent, at equal rollout budget (docs/agents.md).

    python benchmarks/experiments/agent_credit.py --config configs/agent-memory.yaml --output outputs/agent-credit
    python benchmarks/experiments/agent_credit.py --help

One start (the config's SFT policy and PRM: trained here through the stages, or given with --sft-model and
--prm-model), then for every variant x RL seed one `prmflow pipeline run-local` from that start with
`pipeline.iterations` updates of the same rollout budget (rollout.num_prompts x n_samples episodes each); seed s
sets rollout, ppo and evaluate's seeds, so seed s pairs the variants. Variants differ only in where each turn's
reward comes from:

- outcome-only: GRPO on the episode's outcome (r1 + beta*r3); no per-turn reward;
- env-per-turn: the environment's per-action rewards (r2_t + gamma*r4_t, `rollout.prm: oracle`) as step rewards
  (the config's advantage: REINFORCE++-baseline with returns-to-go);
- prm-per-turn: the trained PRM's score of each turn as its step reward (the config as written; the PRM frozen);
- prm-per-turn-on-policy: the same PRM kept on-policy (`pipeline.prm_update`: after every rollout `prm-update`
  trains it on those episodes' outcomes, one step per turn, and the next rollout is scored by the updated PRM);
- outcome-only-rb: the per-turn arms' estimator (REINFORCE++-baseline) on the outcome alone: what the estimator
  does without a per-turn reward.

Held-out QA accuracy of greedy episodes (`eval/qa_accuracy`) at the end (the run's evaluate) and at half the
budget (the evaluate stage on the policy after half the updates, same config and seed). Writes OUTPUT/results.json
and OUTPUT/table.md (per seed, each variant's difference from outcome-only, their mean and standard deviation, and
a paired t-test over seeds); each run's own root (logs, MLflow store) stays under OUTPUT/runs/VARIANT/seed-S. A
finished run (its result.json) is not run again. Run from the repository root; OMP_NUM_THREADS=1 per job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prm_vs_outcome_stats as bench_stats  # noqa: E402

#: variant -> the run-local --set overrides that make it (laid over the config and --set)
VARIANTS = {
    "outcome-only": ["advantage.estimator=grpo", "advantage.step_rewards=false"],
    "env-per-turn": ["rollout.prm=oracle"],
    "prm-per-turn": [],
    "prm-per-turn-on-policy": ["pipeline.prm_update=true"],
    "outcome-only-rb": ["advantage.step_rewards=false"],  # the per-turn arms' estimator on the outcome alone
}
REFERENCE = "outcome-only"
METRIC = "eval/qa_accuracy"


def train_start(config: Path, out: Path) -> tuple[str, str]:
    """The config's SFT policy and PRM (its sft and prm sections), trained once into OUTPUT/start."""
    from prmflow.components import config as config_lib
    from prmflow.components.prm import stage as prm_stage
    from prmflow.components.sft import stage as sft_stage
    from prmflow.pipelines.settings import load_spec

    spec = load_spec(config)
    sft_dir, prm_dir = out / "start" / "sft", out / "start" / "prm"
    off = {"tracking.enabled": False}
    if not (sft_dir / "manifest.json").is_file():
        sft_stage.run(config_lib.build(sft_stage.Config, {**config_lib.flatten(spec.stages["sft"]), **off,
                                                          "output": str(sft_dir), "overwrite": True}, "[sft]"))
    if not (prm_dir / "manifest.json").is_file():
        prm_stage.run(config_lib.build(prm_stage.Config, {**config_lib.flatten(spec.stages["prm"]), **off,
                                                          "backbone": str(sft_dir), "output": str(prm_dir),
                                                          "overwrite": True}, "[prm]"))
    return str(sft_dir), str(prm_dir)


def run_one(args, variant: str, seed: int, sft: str, prm: str) -> dict:
    """One run-local from the start, then evaluate on the policy after half the updates; its result.json."""
    root = args.output / "runs" / variant / f"seed-{seed}"
    done = root / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sets = [f"pipeline.sft_model={sft}", f"pipeline.prm_model={prm}", f"pipeline.iterations={args.iterations}",
            f"pipeline.tracking_uri=sqlite:///{(root / 'mlflow.db').resolve()}", f"rollout.seed={seed}",
            f"ppo.seed={seed}", f"evaluate.seed={seed}", *args.set, *VARIANTS[variant]]
    cmd = ["prmflow", "pipeline", "run-local", "--config", str(args.config), "--root", str(root)]
    with open(root / "console.log", "w") as log:
        subprocess.run([*cmd, *(x for s in sets for x in ("--set", s))], check=True, stdout=log, stderr=log, env=env)
        final = json.loads(next(root.glob("prmflow-*/evaluate/results/manifest.json")).read_text())["metrics"]
        half_policy = next(root.glob(f"workspace/ppo-{args.iterations // 2 - 1}-*/policy"))
        section = root / "evaluate-section.yaml"
        section.write_text(yaml.safe_dump(yaml.safe_load(args.config.read_text())["evaluate"]))
        subprocess.run(["prmflow", "evaluate", "--config", str(section), "--policy", str(half_policy), "--prm", prm,
                        "--output", str(root / "half"), "--seed", str(seed), "--tracking.enabled", "false",
                        "--overwrite", "true"], check=True, stdout=log, stderr=log, env=env)
    half = json.loads((root / "half" / "manifest.json").read_text())["metrics"]
    result = {"variant": variant, "seed": seed, "half": half[METRIC], "final": final[METRIC],
              "half_metrics": half, "final_metrics": final}
    done.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict], seeds: list[int]) -> str:
    by = {(r["variant"], r["seed"]): r for r in results}
    variants = [v for v in VARIANTS if all((v, s) in by for s in seeds)]
    lines = ["| seed | " + " | ".join(f"{v}: half / end" for v in variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for s in seeds:
        lines.append(f"| {s} | " + " | ".join(f"{by[v, s]['half']:.3f} / {by[v, s]['final']:.3f}" for v in variants) + " |")
    lines += ["", f"| variant - {REFERENCE} | at half: mean (sd), p | at the end: mean (sd), p |", "|---|---|---|"]
    for v in variants:
        if v == REFERENCE:
            continue
        cells = []
        for point in ("half", "final"):
            a, b = [by[v, s][point] for s in seeds], [by[REFERENCE, s][point] for s in seeds]
            d = [x - y for x, y in zip(a, b)]
            sd = statistics.stdev(d) if len(d) > 1 else float("nan")
            cells.append(f"{100 * statistics.mean(d):+.1f} points ({100 * sd:.1f}), "
                         f"p = {bench_stats.format_p(bench_stats.paired_seed_test(a, b))}")
        lines.append(f"| {v} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/agent-memory.yaml"), help="the pipeline config")
    p.add_argument("--output", type=Path, default=Path("outputs/agent-credit"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="RL seeds (rollout, ppo, evaluate)")
    p.add_argument("--iterations", type=int, default=4, help="RL updates per run (even: half is a point)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each OMP_NUM_THREADS=1 by default)")
    p.add_argument("--sft-model", default="", help="the start's SFT policy (default: trained from the config)")
    p.add_argument("--prm-model", default="", help="the start's PRM (default: trained from the config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-local override for every run")
    args = p.parse_args(argv)
    if args.iterations < 2 or args.iterations % 2:
        p.error(f"--iterations {args.iterations}: give an even number of at least 2 (half the budget is a point).")
    if REFERENCE not in args.variants:
        args.variants.insert(0, REFERENCE)
    args.output.mkdir(parents=True, exist_ok=True)
    sft, prm = (args.sft_model, args.prm_model) if args.sft_model and args.prm_model else train_start(args.config, args.output)
    jobs = [(v, s) for s in args.seeds for v in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(args, *job, sft, prm), jobs))
    text = table(results, args.seeds)
    (args.output / "results.json").write_text(json.dumps({"start": {"sft": sft, "prm": prm}, "runs": results}, indent=1))
    (args.output / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
