"""Advantage stage benchmark: prints ratios (not part of the test suite).

    python benchmarks/bench_advantage.py [--sequences 4096] [--max-len 1024] [--big 65536] [--skip-memory]

1. Throughput: the stage (Parquet in -> Parquet out) against a plain pyarrow read + write of the
   same columns with no computation (the four new columns are copies of existing float columns,
   so both write the same bytes), zstd like the hand-off writer: streamed in 1,024-row batches,
   and read_table + write_table of the whole input. Ratio = stage throughput / plain throughput
   (target >= 0.7), in wall time and in process CPU time.
2. GAE: the vectorized estimator against the common per-token loop
   (`for t in reversed(range(T))` over padded (B, T) torch tensors), same data, same process;
   target >= 5x. Both get their batch in their own layout, built beforehand.
3. Memory: peak RSS of the stage in a fresh subprocess on --sequences and on --big sequences;
   target: the larger run stays within 25% of the smaller.

Responses are ragged, lengths uniform in 1..max-len, 8 samples per prompt, 4 scored steps each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prmflow.components.advantage import estimators, stage  # noqa: E402
from prmflow.components.common import schema  # noqa: E402
from prmflow.components.common.tracking import TrackingConfig  # noqa: E402

GROUP = 8


def _lists(lengths: np.ndarray, values: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def rollouts_chunk(rng: np.random.Generator, start: int, rows: int, max_len: int) -> pa.Table:
    """`rows` scored rollouts (prompt ids continue from row `start`), built from flat arrays."""
    lengths = rng.integers(1, max_len + 1, rows)
    n = int(lengths.sum())
    old = -rng.exponential(1.0, n).astype(np.float32)
    n_steps = np.minimum(lengths, 4)
    # step ends: evenly spread over the response, the last one at its final token
    frac = np.tile(np.arange(1, 5) / 4, rows)[: 4 * rows].reshape(rows, 4)
    ends = np.ceil(frac * lengths[:, None]).astype(np.int32) - 1
    keep = np.arange(4)[None, :] >= 4 - n_steps[:, None]
    ids = np.arange(start, start + rows)
    return pa.table({
        "prompt_id": pa.array([f"prompt-{i // GROUP}" for i in ids]),
        "sample_idx": pa.array((ids % GROUP).astype(np.int32)),
        "iteration": pa.array(np.zeros(rows, np.int32)),
        "prompt": pa.array(["What is 2 + 2? Think step by step."] * rows),
        "response": pa.array(["..."] * rows),
        "prompt_ids": _lists(np.full(rows, 64), rng.integers(0, 50000, rows * 64).astype(np.int32)),
        "response_ids": _lists(lengths, rng.integers(0, 50000, n).astype(np.int32)),
        "finish_reason": pa.array(["stop"] * rows),
        "behavior_logprobs": _lists(lengths, old),
        "old_logprobs": _lists(lengths, old + rng.normal(0, 0.01, n).astype(np.float32)),
        "ref_logprobs": _lists(lengths, old + rng.normal(0, 0.1, n).astype(np.float32)),
        "values": _lists(lengths, rng.normal(0, 1, n).astype(np.float32)),
        "step_ends": _lists(n_steps, ends[keep]),
        "step_rewards": _lists(n_steps, rng.random(int(n_steps.sum())).astype(np.float32)),
        "outcome_reward": pa.array(rng.integers(0, 2, rows).astype(np.float32)),
    })


def make_rollouts(path: Path, sequences: int, max_len: int, seed: int = 0, chunk: int = 1024) -> None:
    rng = np.random.default_rng(seed)
    with schema.DatasetWriter(path, "rollouts") as w:
        for start in range(0, sequences, chunk):
            w.write(rollouts_chunk(rng, start, min(chunk, sequences - start), max_len))


def stage_config(inp: Path, out: Path, estimator: str = "gae") -> stage.Config:
    """KL penalty on where the estimator uses token rewards (GRPO-style ones take KL in the loss)."""
    kl_coef = 0.05 if estimators.ESTIMATORS[estimator].uses_token_rewards else 0.0
    return stage.Config(input=str(inp), output=str(out), estimator=estimator, kl_coef=kl_coef, gamma=1.0,
                        lam=0.95, overwrite=True, tracking=TrackingConfig(enabled=False))


def plain_copy(inp: Path, out: Path) -> None:
    """Stream every rollouts column in 1,024-row batches and write them plus 4 copied float columns:
    no computation. One row group per batch, as a streaming stage without buffering would."""
    out.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(sorted(inp.glob("part-*.parquet"))):
        pf = pq.ParquetFile(path)
        with pq.ParquetWriter(out / f"part-{i:05d}.parquet", schema.ADVANTAGES, compression="zstd") as w:
            for batch in pf.iter_batches(batch_size=1024):
                w.write_table(_with_copied_columns(pa.Table.from_batches([batch])))


def plain_whole(inp: Path, out: Path) -> None:
    """pq.read_table, then pq.write_table of the same columns plus 4 copies: the whole input in
    memory and one big row group, the cheapest write Parquet allows."""
    out.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(sorted(inp.glob("part-*.parquet"))):
        pq.write_table(_with_copied_columns(pq.read_table(path)), out / f"part-{i:05d}.parquet", compression="zstd")


def _with_copied_columns(t: pa.Table) -> pa.Table:
    for name in ("token_rewards", "advantages", "returns", "kl"):
        t = t.append_column(name, t["old_logprobs"])
    return t.cast(schema.ADVANTAGES)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_throughput(work: Path, args) -> None:
    """Best of `repeats` in wall time (and in process CPU time, which other load on the machine
    disturbs less), the plain copies and the stage interleaved so all see the same load."""
    inp = work / "rollouts"
    runs = {"plain, streamed": lambda: plain_copy(inp, work / "plain"),
            "plain, whole table": lambda: plain_whole(inp, work / "plain")}
    summaries = {}
    for est in args.estimators.split(","):
        runs[est] = lambda est=est: summaries.update({est: stage.run(stage_config(inp, work / "advantages", est))})
    wall = {name: math.inf for name in runs}
    cpu = dict(wall)
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), _cpu()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], _cpu() - c0)
            shutil.rmtree(work / "plain", ignore_errors=True)
            shutil.rmtree(work / "advantages", ignore_errors=True)
    for name in ("plain, streamed", "plain, whole table"):
        print(f"{name:<20} wall {wall[name]:.2f} s  cpu {cpu[name]:.2f} s")
    for est in summaries:
        ratios = "  ".join(f"vs {p}: {wall[p] / wall[est]:.2f} (cpu {cpu[p] / cpu[est]:.2f})"
                           for p in ("plain, streamed", "plain, whole table"))
        print(f"stage {est:<14} wall {wall[est]:.2f} s  cpu {cpu[est]:.2f} s  "
              f"{summaries[est]['perf/tokens_per_s'] / 1e6:.1f} M tokens/s; throughput ratio {ratios}  (target >= 0.7)")


def bench_gae(work: Path, args) -> None:
    import torch

    table = schema.read_dataset(work / "rollouts", "rollouts", columns=["response_ids", "values", "old_logprobs"])
    lengths = pc.list_value_length(table["response_ids"]).to_numpy()
    layout = estimators.Ragged.from_lengths(lengths)
    rng = np.random.default_rng(1)
    rewards = rng.normal(0, 0.1, layout.n_tokens)
    values = pc.list_flatten(table["values"]).to_numpy().astype(np.float64)
    gamma, lam = 1.0, 0.95
    B, T = len(lengths), int(lengths.max())
    pos, row = layout.pos, np.repeat(np.arange(B), lengths)

    def padded(x):
        out = torch.zeros(B, T, dtype=torch.float32)
        out[torch.from_numpy(row), torch.from_numpy(pos)] = torch.from_numpy(x.astype(np.float32))
        return out

    r_pad, v_pad = padded(rewards), padded(values)
    mask = padded(np.ones(layout.n_tokens))

    def loop():  # the common implementation (TRL / OpenRLHF style)
        v, r = v_pad * mask, r_pad * mask
        last = torch.zeros(B)
        out = []
        for t in reversed(range(T)):
            v_next = v[:, t + 1] if t < T - 1 else 0.0
            delta = r[:, t] + gamma * v_next - v[:, t]
            last = delta + gamma * lam * last
            out.append(last)
        adv = torch.stack(out[::-1], dim=1) * mask
        return adv, adv + v

    def vectorized():
        inp = estimators.EstimatorInput(layout, rewards, gamma, lam, 1e-6, values=values)
        return estimators.ESTIMATORS["gae"].fn(inp)

    def vectorized_with_layout():  # also pays for building the layout from the lengths
        inp = estimators.EstimatorInput(estimators.Ragged.from_lengths(lengths), rewards, gamma, lam, 1e-6,
                                        values=values)
        return estimators.ESTIMATORS["gae"].fn(inp)

    adv_loop = loop()[0].numpy()[row, pos]
    adv_vec = vectorized()[0]
    err = float(np.abs(adv_loop - adv_vec).max())
    t_loop = best_of(loop, args.repeats)
    t_vec = best_of(vectorized, args.repeats + 2)
    t_vec_layout = best_of(vectorized_with_layout, args.repeats + 2)
    print(f"GAE on {B} x {T} padded ({layout.n_tokens} tokens), torch threads={torch.get_num_threads()}: "
          f"per-token loop {t_loop * 1e3:.0f} ms, vectorized {t_vec * 1e3:.0f} ms "
          f"({t_vec_layout * 1e3:.0f} ms with layout): speed-up {t_loop / t_vec:.1f}x "
          f"({t_loop / t_vec_layout:.1f}x)   (target >= 5x); max |diff| {err:.1e}")


# Peak RSS from VmHWM, the high-water mark of this process image: getrusage's ru_maxrss survives
# fork + exec on Linux, so a child would report at least its parent's size at the fork.
CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from benchmarks.bench_advantage import stage_config
from prmflow.components.advantage import stage
from pathlib import Path
s = stage.run(stage_config(Path({inp!r}), Path({out!r})))
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"rss_mb": hwm / 1024, "tokens_per_s": s["perf/tokens_per_s"]}}))
"""


