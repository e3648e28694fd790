"""How often a policy answers bare (the `answer: N` line alone) and how often each kind of answer is right.

    python benchmarks/experiments/bare_vs_worked.py SFT_DIR FINAL_DIR [...] [--config configs/quickstart.yaml] [--prompts 1000]

Greedy decoding of the arithmetic task's test split, in batches of --batch prompts: the prompts of the
evaluation in --config (its `evaluate` section's `arithmetic` keys and seed; default the quickstart's).
For each policy directory: pass@1, the share of bare answers, pass@1 among the bare ones and among
the worked ones (at least one step before the answer line). The "What sets the gain" table of docs/results.md
comes from this script run on the quickstart's SFT policy (`outputs/kfp-local/<run>/sft/policy`) and its
last PPO update (`.../ppo-3/updated/policy`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prmflow.components.models import modeling  # noqa: E402
from prmflow import tasks
from prmflow.components.sampling.generation import generate_texts  # noqa: E402
from prmflow.tasks import arithmetic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policies", nargs="+", help="HF policy directories")
    p.add_argument("--prompts", type=int, default=1000, help="test prompts (default 1000, the quickstart's evaluation)")
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"),
                   help="pipeline YAML whose evaluate section (arithmetic keys, seed) sets the prompts "
                        "(default: the quickstart's)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=200, help="prompts per generation batch")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file; pass a pipeline YAML (e.g. configs/quickstart.yaml)")
    section = (yaml.safe_load(Path(args.config).read_text()) or {}).get("evaluate") or {}
    records = tasks.load("arithmetic", "test", args.prompts, int(section.get("seed", 0)), **(section.get("arithmetic") or {}))
    print(f"{'policy':60s} {'pass@1':>7s} {'bare':>6s} {'right|bare':>10s} {'right|worked':>12s}")
    for d in args.policies:
        model, tok = modeling.load_causal_lm(d, "float32")
        model.eval()
        with torch.no_grad():
            responses = generate_texts(model, tok, [r.prompt for r in records], args.max_new_tokens, batch_size=args.batch)
        right = [tasks.verify(r, x) for r, x in zip(records, responses)]
        bare = [len(arithmetic.split_steps(x)) == 1 for x in responses]
        n_bare = sum(bare)
        on_bare = sum(ok for ok, b in zip(right, bare) if b) / max(n_bare, 1)
        on_worked = sum(ok for ok, b in zip(right, bare) if not b) / max(len(bare) - n_bare, 1)
        print(f"{d[-60:]:60s} {sum(right) / len(right):7.3f} {n_bare / len(bare):6.2f} {on_bare:10.3f} {on_worked:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
