"""Implicit PRM (and rollout's log-probs, and the ppo actor loss): peak memory and time of one scoring pass
(or training step), the LM head read chunk by chunk vs whole (B, T, V) logits, at Qwen2.5-1.5B's head shapes.

    python benchmarks/perf/bench_implicit_prm.py --batch 32 --paths chunked
    python benchmarks/perf/bench_implicit_prm.py --batch 2 --paths chunked,plain [--train]
    python benchmarks/perf/bench_implicit_prm.py --what ppo --layers 2 --batch 4 --tokens 1174 --prompt_tokens 150

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
memory is the pass's own: on CPU the process's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the pass) minus its resident size then; on a GPU
torch.cuda.max_memory_allocated minus what was allocated before. Wall time is the measured pass.
Both exclude the two models' weights, which the table prints apart.

`--what logprobs` measures rollout's old / ref log-probs instead (`rollout.scoring.forward_logprobs` of the
policy, one model): chunked reads the head at the response positions only (the same `selected_logprobs`), plain
(`chunked=False`) makes the (B, T, V) logits of the whole batch and their float32 log-softmax, as before 2026-11-27.

`--what ppo` measures the ppo stage's actor loss on one micro-batch, forward and backward
(`ppo.update.Updater.actor_loss`, then the engine's backward; no optimizer step), on the torch backend with
gradient checkpointing as the cluster recipes train: `--batch` responses of `--tokens - --prompt_tokens`
tokens after `--prompt_tokens`-token prompts (random ids). chunked: `head_chunk_rows` 512 (the default: the
head reads the response positions only, 512 rows at a time, recomputed in the backward pass); plain:
`head_chunk_rows` 0, the whole (B, R, V) logits, their cross-entropy and what the backward keeps of them.
`--entropy_coef` > 0 adds the entropy bonus (with gradient); 0 computes the entropy metric on 64 sampled
tokens. The peak includes the weights' gradients (the same on both paths). The row also gives the pass's
process CPU time (`cpu_s`; with OMP_NUM_THREADS=1 the work done, whatever else competes for the cores).
`--ptx_rows` > 0 adds the ptx loss (ptx_coef 1) on that many reference solutions of `--tokens` tokens, the first
`--prompt_tokens` masked; a third path, `ptx_whole`, reads the policy's head in chunks but the ptx loss's from
its whole (B, T, V) logits, the computation before 2026-11-27 (`--paths chunked,ptx_whole`).
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prmflow.components.common.prm_model import PRM, HeadConfig  # noqa: E402
from prmflow.components.prm.data import step_bce  # noqa: E402

VOCAB, HIDDEN = 151_936, 1_536


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_now(device: str) -> int:
    """Bytes in use now, with the peak counter reset to it: the start of a measured pass."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    return rss_kib("VmRSS") * 1024


def memory_peak(device: str) -> int:
    """The peak bytes since memory_now."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else rss_kib("VmHWM") * 1024


def build(layers: int, dtype: torch.dtype, device: str) -> PRM:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8_960, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=32_768)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 28-layer body on a GPU in seconds, not a minute of CPU
        model = Qwen2ForCausalLM(cfg).to(dtype=dtype)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    return PRM(model, None, HeadConfig("implicit", beta=0.05), reference)


def one(args) -> dict:
    """Child process: one measured pass; prints its JSON row."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.what == "ppo":
        return one_ppo(args, device, dtype)
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
            from prmflow.components.rollout import scoring

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
            "pass": "logprobs" if args.what == "logprobs" else "train" if args.train else "score", "device": device, "layers": args.layers,
            "peak_bytes": peak - before, "btv_float32_bytes": args.batch * args.tokens * VOCAB * 4,
            "weights_bytes": weights, "wall_s": round(wall, 2), "z_finite": bool(torch.isfinite(z).all())}


