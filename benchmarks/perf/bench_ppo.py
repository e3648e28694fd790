"""Cost of a PPO update relative to a bare causal-LM training step on the same tokens and engine.

    python benchmarks/perf/bench_ppo.py                                  # tiny-llama, torch and deepspeed, CPU
    python benchmarks/perf/bench_ppo.py --backends torch --repeats 7 --prompt_len 64 --response_len 128
    python benchmarks/perf/bench_ppo.py --backends torch --vocab_size 151936   # Qwen2.5's vocabulary: LM head dominates
    python benchmarks/perf/bench_ppo.py --model_path /models/Qwen2.5-0.5B --micro_batch_size 4   # on a GPU
    python benchmarks/perf/bench_ppo.py --what loss --layers 2 --batch 4 --tokens 1174 --prompt_tokens 150   # memory

Prints, per backend, the seconds per token of
- bare:   a causal-LM step (forward over prompt + response with the LM head on the response
          positions only, `logits_to_keep` exactly as PPO's forward uses it; cross-entropy on the
          response tokens, backward, optimizer step) - what sft does, minus the head on the prompt;
- ppo:    one PPO update of the policy (update.Updater: re-scored log-probs, clipped loss, entropy
          metric, finiteness checks, step), no critic;           target ratio ppo / bare <= 1.1
- ppo+critic: the same plus the critic's forward/backward/step;  target ratio <= 2.4
Each measurement is the median over `repeats` interleaved rounds (after a warm-up round), so a
noisy shared machine affects all three alike. On CPU the default clock is the process CPU time
with one thread (`--threads 1 --clock cpu`): the work done, unaffected by other processes
competing for the cores; on a GPU use `--clock wall`. `--vocab_size N` swaps the tiny preset's
88-token character vocabulary for N (token ids drawn from all N; the body stays tiny), so with
151,936 (Qwen2.5's) the LM head and the per-token softmax over the vocabulary dominate the step.

`--what loss` measures the memory instead: the ppo stage's actor loss on one micro-batch, forward and backward
(`ppo.update.Updater.actor_loss`, then the engine's backward; no optimizer step), each path in a fresh process,
on the torch backend with gradient checkpointing as the cluster recipes train, at Qwen2.5-1.5B's head shapes
(peak_memory.py; `--layers` decoder layers): `--batch` responses of `--tokens - --prompt_tokens` tokens after
`--prompt_tokens`-token prompts (random ids). chunked: `head_chunk_rows` 512 (the default: the head reads the
response positions only, 512 rows at a time, recomputed in the backward pass); plain: `head_chunk_rows` 0, the
whole (B, R, V) logits, their cross-entropy and what the backward keeps of them. `--entropy_coef` > 0 adds the
entropy bonus (with gradient); 0 computes the entropy metric on 64 sampled tokens. The peak includes the weights'
gradients (the same on both paths). The row also gives the pass's process CPU time (`cpu_s`; with
OMP_NUM_THREADS=1 the work done, whatever else competes for the cores). `--ptx_rows` > 0 adds the ptx loss
(ptx_coef 1) on that many reference solutions of `--tokens` tokens, the first `--prompt_tokens` masked; a third
path, `ptx_whole`, reads the policy's head in chunks but the ptx loss's from its whole (B, T, V) logits
(`--paths chunked,ptx_whole`).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.training.engine import OptimSettings, TrainEngine
from prmflow.components.ppo import minibatches as batch, actor_critic as models, update
from prmflow.components.ppo import config as ppo_config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peak_memory


# the switch that trains a critic: `train_critic` (named `critic` before the config-key renames)
CRITIC_SWITCH = "train_critic" if "train_critic" in {f.name for f in dataclasses.fields(ppo_config.Config)} else "critic"


def synthetic_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(5, vocab, (prompt_len,), generator=g).tolist()
        r = torch.randint(5, vocab, (response_len,), generator=g).tolist()
        out.append({"prompt_ids": p, "response_ids": r, "old_logprobs": [-3.0] * response_len,
                    "advantages": torch.randn(response_len, generator=g).tolist(), "returns": [0.5] * response_len,
                    "values": [0.0] * response_len, "ref_logprobs": None, "kl": None})
    return out


def bare_step(engine: TrainEngine, micro: list[batch.MicroBatch]) -> None:
    """One SFT-style optimizer step on exactly the PPO micro-batches' tokens, through the forward PPO
    uses (models.response_logits: `logits_to_keep` = R + 1 when the model accepts it)."""
    n_tokens = sum(int(mb.mask.sum()) for mb in micro)
    keep = models.accepts_logits_to_keep(engine.module)
    for mb in micro:
        logits = models.response_logits(engine, mb, keep)  # (B, R, V)
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               mb.response_ids.reshape(-1), reduction="none").view(mb.mask.shape)
        engine.backward(torch.where(mb.mask, ce, 0).sum() / n_tokens)
    engine.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_path", default="tiny-llama")
    ap.add_argument("--backends", default="torch,deepspeed")
    ap.add_argument("--minibatch_size", type=int, default=32)
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=48)
    ap.add_argument("--response_len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab_size", type=int, default=0,
                    help="with a tiny preset: this vocabulary instead of its own (151936 = Qwen2.5's)")
    ap.add_argument("--head_chunk_rows", type=int, default=-1,
                    help="ppo's head_chunk_rows (0 = the whole logits; -1 = the config's default)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="wall" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--what", choices=["update", "loss"], default="update",
                    help="update: seconds per token against a bare step; loss: the actor loss's peak memory, chunked vs plain")
    loss = ap.add_argument_group("--what loss")
    loss.add_argument("--batch", type=int, default=4, help="responses in the micro-batch")
    loss.add_argument("--tokens", type=int, default=1174, help="prompt + response tokens per row")
    loss.add_argument("--prompt_tokens", type=int, default=150)
    loss.add_argument("--layers", type=int, default=1, help="decoder layers of the Qwen2.5-1.5B-shaped model")
    loss.add_argument("--paths", default="chunked,plain", help="comma-separated: chunked, plain, ptx_whole")
    loss.add_argument("--entropy_coef", type=float, default=0.0, help="the entropy bonus's coefficient")
    loss.add_argument("--ptx_rows", type=int, default=0, help="add the ptx loss on this many rows of --tokens")
    loss.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.what == "loss":
        return loss_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    for backend in args.backends.split(","):
        cfg = config.load(ppo_config.Config, overrides={
            "tracking.enabled": False, "engine.backend": backend, "engine.dtype": args.dtype,
            "minibatch_size": args.minibatch_size, "micro_batch_size": args.micro_batch_size, CRITIC_SWITCH: True,
            **({"head_chunk_rows": args.head_chunk_rows} if args.head_chunk_rows >= 0 else {})})
        policy, tok = _policy(args)
        models.disable_dropout(policy)
        samples = [batch.Sample.of(s) for s in  # collate takes typed samples
                   synthetic_samples(args.minibatch_size, args.prompt_len, args.response_len, policy.config.vocab_size)]
        micro = [batch.collate(samples, rows, tok.pad_token_id)
                 for rows in batch.micro_split(list(range(args.minibatch_size)), args.micro_batch_size)]
        tokens = sum(mb.tokens for mb in micro)
        optim = OptimSettings(lr=1e-6, total_steps=1000)
        ga = args.minibatch_size // args.micro_batch_size
        bare_model, _ = _policy(args)
        models.disable_dropout(bare_model)
        bare = TrainEngine(bare_model, cfg.engine, optim, args.micro_batch_size, ga)
        actor = TrainEngine(policy, cfg.engine, optim, args.micro_batch_size, ga)
        critic_model = _critic(args)  # same backbone size as the policy
        critic = TrainEngine(critic_model, cfg.engine, optim, args.micro_batch_size, ga)
        device = actor.device
        micro = [mb.to(device) for mb in micro]
        ppo = update.Updater(cfg, actor, None, args.response_len)
        ppo_critic = update.Updater(cfg, actor, critic, args.response_len)
        runs = {"bare": lambda: bare_step(bare, micro), "ppo": lambda: ppo.update(micro, True),
                "ppo+critic": lambda: ppo_critic.update(micro, True)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rnd in range(args.repeats + 1):
            for name, fn in runs.items():
                _sync()
                t0 = clock()
                fn()
                _sync()
                if rnd:  # round 0 is warm-up
                    times[name].append(clock() - t0)
        per_token = {k: statistics.median(v) / tokens for k, v in times.items()}
        print(f"{backend:10s} {args.model_path} vocab={policy.config.vocab_size} head_chunk_rows={cfg.head_chunk_rows} "
              f"logits_to_keep={models.accepts_logits_to_keep(policy)} {args.clock} clock, tokens/update={tokens} "
              + " ".join(f"{k}={v * 1e6:.2f}us/token" for k, v in per_token.items())
              + f" | ppo/bare={per_token['ppo'] / per_token['bare']:.2f} (target <= 1.1)"
              + f" ppo+critic/bare={per_token['ppo+critic'] / per_token['bare']:.2f} (target <= 2.4)", flush=True)
    return 0


def loss_main(args) -> int:
    """--what loss: one child process per path, then the table."""
    if args.child:
        print(json.dumps(one_loss(args)))
        return 0
    from peak_memory import child_rows

    rows = child_rows([[sys.executable, __file__, "--what", "loss", "--child", "--paths", path, "--batch", str(args.batch),
                        "--tokens", str(args.tokens), "--prompt_tokens", str(args.prompt_tokens), "--layers",
                        str(args.layers), "--dtype", args.dtype, "--entropy_coef", str(args.entropy_coef),
                        "--ptx_rows", str(args.ptx_rows)] for path in args.paths.split(",")])
    if isinstance(rows, int):
        return rows
    gib = 2**30
    print("\n| path | pass | dtype | batch x tokens (response) | peak memory of the pass | (B, R, V) float32 | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['pass']} | {r['dtype']} | {r['batch']} x {r['tokens']} ({r['response_tokens']}) | "
              f"{r['peak_bytes'] / gib:.2f} GiB | {r['btv_float32_bytes'] / gib:.2f} GiB | {r['wall_s']:.1f} s "
              f"({r['cpu_s']:.1f} s CPU) |")
    print(f"\nweights of the policy, not counted above: {rows[0]['weights_bytes'] / gib:.2f} GiB "
          f"({rows[0]['layers']} decoder layer(s), {rows[0]['device']})")
    return 0


def one_loss(args) -> dict:
    """Child process, --what loss: one measured actor-loss forward + backward; returns its JSON row."""
    from peak_memory import VOCAB, memory_now, memory_peak, qwen_1_5b_head

    from prmflow.components import config as config_lib
    from prmflow.components.ppo import minibatches as ppo_batch, losses, stage

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)

    cfg = config_lib.load(stage.Config, overrides={
        "tracking.enabled": False, "engine.backend": "torch", "engine.gradient_checkpointing": True,
        "engine.dtype": args.dtype, "minibatch_size": args.batch, "micro_batch_size": args.batch,
        "entropy_coef": args.entropy_coef, "head_chunk_rows": 0 if args.paths == "plain" else 512,
        "ptx_coef": 1.0 if args.ptx_rows else 0.0, "ptx_batch_size": max(args.ptx_rows, 1)})
    policy = qwen_1_5b_head(args.layers, dtype, device)
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


def _policy(args):
    """The policy (and tokenizer): the model at --model_path, or with --vocab_size a tiny preset with
    that vocabulary (same body, tied embeddings as the presets and Qwen2.5-0.5B)."""
    if not args.vocab_size:
        return modeling.load_causal_lm(args.model_path, args.dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model_path not in modeling.TINY_PRESETS:
        raise SystemExit("--vocab_size works with a tiny preset (--model_path tiny-llama or tiny-qwen2)")
    tok = modeling.build_tokenizer()
    spec = dict(modeling.TINY_PRESETS[args.model_path])
    cfg = AutoConfig.for_model(spec.pop("model_type"), vocab_size=args.vocab_size, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               tie_word_embeddings=True, **spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(modeling.torch_dtype(args.dtype)), tok


def _critic(args):
    """The critic the stage would build: modeling.load_scalar_model on the policy's directory."""
    import tempfile

    if modeling.is_tiny(args.model_path):  # a preset has no directory yet: write one
        with tempfile.TemporaryDirectory() as d:
            lm, tok = _policy(args)
            modeling.save_pretrained(lm, tok, d)
            model, _ = modeling.load_scalar_model(d, args.dtype)
    else:
        model, _ = modeling.load_scalar_model(args.model_path, args.dtype)
    models.disable_dropout(model)
    return model


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