def peak_rss(work: Path, sequences: int, args) -> dict:
    inp = work / f"rollouts-{sequences}"
    if not inp.exists():  # generated in a child too, so the parent's memory stays out of the way
        subprocess.run([sys.executable, __file__, "--generate", str(inp), "--sequences", str(sequences),
                        "--max-len", str(args.max_len)], check=True)
    code = CHILD.format(root=str(ROOT), inp=str(inp), out=str(work / f"advantages-{sequences}"))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    shutil.rmtree(work / f"advantages-{sequences}", ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(work: Path, args) -> None:
    small = peak_rss(work, args.sequences, args)
    big = peak_rss(work, args.big, args)
    print(f"peak RSS: {args.sequences} sequences {small['rss_mb']:.0f} MiB, {args.big} sequences "
          f"{big['rss_mb']:.0f} MiB: ratio {big['rss_mb'] / small['rss_mb']:.2f}   (target <= 1.25); "
          f"{big['tokens_per_s'] / 1e6:.1f} M tokens/s on the larger input")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--big", type=int, default=65536, help="sequences of the larger memory run")
    p.add_argument("--estimators", default="gae,grpo_process", help="comma-separated, for the throughput run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--workdir", default="", help="keep inputs here (default: a temporary directory)")
    p.add_argument("--generate", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        make_rollouts(Path(args.generate), args.sequences, args.max_len)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_advantage-"))
    try:
        if not (work / "rollouts").exists():
            t0 = time.perf_counter()
            make_rollouts(work / "rollouts", args.sequences, args.max_len)
            print(f"generated {args.sequences} rollouts in {time.perf_counter() - t0:.1f} s")
        bench_throughput(work, args)
        bench_gae(work, args)
        if not args.skip_memory:
            bench_memory(work, args)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
