"""Implicit PRM (and rollout's log-probs): peak memory and time of one scoring pass
(or training step), the LM head read chunk by chunk vs whole (B, T, V) logits, at Qwen2.5-1.5B's head shapes.

    python benchmarks/perf/bench_implicit_prm.py --batch 32 --paths chunked
    python benchmarks/perf/bench_implicit_prm.py --batch 2 --paths chunked,plain [--train]

The model: a Qwen2 built from a config (no download; random weights, which change no size) with
Qwen2.5-1.5B's hidden size 1,536, vocabulary 151,936, tied head, MLP 8,960 wide, 12 heads / 2 KV
heads, and `--layers` decoder layers (default 1: the body's activations are the same on both paths,
the head is what differs), plus its frozen copy as the reference, the pair `PRM.load` makes of a
policy. The batch: `--batch` rows of `--tokens` tokens, the response starting at `--prompt_tokens`
(random ids, no padding), the step logit read at every 50th response token.

- chunked: `PRM.__call__` as the scorer and the prm stages run it (`prm_model.selected_logprobs`: the
  head applied to the response tokens only, LOGIT_CHUNK_BYTES of float32 logits at a time);
- plain:   the same PRM with `chunked = False`, the computation it falls back to and the one it
  replaced: each model's whole (B, T, V) logits, then `implicit_step_logits`.

Each (path, batch) runs in a fresh process: build both models, one warm-up pass on 1 x 16 tokens,
then the measured pass (no_grad scoring; with --train, the step BCE's forward and backward). Peak
memory is the pass's own (peak_memory.py). Wall time is the measured pass.
Both exclude the two models' weights, which the table prints apart.

`--what logprobs` measures rollout's old / ref log-probs instead (`rollout.scoring.forward_logprobs` of the
policy, one model): chunked reads the head at the response positions only (the same `selected_logprobs`), plain
(`chunked=False`) makes the (B, T, V) logits of the whole batch and their float32 log-softmax, as before 2026-11-27.

The ppo actor loss, measured the same way: `benchmarks/perf/bench_ppo.py --what loss`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prmflow.components.models.prm_model import PRM, HeadConfig  # noqa: E402
from prmflow.components.prm.step_examples import step_bce  # noqa: E402
from peak_memory import VOCAB, child_rows, memory_now, memory_peak, qwen_1_5b_head  # noqa: E402

def build(layers: int, dtype: torch.dtype, device: str) -> PRM:
    model = qwen_1_5b_head(layers, dtype, device)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    return PRM(model, None, HeadConfig("implicit", beta=0.05), reference)


def one(args) -> dict:
    """Child process: one measured pass; prints its JSON row."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    prm = build(args.layers, dtype, device)
    prm.chunked = args.paths == "chunked"
    prm.model.train(args.train)
    models = (prm.model,) if args.what == "logprobs" else (prm.model, prm.reference)
    weights = sum(p.numel() * p.element_size() for m in models for p in m.parameters())

    def batch(B: int, T: int, start: int):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (B, T), generator=g).to(device)
        steps = torch.zeros(B, T, dtype=torch.bool, device=device)
        steps[:, start + 49::50] = True
        steps[:, T - 1] = True
        return ids, torch.ones_like(ids), torch.full((B,), start, device=device), steps

    def run(ids, mask, start, steps):
        if args.what == "logprobs":  # rollout's scoring pass: lists of token ids in, one array per row out
            from prmflow.components.rollout import response_scores as scoring

            rows = ids.tolist()
            cut = int(start[0])
            return torch.from_numpy(np.concatenate(scoring.forward_logprobs(
                prm.model, [r[:cut] for r in rows], [r[cut:] for r in rows], batch_size=len(rows),
                chunked=args.paths == "chunked")))
        if not args.train:
            with torch.no_grad():
                return prm(ids, mask, response_start=start)
        z = prm(ids, mask, response_start=start)
        step_bce(z, steps.float(), steps)[0].backward()
        return z.detach()

    run(*batch(1, 16, 4))  # warm-up: lazy initialisation stays out of the measurement
    prm.model.zero_grad(set_to_none=True)
    inputs = batch(args.batch, args.tokens, args.prompt_tokens)
    before = memory_now(device)
    t0 = time.perf_counter()
    z = run(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = memory_peak(device)
    return {"path": args.paths, "batch": args.batch, "tokens": args.tokens,
            "response_tokens": args.batch * (args.tokens - args.prompt_tokens), "dtype": args.dtype,
            "pass": "logprobs" if args.what == "logprobs" else "train" if args.train else "score",
            "device": device, "layers": args.layers,
            "peak_bytes": peak - before, "btv_float32_bytes": args.batch * args.tokens * VOCAB * 4,
            "weights_bytes": weights, "wall_s": round(wall, 2), "z_finite": bool(torch.isfinite(z).all())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=600, help="prompt + response tokens per row")
    parser.add_argument("--prompt_tokens", type=int, default=100)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--paths", default="chunked,plain", help="comma-separated: chunked, plain")
    parser.add_argument("--train", action="store_true", help="measure a training step (forward + backward) instead")
    parser.add_argument("--what", default="prm", choices=["prm", "logprobs"],
                        help="prm: the implicit PRM's pass; logprobs: rollout's old/ref log-probs of one model")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one(args)))
        return 0
    rows = child_rows([[sys.executable, __file__, "--child", "--paths", path, "--batch", str(args.batch), "--tokens",
                        str(args.tokens), "--prompt_tokens", str(args.prompt_tokens), "--layers", str(args.layers),
                        "--dtype", args.dtype, "--what", args.what] + (["--train"] if args.train else [])
                       for path in args.paths.split(",")])
    if isinstance(rows, int):
        return rows
    gib = 2**30
    print("\n| path | pass | dtype | batch x tokens (response) | peak memory of the pass | (B, T, V) float32 | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['pass']} | {r['dtype']} | {r['batch']} x {r['tokens']} ({r['response_tokens']}) | "
              f"{r['peak_bytes'] / gib:.2f} GiB | {r['btv_float32_bytes'] / gib:.2f} GiB | {r['wall_s']:.1f} s |")
    print(f"\nweights of the {'policy' if args.what == 'logprobs' else 'PRM and its reference'}, not counted above: "
          f"{rows[0]['weights_bytes'] / gib:.2f} GiB "
          f"({rows[0]['layers']} decoder layer(s), {rows[0]['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
