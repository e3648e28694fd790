"""The stages under the kill-and-resume harness: argv, how a reader checks an output, how two compare.

Every stage of the issue is here: sft, prm, rollout, advantage, ppo. Each is bit-for-bit on CPU with
one thread (the harness runs stages with OMP_NUM_THREADS=1). Adding a stage is one more `StageCase`
in CASES, e.g.:

    CASES["ppo"] = StageCase(
        name="ppo",
        argv=lambda run, inputs: ["ppo", "--output", str(run / "out"), "--policy", str(inputs / "sft"),
                                  "--input", str(inputs / "advantages"), *TINY_PPO_FLAGS,
                                  "--engine.backend", "torch", "--tracking.enabled", "false"],
        prepare=make_ppo_inputs,          # writes inputs/sft, inputs/advantages once per session
        read=read_policy,                 # a policy directory: manifest + checksums + safetensors
        compare=same_files,               # bit-for-bit on CPU; or a tolerance-based compare
        signals=(signal.SIGKILL, signal.SIGTERM),       # SIGTERM once ppo wires runtime/preemption.py
        kill_events=(".out.work/.latest.tmp-*", ".out.tmp-*"),
        checkpoint=".out.work/latest/manifest.json",
    )

`same_files` demands equal sha256 for every file the manifests list (bit-for-bit). A stage that is
not deterministic on CPU (e.g. sampling with a thread-dependent reduction order) passes a compare
that loads both outputs and checks them within a stated tolerance instead.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa

from kill_harness import StageCase
from prmflow.components.data import io, schema

# --- readers ----------------------------------------------------------------------------------------


def read_model(kind: str):
    """What a downstream stage relies on in a model output (policy, prm, ppo): a manifest of that kind
    whose files all check out, and every safetensors file it lists loadable."""
    def read(out: Path) -> None:
        from safetensors.torch import load_file

        manifest = io.read_manifest(out)
        io.verify_files(out, manifest)
        assert manifest["kind"] == kind, manifest["kind"]
        weights = [name for name in manifest["files"] if name.endswith(".safetensors")]
        assert weights, f"{out}: no weights listed"
        for name in weights:
            load_file(str(out / name))
    return read


read_policy = read_model("policy")


def read_handoff(kind: str):
    def read(out: Path) -> None:
        table = schema.open_dataset(out, kind).read()
        assert table.num_rows == io.read_manifest(out)["rows"]
    return read


# --- comparisons ------------------------------------------------------------------------------------

def same_files(ref: Path, out: Path, timing_in_json: bool = False) -> None:
    """Bit-for-bit: every file listed in the manifests has the same sha256 (and the same names).

    timing_in_json: a JSON file may differ in wall-clock figures only (keys starting with 'perf/', e.g.
    the tokens/s that ppo writes into each model's prmflow.json); every other byte must be equal."""
    a, b = io.read_manifest(ref)["files"], io.read_manifest(out)["files"]
    if a == b:
        return
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if timing_in_json:
        differ = [k for k in differ if not (k in a and k in b and k.endswith(".json")
                                            and _without_timing(ref / k) == _without_timing(out / k))]
        if not differ:
            return
    detail = ""
    weights = [k for k in differ if k.endswith(".safetensors") and k in a and k in b]
    if weights:
        from safetensors.torch import load_file

        ta, tb = load_file(str(ref / weights[0])), load_file(str(out / weights[0]))
        worst = max(((n, float((ta[n].float() - tb[n].float()).abs().max())) for n in ta), key=lambda x: x[1])
        detail = f"; largest weight difference {worst[1]:.3g} in {weights[0]}:{worst[0]}"
    elif any(k.endswith(".parquet") for k in differ):
        kind = io.read_manifest(ref)["kind"]
        ta, tb = schema.read_dataset(ref, kind), schema.read_dataset(out, kind)
        if ta.num_rows == tb.num_rows:
            cols = [c for c in ta.column_names if not ta.column(c).equals(tb.column(c))]
        else:
            cols = ["(row count)"]
        detail = f"; columns that differ: {cols}"
    raise AssertionError(f"{out} differs from the uninterrupted run {ref} in {differ}{detail}")


def _without_timing(path: Path):
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not str(k).startswith("perf/")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads(path.read_text()))


def same_but_timing(ref: Path, out: Path) -> None:
    same_files(ref, out, timing_in_json=True)


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


def make_policy(inputs: Path) -> Path:
    """A tiny random-init policy as a committed prmflow output (so stages fingerprint it)."""
    from prmflow import cli

    out = inputs / "policy"
    if not (out / io.MANIFEST).exists():
        assert cli.main(["make-tiny-model", str(out)]) == 0
    return out


ROLLOUT_FLAGS = ["--num_prompts", "16", "--n_samples", "4", "--sampling.max_new_tokens", "48", "--batch_sequences", "32",
                 "--tracking.enabled", "false"]


def rollout_argv(inputs: Path, out: Path) -> list[str]:
    policy = str(inputs / "policy")
    return ["rollout", "--output", str(out), "--policy", policy, "--ref", policy, "--critic", policy, *ROLLOUT_FLAGS]


