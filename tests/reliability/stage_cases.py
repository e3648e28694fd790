"""The stages under the kill-and-resume harness: argv, how a reader checks an output, how two compare.

Adding a stage (prm, rollout, ppo) is one more `StageCase` in CASES:

    CASES["ppo"] = StageCase(
        name="ppo",
        argv=lambda run, inputs: ["ppo", "--output", str(run / "out"), "--policy", str(inputs / "sft"),
                                  "--advantages", str(inputs / "advantages"), *TINY_PPO_FLAGS,
                                  "--engine.backend", "torch", "--tracking.enabled", "false"],
        prepare=make_ppo_inputs,          # writes inputs/sft, inputs/advantages once per session
        read=read_policy,                 # a policy directory: manifest + checksums + safetensors
        compare=same_files,               # bit-for-bit on CPU; or a tolerance-based compare
        signals=(signal.SIGKILL, signal.SIGTERM),       # SIGTERM once ppo wires common/preemption.py
        kill_events=(".out.work/.latest.tmp-*", ".out.tmp-*"),
        checkpoint=".out.work/latest/manifest.json",
    )

`same_files` demands equal sha256 for every file the manifests list (bit-for-bit). A stage that is
not deterministic on CPU (e.g. sampling with a thread-dependent reduction order) passes a compare
that loads both outputs and checks them within a stated tolerance instead.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pyarrow as pa

from kill_harness import StageCase
from prmflow.components.common import io, schema

# --- readers ----------------------------------------------------------------------------------------


def read_policy(out: Path) -> None:
    """What a downstream stage relies on in a policy directory: a manifest whose files all check out."""
    from safetensors.torch import load_file

    manifest = io.read_manifest(out)
    io.verify_files(out, manifest)
    assert manifest["kind"] == "policy", manifest["kind"]
    load_file(str(out / "model.safetensors"))


def read_handoff(kind: str):
    def read(out: Path) -> None:
        table = schema.open_dataset(out, kind).read()
        assert table.num_rows == io.read_manifest(out)["rows"]
    return read


# --- comparisons ------------------------------------------------------------------------------------

def same_files(ref: Path, out: Path) -> None:
    """Bit-for-bit: every file listed in the manifests has the same sha256 (and the same names)."""
    a, b = io.read_manifest(ref)["files"], io.read_manifest(out)["files"]
    if a == b:
        return
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    detail = ""
    if "model.safetensors" in differ:
        from safetensors.torch import load_file

        ta, tb = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
        worst = max(((n, float((ta[n] - tb[n]).abs().max())) for n in ta), key=lambda x: x[1])
        detail = f"; largest weight difference {worst[1]:.3g} in {worst[0]}"
    elif any(k.endswith(".parquet") for k in differ):
        kind = io.read_manifest(ref)["kind"]
        ta, tb = schema.read_dataset(ref, kind), schema.read_dataset(out, kind)
        cols = [c for c in ta.column_names if not ta.column(c).equals(tb.column(c))] if ta.num_rows == tb.num_rows else ["(row count)"]
        detail = f"; columns that differ: {cols}"
    raise AssertionError(f"{out} differs from the uninterrupted run {ref} in {differ}{detail}")


# --- inputs -----------------------------------------------------------------------------------------

def make_rollouts(inputs: Path, prompts: int = 2500, samples: int = 4, seed: int = 0) -> Path:
    """Scored rollouts with every column advantage may read: ~10k rows, ~0.7M tokens, 3 shards."""
    rng = np.random.default_rng(seed)
    rows = prompts * samples
    lengths = rng.integers(8, 130, rows)
    steps = [np.unique(np.append(rng.integers(0, n, rng.integers(1, 6)), n - 1)).astype(np.int32) for n in lengths]

    def floats(scale, shift=0.0):
        return [(rng.standard_normal(n) * scale + shift).astype(np.float32) for n in lengths]

    table = pa.table({
        "prompt_id": [f"p{i // samples:05d}" for i in range(rows)],
        "sample_idx": pa.array([i % samples for i in range(rows)], pa.int32()),
        "iteration": pa.array(np.zeros(rows, np.int32)),
        "response_ids": [rng.integers(3, 90, n).astype(np.int32) for n in lengths],
        "old_logprobs": floats(0.5, -1.0),
        "ref_logprobs": floats(0.5, -1.1),
        "values": floats(0.3),
        "step_ends": steps,
        "step_rewards": [rng.random(len(s)).astype(np.float32) for s in steps],
        "outcome_reward": pa.array(rng.integers(0, 2, rows).astype(np.float32)),
    })
    out = inputs / "rollouts"
    if not (out / io.MANIFEST).exists():
        schema.write_dataset(out, table, "rollouts", rows_per_shard=4000)
    return out


SFT_FLAGS = ["--train_size", "64", "--eval_size", "4", "--max_steps", "10", "--micro_batch_size", "4",
             "--warmup_steps", "2", "--eval_every", "5", "--save_every", "3", "--eval_max_new_tokens", "4",
             "--max_seq_len", "64", "--engine.backend", "torch", "--tracking.enabled", "false"]

ADVANTAGE_FLAGS = ["--estimator", "gae", "--kl_coef", "0.05", "--whiten", "true", "--batch_size", "256",
                   "--tracking.enabled", "false"]

CASES = {
    "sft": StageCase(
        name="sft",
        argv=lambda run, inputs: ["sft", "--output", str(run / "out"), *SFT_FLAGS],
        read=read_policy,
        compare=same_files,
        signals=(signal.SIGKILL, signal.SIGTERM),
        kill_events=(".out.work/.latest.tmp-*", ".out.work/latest", ".out.tmp-*", "out"),
        checkpoint=".out.work/latest/manifest.json",
        changed_argv=("--max_steps", "9"),
        max_kills=3,
        ci_seeds=1,
    ),
    "advantage": StageCase(
        name="advantage",
        argv=lambda run, inputs: ["advantage", "--input", str(inputs / "rollouts"), "--output", str(run / "out"),
                                  *ADVANTAGE_FLAGS],
        prepare=make_rollouts,
        read=read_handoff("advantages"),
        compare=same_files,
        signals=(signal.SIGKILL, signal.SIGTERM),  # no training loop: it dies on either and restarts from scratch
        kill_events=(".out.tmp-*", "out"),
        changed_argv=("--lam", "0.9"),
        max_kills=3,
        ci_seeds=2,
    ),
}
