"""ZeRO-3 memory per rank: parameters + gradients + optimizer state on 1 rank vs N ranks (gloo, CPU).

    python benchmarks/perf/bench_zero_memory.py [--ranks 2] [--layers 10] [--hidden 512]

A ~50M-parameter Llama built from a config (no download) is trained one AdamW step through
prmflow's TrainEngine (DeepSpeed, engine.zero_stage=3, float32) under `torchrun --nproc-per-node 1`
and `--nproc-per-node N`. Each rank then counts the bytes of the tensors it holds for the model's
state, each storage once:

- params:    each parameter's ZeRO-3 partition (`p.ds_tensor`) plus whatever of `p.data` is still
             materialized (nothing between steps);
- optimizer: every tensor in the wrapped torch optimizer's `state` (Adam's exp_avg, exp_avg_sq, step);
- grads, fp32 master, reduce bucket, other: every other tensor reachable from the DeepSpeed ZeRO-3
             optimizer object, walked through its attributes, lists and dicts, named by the attribute
             it hangs on (grad_partitions_flat_buffer, fp32_partitioned_groups_flat, ipg_buckets).

The ratio N-rank / 1-rank of the largest rank's model state (all but the reduce bucket, a fixed
communication buffer) is the figure of interest (target <= 0.55 for
2 ranks; ZeRO-3 partitions all three, so ~1/N plus the replicated buffers). Activations are not
counted (they scale with the micro-batch, not with the ranks). Plain PyTorch AdamW on one process
(params + grads + two moments, 16 bytes/parameter in float32) is printed as a reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


STATE = ("params", "grads", "master", "optimizer", "other")


def state(row: dict) -> int:
    return sum(row[k] for k in STATE)


def build_model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16384, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _walk(obj, seen_objs: set, found: dict, path: str = "", depth: int = 0) -> None:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts:
    {storage pointer: (bytes, first attribute path it was found at)}."""
    if depth > 6 or id(obj) in seen_objs:
        return
    seen_objs.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            st = obj.untyped_storage()
            found.setdefault(st.data_ptr(), (st.nbytes(), path))
        return
    if isinstance(obj, (list, tuple, set)):
        for i, x in enumerate(obj):
            _walk(x, seen_objs, found, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _walk(x, seen_objs, found, f"{path}[{k!r}]", depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for k, x in vars(obj).items():
            _walk(x, seen_objs, found, f"{path}.{k}", depth + 1)


def measure_rank(layers: int, hidden: int) -> dict:
    """One rank: one training step through TrainEngine (ZeRO-3), then its bytes by kind."""
    from prmflow.components.training.engine import EngineConfig, OptimSettings, TrainEngine

    model = build_model(layers, hidden)
    n_params = sum(p.numel() for p in model.parameters())
    engine = TrainEngine(model, EngineConfig(backend="deepspeed", zero_stage=3), OptimSettings(lr=1e-4, total_steps=10))
    ids = torch.randint(0, 16384, (2, 32), generator=torch.Generator().manual_seed(1))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()

    params: dict = {}
    for p in engine.module.parameters():
        for t in (getattr(p, "ds_tensor", None), p.data):
            if t is not None and t.numel():
                params[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    ds_opt = engine.optimizer                      # DeepSpeedZeroOptimizer_Stage3
    found: dict = {}
    _walk(ds_opt, set(), found)
    kinds = {"params": sum(params.values()), "grads": 0, "master": 0, "optimizer": 0, "buckets": 0, "other": 0}
    for ptr, (nbytes, path) in found.items():
        if ptr in params:
            continue
        kind = ("optimizer" if path.startswith(".optimizer.state") else "grads" if "grad_partitions" in path
                else "master" if "fp32_partitioned" in path else "buckets" if "ipg" in path else "other")
        kinds[kind] += nbytes
    import torch.distributed as dist

    return {"rank": dist.get_rank() if dist.is_initialized() else 0,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1, "n_params": n_params, **kinds}


def rank_main(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    row = measure_rank(args.layers, args.hidden)
    rows = [None] * row["world_size"]
    if dist.is_initialized() and row["world_size"] > 1:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if row["rank"] == 0:
        Path(args.result).write_text(json.dumps(rows))


def run(ranks: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               __file__, "--rank-main", "--result", str(result), "--layers", str(args.layers), "--hidden", str(args.hidden)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run(cmd, check=True, env=env)
        return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    mib = 2 ** 20
    one, many = run(1, args), run(args.ranks, args)
    n = one[0]["n_params"]
    print(f"model: Llama, {n / 1e6:.1f}M parameters, float32, ZeRO-3 (DeepSpeed, gloo, CPU); "
          f"plain AdamW reference: {16 * n / mib:.1f} MiB (16 B/param)")
    print("| ranks | rank | params | grads | fp32 master | Adam state | other | **model state** | B/param | reduce bucket |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in (one, many):
        for r in rows:
            print(f"| {r['world_size']} | {r['rank']} | " + " | ".join(f"{r[k] / mib:.1f}" for k in STATE)
                  + f" | **{state(r) / mib:.1f}** | {state(r) / n:.2f} | {r['buckets'] / mib:.1f} |")
    print("(MiB per rank; the reduce bucket is DeepSpeed's gradient-reduction buffer, sized by its "
          "reduce_bucket_size config, not by the model: the same on every rank and for any rank count)")
    worst = max(state(r) for r in many)
    print(f"model state, {args.ranks} ranks / 1 rank (largest rank): {worst / state(one[0]):.3f} (target <= 0.55); "
          f"with the bucket: {max(state(r) + r['buckets'] for r in many) / (state(one[0]) + one[0]['buckets']):.3f}")


if __name__ == "__main__":
    main()