def make_ppo_inputs(inputs: Path) -> None:
    """policy -> rollouts (with ref logprobs and values) -> GAE advantages with a KL penalty, in-process."""
    from prmflow import cli

    make_policy(inputs)
    rollouts, advantages = inputs / "ppo-rollouts", inputs / "ppo-advantages"
    if not (rollouts / io.MANIFEST).exists():
        assert cli.main(rollout_argv(inputs, rollouts)) == 0
    if not (advantages / io.MANIFEST).exists():
        assert cli.main(["advantage", "--input", str(rollouts), "--output", str(advantages), "--estimator", "gae",
                         "--step_rewards", "false", "--kl_coef", "0.05", "--tracking.enabled", "false"]) == 0


SFT_FLAGS = ["--num_prompts", "64", "--eval_size", "4", "--max_steps", "10", "--micro_batch_size", "4",
             "--optim.warmup_steps", "2", "--eval_every", "5", "--save_every", "3", "--eval_max_new_tokens", "4",
             "--max_seq_len", "64", "--engine.backend", "torch", "--tracking.enabled", "false"]

PRM_FLAGS = ["--backbone", "tiny-llama", "--num_prompts", "32", "--eval_size", "8", "--max_steps", "10",
             "--micro_batch_size", "8", "--optim.warmup_steps", "2", "--eval_every", "5", "--save_every", "3", "--log_every", "1",
             "--max_seq_len", "128", "--engine.backend", "torch", "--tracking.enabled", "false"]

PPO_FLAGS = ["--epochs", "2", "--minibatch_size", "8", "--micro_batch_size", "4", "--train_critic", "true", "--ema_decay", "0.5",
             "--save_every", "3", "--max_seq_len", "128", "--engine.backend", "torch", "--tracking.enabled", "false"]

ADVANTAGE_FLAGS = ["--estimator", "gae", "--kl_coef", "0.05", "--whiten", "true", "--batch_rows", "256",
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
    # default backbone layout (2 identity layers appended, only the top 2 trained) on a seeded tiny-llama;
    # 10 steps, a checkpoint every 3, evals at 5 and 10: bit-for-bit on CPU
    "prm": StageCase(
        name="prm",
        argv=lambda run, inputs: ["prm", "--output", str(run / "out"), *PRM_FLAGS],
        read=read_model("prm"),
        compare=same_files,
        signals=(signal.SIGKILL, signal.SIGTERM),
        kill_events=(".out.work/.latest.tmp-*", ".out.work/latest", ".out.tmp-*", "out"),
        checkpoint=".out.work/latest/manifest.json",
        changed_argv=("--max_steps", "9"),
        max_kills=3,
        ci_seeds=1,
    ),
    # sampling (seeded generator), ref logprobs and values; no training loop, so no resume state: a kill
    # (SIGKILL, or SIGTERM's default death) restarts it from scratch. Bit-for-bit on CPU.
    "rollout": StageCase(
        name="rollout",
        argv=lambda run, inputs: rollout_argv(inputs, run / "out"),
        prepare=make_policy,
        read=read_handoff("rollouts"),
        compare=same_files,
        signals=(signal.SIGKILL, signal.SIGTERM),
        kill_events=(".out.tmp-*", "out"),
        changed_argv=("--seed", "1"),
        max_kills=3,
        ci_seeds=1,
    ),
    # actor + critic + EMA, 16 updates, a checkpoint every 3: bit-for-bit on CPU (every weight file,
    # updates.jsonl and kl_state.json hash equal); only the wall-clock perf/tokens_per_s that ppo copies
    # into each model's prmflow.json may differ
    "ppo": StageCase(
        name="ppo",
        argv=lambda run, inputs: ["ppo", "--output", str(run / "out"), "--policy", str(inputs / "policy"),
                                  "--input", str(inputs / "ppo-advantages"), *PPO_FLAGS],
        prepare=make_ppo_inputs,
        read=read_model("ppo"),
        compare=same_but_timing,
        signals=(signal.SIGKILL, signal.SIGTERM),
        kill_events=(".out.work/.latest.tmp-*", ".out.work/latest", ".out.tmp-*", "out"),
        checkpoint=".out.work/latest/manifest.json",
        changed_argv=("--optim.lr", "5e-5"),
        max_kills=3,
        ci_seeds=1,
    ),
}


def read_manifest_files(out: Path) -> None:
    """Any committed output: its manifest, and every file it lists with its sha256."""
    io.verify_files(out, io.read_manifest(out))


#: Stages with no training loop to kill or resume (their tests: tests/prm, tests/evaluate), here for the
#: re-run test only (test_kill_resume.py), so that it covers every stage.
RERUN_ONLY = {
    "prm-label": StageCase(
        name="prm-label",
        argv=lambda run, inputs: ["prm-label", "--output", str(run / "out"), "--policy", str(inputs / "policy"),
                                  "--num_prompts", "4", "--n_samples", "2", "--completions", "2",
                                  "--sampling.max_new_tokens", "24", "--tracking.enabled", "false"],
        prepare=make_policy,
        read=read_manifest_files,
        compare=same_files,
        changed_argv=("--seed", "1"),
    ),
    "evaluate": StageCase(
        name="evaluate",
        argv=lambda run, inputs: ["evaluate", "--output", str(run / "out"), "--policy", str(inputs / "policy"),
                                  "--num_prompts", "8", "--n_samples", "2", "--sampling.max_new_tokens", "24",
                                  "--tracking.enabled", "false"],
        prepare=make_policy,
        read=read_manifest_files,
        compare=same_files,
        changed_argv=("--seed", "1"),
    ),
}

#: Every stage: the re-run test's cases.
ALL_CASES = {**CASES, **RERUN_ONLY}
