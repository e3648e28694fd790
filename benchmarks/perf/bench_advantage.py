"""Advantage stage benchmark: prints ratios (not part of the test suite).

    python benchmarks/perf/bench_advantage.py [--sequences 4096] [--max-len 1024] [--big 65536] [--skip-memory]

1. Throughput: the stage (Parquet in -> Parquet out) against a pass-through that does the stage's
   I/O with the computation removed: the same reader (schema.open_dataset with its checksum check,
   validated `iter_batches` of cfg.batch_size rows, read one batch ahead on a thread:
   parquet_io.read_ahead) and the same writer (schema.DatasetWriter: its dictionary columns, zstd,
   one row group per batch, atomic commit with the manifest's sha256, fed by parquet_io.write_behind
   on a thread). The four new columns are the stage's own output for that estimator, computed by
   one stage run beforehand and held in memory, so both encode and compress the same values and
   write the same bytes. The stage's extra work is its computing and its group pass (a second read
   of four small columns). Ratio = baseline time / stage time (target >= 0.9), in wall time and in
   process CPU time; the median of --repeats interleaved runs each. Bytes read and written are the
   process's rchar / wchar (/proc/self/io: every read and write call, page cache or not, sha256
   passes included) and the size of the committed output.
2. GAE: the vectorized estimator against the common per-token loop
   (`for t in reversed(range(T))` over padded (B, T) torch tensors), same data, same process, the
   same number of timed runs each (median). The vectorized side is timed with its layout: the
   response lengths read from the Arrow column and the ragged layout built from them inside the
   timed region; the loop gets its padded tensors prebuilt (its own layout, as a trainer holding
   padded batches would; the time to pad from the flat data is printed beside it). Both sides run
   on one thread (torch's, and numpy's BLAS through threadpoolctl). Target >= 20x.
3. Memory: peak RSS of the stage in a fresh subprocess on --sequences and on --big sequences;
   target: the larger run stays within 25% of the smaller.

Responses are ragged, lengths uniform in 1..max-len, 8 samples per prompt, 4 scored steps each.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prmflow.components.advantage import estimators, stage  # noqa: E402
from prmflow.components import config as config_lib  # noqa: E402
from prmflow.components.data import io, parquet_io, schema  # noqa: E402
from prmflow.tracking import TrackingConfig  # noqa: E402

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


NEW_COLUMNS = ("token_rewards", "advantages", "returns", "kl")


def stage_output_columns(out: Path) -> pa.Table:
    """The four columns the stage wrote, in memory: what the pass-through appends instead of computing."""
    return schema.read_dataset(out, "advantages", columns=list(NEW_COLUMNS)).combine_chunks()


def passthrough(cfg: stage.Config, new_columns: pa.Table) -> int:
    """The stage's write pass with the computation removed (see the module docstring). Returns rows."""
    ds = schema.open_dataset(cfg.input, "rollouts")
    writer = schema.DatasetWriter(cfg.output, "advantages", config=config_lib.to_dict(cfg),
                                  parents=[str(d) for d in ds.dirs], overwrite=cfg.overwrite,
                                  extra={"inputs": io.fingerprint(ds.dirs)})
    start = 0
    with writer, parquet_io.write_behind(functools.partial(writer.write, validated=True)) as write, \
            contextlib.closing(parquet_io.read_ahead(ds.iter_batches(_batch_rows(cfg), None))) as batches:
        for t in batches:
            new = new_columns.slice(start, t.num_rows)
            start += t.num_rows
            for name in NEW_COLUMNS:
                t = t.append_column(name, new[name])
            write(t)
    if start != new_columns.num_rows:
        raise RuntimeError(f"the stage wrote {new_columns.num_rows} rows, the input has {start}: rows were dropped, "
                           "so the pass-through cannot line the stage's columns up with the input")
    return start


