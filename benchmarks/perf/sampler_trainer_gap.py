"""How far the rollout's old log-probs are from the ppo engine's own forward, on this machine.

    python benchmarks/perf/sampler_trainer_gap.py                          # the tests' tiny SFT policy
    python benchmarks/perf/sampler_trainer_gap.py --policy outputs/sft --prompts 64 --output /tmp/gap
    python benchmarks/perf/sampler_trainer_gap.py --correction-only --sampler vllm    # on a GPU, vLLM's bf16 rollout

For each rollout dtype (bfloat16, float32) it runs rollout -> advantage (grpo) -> ppo (torch engine, one
epoch, one minibatch of every response) with the ppo engine in float32 and in bfloat16 (autocast over fp32
weights), once reading the hand-off's old_logprobs and once recomputing them, and prints per case the first
update's ratio range (exactly 1 is what PPO assumes before any update) and, where recomputed, the gap
|hand-off - recomputed| (max, mean over the response tokens: `ppo/old_logprob_gap_*`). On a GPU the rollout's
`dtype: auto` is bfloat16, which is why the ppo stage recomputes by default there (docs/design.md, PPO).
Measured on an H200 and on CPU: docs/testing.md, "On a GPU".

Then, for the bfloat16 rollout against the float32 trainer (old_logprobs recomputed), the rollout correction
(ppo `rollout_correction`): per mode, the importance weights' statistics and the first update's policy loss
and gradient norm, beside no correction. `--correction-only` skips the first table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_policy() -> str:
    """The tests' cached tiny SFT policy (trained once, tests/sft_cache.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import POLICY_OVERRIDES
    from sft_cache import cached_sft

    return str(cached_sft("sft-policy", POLICY_OVERRIDES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="", help="policy directory (default: the tests' tiny SFT policy)")
    ap.add_argument("--prompts", type=int, default=32, help="arithmetic prompts per rollout (default 32)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    ap.add_argument("--output", default="outputs/sampler-trainer-gap", help="where the runs are written")
    ap.add_argument("--correction-only", action="store_true", help="only the rollout-correction table (bf16 rollout)")
    ap.add_argument("--sampler", default="hf", choices=["hf", "vllm"], help="the rollout's sampler (vllm: on a GPU)")
    args = ap.parse_args(argv)

    import torch

    from prmflow.components.advantage import stage as advantage
    from prmflow.components import config
    from prmflow.components.ppo import stage as ppo
    from prmflow.components.rollout import stage as rollout

    policy = args.policy or tiny_policy()
    root, off, n = Path(args.output), {"tracking.enabled": False}, args.prompts * args.samples
    print(f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}; policy {policy}")

    def hand_off(rdt: str) -> Path:
        roll, adv = root / rdt / "rollouts", root / rdt / "advantages"
        rollout.run(config.load(rollout.Config, overrides={**off, "policy": policy, "output": str(roll), "dtype": rdt,
                                                           "num_prompts": args.prompts, "n_samples": args.samples,
                                                           "sampler": args.sampler, "overwrite": True}))
        advantage.run(config.load(advantage.Config, overrides={**off, "input": str(roll), "output": str(adv),
                                                               "estimator": "grpo", "overwrite": True}))
        return adv

    def train(adv: Path, out: Path, **over) -> tuple[dict, dict]:
        m = ppo.run(config.load(ppo.Config, overrides={
            **off, "policy": policy, "input": str(adv), "output": str(out), "overwrite": True, "engine.backend": "torch",
            "minibatch_size": n, "micro_batch_size": min(n, 16), "epochs": 1, **over}))
        return m, json.loads((out / "updates.jsonl").read_text().splitlines()[0])

    if not args.correction_only:
        gap_table(hand_off, train, root)
    adv = root / "bfloat16" / "advantages" if not args.correction_only else hand_off("bfloat16")
    print(f"\nbf16 rollout ({args.sampler} sampler), float32 trainer (old_logprobs recomputed), rollout_correction cap 2:")
    print("| rollout_correction | is_weight_mean | is_weight_raw_max | is_capped_frac | first policy loss | first grad norm |")
    print("|---|---|---|---|---|---|")
    for mode in ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        m, first = train(adv, root / "bfloat16" / f"ppo-correction-{mode}", **{
            "engine.dtype": "float32", "recompute_old_logprobs": True, "rollout_correction": mode})
        stats = " | ".join(f"{m[f'train/{k}']:.4f}" if mode != "none" else "-"
                           for k in ("is_weight_mean", "is_weight_raw_max", "is_capped_frac"))
        print(f"| {mode} | {stats} | {first['policy_loss']:.5f} | {first['grad_norm']:.5f} |", flush=True)
    return 0


def gap_table(hand_off, train, root: Path) -> None:
    print("| rollout dtype | ppo engine dtype | old_logprobs | first ratio min | first ratio max | gap max | gap mean |")
    print("|---|---|---|---|---|---|---|")
    for rdt in ("bfloat16", "float32"):
        adv = hand_off(rdt)
        for edt in ("float32", "bfloat16"):
            for recompute in (False, True):
                m, first = train(adv, root / rdt / f"ppo-{edt}-{'recompute' if recompute else 'handoff'}",
                                 **{"engine.dtype": edt, "recompute_old_logprobs": recompute})
                gap = (f"{m['train/old_logprob_gap_max']:.2e} | {m['train/old_logprob_gap_mean']:.2e}"
                       if recompute else "- | -")
                print(f"| {rdt} | {edt} | {'recomputed' if recompute else 'hand-off'} | {first['ratio_min']:.6f} | "
                      f"{first['ratio_max']:.6f} | {gap} |", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(rc)
