"""Rollout generation throughput: the HF engine against model.generate and a naive recompute loop.

    python benchmarks/perf/bench_rollout.py                      # tiny-llama, 64 prompts, batch 64, 64 new tokens
    python benchmarks/perf/bench_rollout.py --policy ~/.cache/prmflow-tests/sft-policy-... --natural-eos

Three ways to sample the same prompts with the same batch, the same number of new tokens per
sample (EOS ignored, so every sample has exactly --max-new-tokens) and the same sampling
(temperature 1), each recording the log-probability of every sampled token:

- engine:   prmflow's HFEngine (KV-cache loop, logprobs from the raw logits at each step);
- generate: `model.generate(do_sample=True, output_logits=True, return_dict_in_generate=True)`,
            then log_softmax over the returned logits gathered at the sampled tokens;
- naive:    for every new token, a full forward pass over prompt + everything generated so far.

Timing: one process runs the methods interleaved for --repeats rounds after a warm-up (so the load
of a shared machine hits them alike) and keeps each method's best round. Peak memory: one more
process per method, one run each, so each peak is its own. Prints tokens/s, peak RSS and the ratios
engine/generate (target >= 0.9) and engine/naive (target >= 10); exits 1 when a target is missed.
`--natural-eos` lets samples stop at EOS instead (lengths differ per sample; the engine drops
finished samples from the batch, generate keeps padding them), reported but not held to a target.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGETS = {"generate": 0.9, "naive": 10.0}


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _setup(args):
    import torch

    from prmflow.components.models import modeling
    from prmflow import tasks

    torch.manual_seed(0)
    model, tok = modeling.load_causal_lm(args.policy)
    model.eval()
    prompts = [tok(r.prompt)["input_ids"] for r in tasks.load("arithmetic", "train", args.prompts, seed=0)]
    return model, tok, prompts


def run_engine(model, tok, prompts, args) -> int:
    from prmflow.components.sampling.engines import HFEngine, SamplingParams

    engine = HFEngine(model, tok, batch_size=args.batch)
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                                  ignore_eos=not args.natural_eos, seed=0))
    return sum(len(c.token_ids) for g in out for c in g)


def run_generate(model, tok, prompts, args) -> int:
    import torch

    from prmflow.components.sampling.engines import left_pad

    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                   output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    if not args.natural_eos:
        gen_cfg.eos_token_id = None
    tokens = 0
    with torch.no_grad():
        for b in range(0, len(prompts), args.batch):
            ids, mask = left_pad(prompts[b:b + args.batch], tok.pad_token_id, "cpu")
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
            new = out.sequences[:, ids.shape[1]:]  # (B, T)
            logits = torch.stack(out.logits, dim=1).float()  # (B, T, V) raw logits
            logp = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]  # (B, T)
            if args.natural_eos:  # count up to and including the first EOS
                is_eos = new == tok.eos_token_id
                first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1,
                                    torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long))
                tokens += int(first.sum())
            else:
                tokens += new.numel()
            del logp
    return tokens


def run_naive(model, tok, prompts, args) -> int:
    """The approach the engine avoids: recompute the whole sequence for every new token."""
    import torch

    from prmflow.components.sampling.engines import left_pad

    gen = torch.Generator().manual_seed(0)
    tokens = 0
    with torch.no_grad():
        for b in range(0, len(prompts), args.batch):
            ids, mask = left_pad(prompts[b:b + args.batch], tok.pad_token_id, "cpu")
            logps = []
            alive = torch.ones(len(ids), dtype=torch.bool)
            for _ in range(args.max_new_tokens):
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
                tok_ = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)  # (B, 1)
                logps.append(torch.log_softmax(logits, -1).gather(-1, tok_)[:, 0])
                tokens += int(alive.sum())
                if args.natural_eos:
                    alive &= tok_[:, 0] != tok.eos_token_id
                    if not alive.any():
                        break
                ids = torch.cat([ids, tok_], 1)
                mask = torch.cat([mask, torch.ones_like(tok_)], 1)
    return tokens


METHODS = {"engine": run_engine, "generate": run_generate, "naive": run_naive}


def timing_child(args) -> None:
    """Time the methods in one process, interleaved round by round (a shared machine's load then hits
    them alike); the best round of each counts. The slow naive loop runs --naive-repeats rounds."""
    import torch

    torch.set_num_threads(args.threads)
    model, tok, prompts = _setup(args)
    methods = args.methods.split(",")
    for m in methods:
        if m != "naive":
            METHODS[m](model, tok, prompts, args)  # warm-up
    best = {m: float("inf") for m in methods}
    tokens = {}
    for r in range(args.repeats):
        for m in methods:
            if m == "naive" and r >= args.naive_repeats:
                continue
            t0 = time.perf_counter()
            tokens[m] = METHODS[m](model, tok, prompts, args)
            best[m] = min(best[m], time.perf_counter() - t0)
    print(json.dumps({m: {"tokens": tokens[m], "seconds": best[m], "tokens_per_s": tokens[m] / best[m]} for m in methods}))


def memory_child(args) -> None:
    """Peak RSS of one run of one method, in a process of its own."""
    import torch

    torch.set_num_threads(args.threads)
    model, tok, prompts = _setup(args)
    base = _status_mb("VmRSS")
    METHODS[args.method](model, tok, prompts, args)
    print(json.dumps({"peak_rss_mb": _status_mb("VmHWM"), "rss_after_load_mb": base}))


def _child(args_list: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args_list], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="tiny-llama", help="model directory or tiny preset")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-repeats", type=int, default=1, help="timed runs of the (slow) naive loop")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--natural-eos", action="store_true", help="let samples stop at EOS (no targets checked)")
    p.add_argument("--methods", default="engine,generate,naive")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.timing:
        timing_child(args)
        return 0
    if args.method:
        memory_child(args)
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = _child([*passthrough, "--timing"])
    for method in args.methods.split(","):
        results[method].update(_child([*passthrough, "--method", method]))
        r = results[method]
        print(f"{method:>9}: {r['tokens']} tokens in {r['seconds']:.3f} s = {r['tokens_per_s']:9.1f} tokens/s, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB ({r['peak_rss_mb'] - r['rss_after_load_mb']:+.0f} MB over the loaded model)")
    ok = True
    if "engine" in results:
        for other, target in TARGETS.items():
            if other not in results:
                continue
            ratio = results["engine"]["tokens_per_s"] / results[other]["tokens_per_s"]
            met = ratio >= target
            ok &= met or args.natural_eos
            status = "" if args.natural_eos else ("  ok" if met else "  MISSED")
            print(f"engine / {other}: {ratio:.2f}x (target >= {target}){status}")
    print(f"setup: policy={args.policy} prompts={args.prompts} batch={args.batch} max_new_tokens={args.max_new_tokens} "
          f"threads={args.threads} repeats={args.repeats} natural_eos={args.natural_eos}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