def one_ppo(args, device: str, dtype: torch.dtype) -> dict:
    """Child process, --what ppo: one measured actor-loss forward + backward; returns its JSON row."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from prmflow.components.common import config as config_lib
    from prmflow.components.ppo import batch as ppo_batch, losses, models, stage, update

    cfg = config_lib.load(stage.Config, overrides={
        "tracking.enabled": False, "engine.backend": "torch", "engine.gradient_checkpointing": True,
        "engine.dtype": args.dtype, "minibatch_size": args.batch, "micro_batch_size": args.batch,
        "entropy_coef": args.entropy_coef, "head_chunk_rows": 0 if args.paths == "plain" else 512,
        "ptx_coef": 1.0 if args.ptx_rows else 0.0, "ptx_batch_size": max(args.ptx_rows, 1)})
    qcfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8_960, num_hidden_layers=args.layers,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32_768)
    torch.manual_seed(0)
    with torch.device(device):
        policy = Qwen2ForCausalLM(qcfg).to(dtype=dtype)
    models.disable_dropout(policy)
    actor = models.make_engine(policy, cfg, 1e-6, 10, 0, args.batch)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())

    def micro(B: int, P: int, R: int) -> ppo_batch.MicroBatch:
        g = torch.Generator().manual_seed(1)
        samples = [ppo_batch.Sample(prompt_ids=torch.randint(0, VOCAB, (P,), generator=g).tolist(),
                                    response_ids=torch.randint(0, VOCAB, (R,), generator=g).tolist(),
                                    advantages=torch.randn(R, generator=g).tolist(), old_logprobs=[-12.0] * R)
                   for _ in range(B)]
        return ppo_batch.collate(samples, list(range(B)), 0).to(device)

    def ptx_micro(B: int, P: int, R: int) -> dict[str, torch.Tensor] | None:
        if not args.ptx_rows:
            return None
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, VOCAB, (B, P + R), generator=g)
        labels = ids.clone()
        labels[:, :P] = -100  # the prompt is not trained on (supervised_data.IGNORE)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device), "labels": labels.to(device)}

    def run(mb: ppo_batch.MicroBatch, ptx_mb) -> torch.Tensor:
        up = update.Updater(cfg, actor, None, mb.mask.shape[1])
        up.ptx.chunked = args.paths == "chunked"  # ptx_whole: the policy's head in chunks, the ptx loss's whole
        norm = losses.Normalizer.of([mb.mask], mb.mask.shape[1])
        ptx_tokens = 0 if ptx_mb is None else int((ptx_mb["labels"][:, 1:] != -100).sum())
        loss, _ = up.actor_loss(mb, norm, norm, ptx_mb, ptx_tokens)
        loss.backward()
        assert up.score.chunked == (args.paths != "plain") and up.ptx.chunked == (args.paths == "chunked")
        return loss.detach()

    run(micro(1, 4, 12), ptx_micro(1, 4, 12))  # warm-up: lazy initialisation stays out of the measurement
    policy.zero_grad(set_to_none=True)
    mb = micro(args.batch, args.prompt_tokens, args.tokens - args.prompt_tokens)
    ptx_mb = ptx_micro(args.ptx_rows, args.prompt_tokens, args.tokens - args.prompt_tokens)
    before = memory_now(device)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = run(mb, ptx_mb)
    if device == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = memory_peak(device)
    R = args.tokens - args.prompt_tokens
    return {"path": args.paths, "batch": args.batch, "tokens": args.tokens, "response_tokens": args.batch * R,
            "dtype": args.dtype, "pass": "ppo actor fwd+bwd" + (f" entropy_coef={args.entropy_coef}" if args.entropy_coef else "")
            + (f" + ptx {args.ptx_rows} x {args.tokens}" if args.ptx_rows else ""), "ptx_rows": args.ptx_rows,
            "ptx_btv_float32_bytes": args.ptx_rows * args.tokens * VOCAB * 4,
            "device": device, "layers": args.layers, "peak_bytes": peak - before,
            "btv_float32_bytes": args.batch * R * VOCAB * 4, "weights_bytes": weights, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "z_finite": bool(torch.isfinite(loss).all())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=600, help="prompt + response tokens per row")
    parser.add_argument("--prompt_tokens", type=int, default=100)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--paths", default="chunked,plain", help="comma-separated: chunked, plain (--what ppo: also ptx_whole)")
    parser.add_argument("--train", action="store_true", help="measure a training step (forward + backward) instead")
    parser.add_argument("--what", default="prm", choices=["prm", "logprobs", "ppo"],
                        help="prm: the implicit PRM's pass; logprobs: rollout's old/ref log-probs of one model; "
                             "ppo: the ppo stage's actor loss, forward and backward")
    parser.add_argument("--entropy_coef", type=float, default=0.0, help="--what ppo: the entropy bonus's coefficient")
    parser.add_argument("--ptx_rows", type=int, default=0, help="--what ppo: add the ptx loss on this many rows of --tokens")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one(args)))
        return 0
    rows = []
    for path in args.paths.split(","):
        cmd = [sys.executable, __file__, "--child", "--paths", path, "--batch", str(args.batch), "--tokens",
               str(args.tokens), "--prompt_tokens", str(args.prompt_tokens), "--layers", str(args.layers),
               "--dtype", args.dtype, "--what", args.what, "--entropy_coef", str(args.entropy_coef), "--ptx_rows", str(args.ptx_rows)]
        cmd += ["--train"] if args.train else []
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    gib = 2**30
    btv = "(B, R, V)" if args.what == "ppo" else "(B, T, V)"
    print(f"\n| path | pass | dtype | batch x tokens (response) | peak memory of the pass | {btv} float32 | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['pass']} | {r['dtype']} | {r['batch']} x {r['tokens']} ({r['response_tokens']}) | "
              f"{r['peak_bytes'] / gib:.2f} GiB | {r['btv_float32_bytes'] / gib:.2f} GiB | {r['wall_s']:.1f} s"
              + (f" ({r['cpu_s']:.1f} s CPU) |" if "cpu_s" in r else " |"))
    print(f"\nweights of the {'policy' if args.what in ('logprobs', 'ppo') else 'PRM and its reference'}, not counted above: "
          f"{rows[0]['weights_bytes'] / gib:.2f} GiB "
          f"({rows[0]['layers']} decoder layer(s), {rows[0]['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
