"""Cost of a PPO update relative to a bare causal-LM training step on the same tokens and engine.

    python benchmarks/bench_ppo.py                                  # tiny-llama, torch and deepspeed, CPU
    python benchmarks/bench_ppo.py --backends torch --repeats 7 --prompt_len 64 --response_len 128
    python benchmarks/bench_ppo.py --model_path /models/Qwen2.5-0.5B --micro_batch_size 4   # on a GPU

Prints, per backend, the seconds per token of
- bare:   a causal-LM step (forward over prompt + response, cross-entropy on the response tokens,
          backward, optimizer step) - what sft does;
- ppo:    one PPO update of the policy (stage.Updater: re-scored log-probs, clipped loss, entropy
          metric, finiteness checks, step), no critic;           target ratio ppo / bare <= 1.3
- ppo+critic: the same plus the critic's forward/backward/step;  target ratio <= 2.4
Each measurement is the median over `repeats` interleaved rounds (after a warm-up round), so a
noisy shared machine affects all three alike. On CPU the default clock is the process CPU time
with one thread (`--threads 1 --clock cpu`): the work done, unaffected by other processes
competing for the cores; on a GPU use `--clock wall`. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prmflow.components.common import config, modeling
from prmflow.components.common.engine import OptimSettings, TrainEngine
from prmflow.components.ppo import stage


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


def bare_step(engine: TrainEngine, micro: list[stage.MicroBatch]) -> None:
    """One SFT-style optimizer step on exactly the PPO micro-batches' tokens."""
    n_tokens = sum(int(mb.mask.sum()) for mb in micro)
    for j, mb in enumerate(micro):
        logits = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                        use_cache=False).logits
        R = mb.response_ids.shape[1]
        ce = torch.nn.functional.cross_entropy(logits[:, -(R + 1):-1].float().reshape(-1, logits.shape[-1]),
                                               mb.response_ids.reshape(-1), reduction="none").view(mb.mask.shape)
        stage._backward(engine, torch.where(mb.mask, ce, 0).sum() / n_tokens, boundary=j == len(micro) - 1)
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
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="wall" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    for backend in args.backends.split(","):
        cfg = config.load(stage.Config, overrides={
            "tracking.enabled": False, "engine.backend": backend, "engine.dtype": args.dtype,
            "minibatch_size": args.minibatch_size, "micro_batch_size": args.micro_batch_size, "critic": True})
        policy, tok = modeling.load_causal_lm(args.model_path, args.dtype)
        stage.disable_dropout(policy)
        samples = synthetic_samples(args.minibatch_size, args.prompt_len, args.response_len, policy.config.vocab_size)
        micro = [stage.collate(samples, rows, tok.pad_token_id)
                 for rows in stage.micro_split(list(range(args.minibatch_size)), args.micro_batch_size)]
        tokens = sum(mb.tokens for mb in micro)
        optim = OptimSettings(lr=1e-6, total_steps=1000)
        ga = args.minibatch_size // args.micro_batch_size
        bare_model, _ = modeling.load_causal_lm(args.model_path, args.dtype)
        stage.disable_dropout(bare_model)
        bare = TrainEngine(bare_model, cfg.engine, optim, args.micro_batch_size, ga)
        actor = TrainEngine(policy, cfg.engine, optim, args.micro_batch_size, ga)
        critic_model = _critic(args.model_path, args.dtype)  # same backbone size as the policy
        critic = TrainEngine(critic_model, cfg.engine, optim, args.micro_batch_size, ga)
        device = actor.device
        micro = [mb.to(device) for mb in micro]
        ppo = stage.Updater(cfg, actor, None, args.response_len)
        ppo_critic = stage.Updater(cfg, actor, critic, args.response_len)
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
        print(f"{backend:10s} {args.model_path} {args.clock} clock, tokens/update={tokens} "
              + " ".join(f"{k}={v * 1e6:.2f}us/token" for k, v in per_token.items())
              + f" | ppo/bare={per_token['ppo'] / per_token['bare']:.2f} (target <= 1.3)"
              + f" ppo+critic/bare={per_token['ppo+critic'] / per_token['bare']:.2f} (target <= 2.4)", flush=True)


def _critic(model_path: str, dtype: str):
    """The critic the stage would build: modeling.load_scalar_model on the policy's directory."""
    import tempfile

    if modeling.is_tiny(model_path):  # a preset has no directory yet: write one
        with tempfile.TemporaryDirectory() as d:
            lm, tok = modeling.load_causal_lm(model_path, dtype)
            modeling.save_pretrained(lm, tok, d)
            model, _ = modeling.load_scalar_model(d, dtype)
    else:
        model, _ = modeling.load_scalar_model(model_path, dtype)
    stage.disable_dropout(model)
    return model


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