def _batch_rows(cfg: stage.Config) -> int:
    """Rows per batch: `batch_rows` (named `batch_size` before the config-key renames)."""
    return getattr(cfg, "batch_rows", None) or cfg.batch_size


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _io() -> tuple[int, int]:
    """(rchar, wchar) of this process so far: bytes passed to read and write calls, all threads."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_throughput(work: Path, args) -> None:
    """Stage and pass-through runs interleaved, `repeats` each, so both see the same load."""
    inp = work / "rollouts"
    in_rows = schema.open_dataset(inp, "rollouts").num_rows
    print(f"input: {in_rows} rows, {_dir_bytes(inp) / 1e6:.1f} MB on disk")
    for est in args.estimators.split(","):
        cfg = stage_config(inp, work / "advantages", est)
        summary = stage.run(cfg)  # warm-up, and the columns the pass-through will write
        new_columns = stage_output_columns(work / "advantages")
        runs = {"stage": lambda: stage.run(cfg), "pass-through": lambda: passthrough(cfg, new_columns)}
        stats = {name: {"wall": [], "cpu": [], "read": [], "written": [], "out": []} for name in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                shutil.rmtree(work / "advantages", ignore_errors=True)
                (r0, w0), t0, c0 = _io(), time.perf_counter(), _cpu()
                fn()
                wall, cpu, (r1, w1) = time.perf_counter() - t0, _cpu() - c0, _io()
                st = stats[name]
                st["wall"].append(wall), st["cpu"].append(cpu), st["read"].append(r1 - r0)
                st["written"].append(w1 - w0), st["out"].append(_dir_bytes(work / "advantages"))
        shutil.rmtree(work / "advantages", ignore_errors=True)
        med = {name: {k: statistics.median(v) for k, v in st.items()} for name, st in stats.items()}
        print(f"estimator {est}: {summary['advantage/rows_out']} rows, {summary['advantage/tokens_out']} tokens, "
              f"median of {args.repeats} runs each")
        for name, m in med.items():
            print(f"  {name:<13} wall {m['wall']:.2f} s  cpu {m['cpu']:.2f} s  read {m['read'] / 1e6:.1f} MB  "
                  f"written {m['written'] / 1e6:.1f} MB  (output {m['out'] / 1e6:.1f} MB)  "
                  f"walls {' '.join(f'{x:.2f}' for x in stats[name]['wall'])}")
        s_, b_ = med["stage"], med["pass-through"]
        print(f"  stage / pass-through throughput: wall {b_['wall'] / s_['wall']:.2f}, "
              f"cpu {b_['cpu'] / s_['cpu']:.2f}   (target >= 0.9)")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_gae(work: Path, args) -> None:
    import torch

    table = schema.read_dataset(work / "rollouts", "rollouts", columns=["response_ids", "values", "old_logprobs"])
    lengths = pc.list_value_length(table["response_ids"]).to_numpy()
    n_tokens = int(lengths.sum())
    rng = np.random.default_rng(1)
    rewards = rng.normal(0, 0.1, n_tokens)
    values = pc.list_flatten(table["values"]).to_numpy().astype(np.float64)
    gamma, lam = 1.0, 0.95
    B, T = len(lengths), int(lengths.max())

    def pad():  # the loop's layout: flat token arrays -> padded (B, T) tensors and a mask
        layout = estimators.Ragged.from_lengths(lengths)
        row, pos = torch.from_numpy(np.repeat(np.arange(B), lengths)), torch.from_numpy(layout.pos)

        def padded(x):
            out = torch.zeros(B, T, dtype=torch.float32)
            out[row, pos] = torch.from_numpy(x.astype(np.float32))
            return out

        return padded(rewards), padded(values), padded(np.ones(n_tokens))

    r_pad, v_pad, mask = pad()

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

    def vectorized():  # with its layout: lengths from the Arrow column, the ragged layout, then GAE
        layout = estimators.Ragged.from_lengths(pc.list_value_length(table["response_ids"]).to_numpy())
        return estimators.gae(rewards, values, layout, gamma, lam)

    layout = estimators.Ragged.from_lengths(lengths)
    adv_loop = loop()[0].numpy()[np.repeat(np.arange(B), lengths), layout.pos]
    adv_vec = vectorized()[0]
    err = float(np.abs(adv_loop - adv_vec).max())
    n = args.repeats
    # one thread on both sides: torch's for the loop, numpy's BLAS (the blocked scan's matrix product)
    # for the vectorized side (threadpoolctl comes with scikit-learn, an MLflow dependency)
    from threadpoolctl import threadpool_info, threadpool_limits

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        blas = ",".join(f"{i['internal_api']}={i['num_threads']}" for i in threadpool_info())
        t_loop, t_vec, t_pad = median_time(loop, n), median_time(vectorized, n), median_time(pad, n)
    torch.set_num_threads(torch_threads)
    print(f"GAE on {B} x {T} padded ({n_tokens} tokens), torch threads=1, {blas}, median of {n} "
          f"runs each: per-token loop {t_loop * 1e3:.0f} ms (+{t_pad * 1e3:.0f} ms to pad the flat data), "
          f"vectorized with its layout {t_vec * 1e3:.0f} ms: speed-up {t_loop / t_vec:.1f}x "
          f"({(t_loop + t_pad) / t_vec:.1f}x counting the padding)   (target >= 20x); max |diff| {err:.1e}")


# Peak RSS from VmHWM, the high-water mark of this process image: getrusage's ru_maxrss survives
# fork + exec on Linux, so a child would report at least its parent's size at the fork.
CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from benchmarks.perf.bench_advantage import stage_config
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
