"""Cost of a PPO update relative to a bare causal-LM training step on the same tokens and engine.

    python benchmarks/perf/bench_ppo.py                                  # tiny-llama, torch and deepspeed, CPU
    python benchmarks/perf/bench_ppo.py --backends torch --repeats 7 --prompt_len 64 --response_len 128
    python benchmarks/perf/bench_ppo.py --backends torch --vocab_size 151936   # Qwen2.5's vocabulary: LM head dominates
    python benchmarks/perf/bench_ppo.py --model_path /models/Qwen2.5-0.5B --micro_batch_size 4   # on a GPU

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
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from prmflow.components.common import config, modeling
from prmflow.components.common.engine import OptimSettings, TrainEngine
from prmflow.components.ppo import batch, models, update
from prmflow.components.ppo import config as ppo_config


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


def main(argv=None) -> None:
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
    args = ap.parse_args(argv)
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
    main()
