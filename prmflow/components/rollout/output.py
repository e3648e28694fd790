"""What a rollout writes: the rollouts table, its metrics and logged samples, and the output's identity.

The manifest keeps the config and the input digests, so a re-run with the same config on the same
inputs finds its finished output and returns at once (`existing_output`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..training import checkpoint
from .. import config as config_lib
from ..data import io, steps as steps_lib
from ... import tasks
from ...errors import OutputExistsError
from . import outcome_rewards as rewards_lib
from .config import Config
from ..sampling.engines import Completion, logprob_temperature


def output_dir(cfg: Config) -> Path:
    """Where this invocation writes: `output`, one directory per shard (the pipeline gives every pod
    its own); shards placed under one parent read back as one dataset. On several ranks each writes
    `output/rank-<rank>`, and `output` reads as one dataset the same way."""
    rank, world = cfg.ranks()
    return Path(cfg.output) / f"rank-{rank}" if world > 1 else Path(cfg.output)


def identity(cfg: Config) -> dict:
    """The config as the manifest records it: what makes two rollouts the same result."""
    return checkpoint.identity(config_lib.to_dict(cfg))


def input_digests(cfg: Config) -> dict[str, str]:
    """{path: digest} of the models and the dataset the rollouts come from (`io.input_fingerprints`).
    The same config on a newer policy in the same place is a different result."""
    return io.input_fingerprints([cfg.policy, cfg.prm, cfg.ref, cfg.critic, cfg.task])


def existing_output(cfg: Config, out: Path, inputs: dict[str, str]) -> dict | None:
    """Metrics of a finished, intact output written by the same config from the same inputs (nothing
    to do), else None; any other existing output is an error unless overwrite. Each rank (each shard)
    has its own output directory."""
    try:
        done = io.finished_output("rollout", out, identity(cfg), cfg.overwrite, inputs=inputs, per_rank=True)
    except OutputExistsError as e:
        if cfg.num_shards > 1:
            raise OutputExistsError(f"{e} Each shard needs its own output directory (e.g. ITER/shard-3).") from None
        raise
    return None if done is None else done.get("metrics", {})


def _f32_lists(arrays: list | None, n: int) -> pa.Array:
    if arrays is None:
        return pa.nulls(n, pa.list_(pa.float32()))
    return pa.array([np.asarray(a, dtype=np.float32) for a in arrays], type=pa.list_(pa.float32()))


def rollouts_table(cfg: Config, records: list[tasks.PromptRecord], prompt_texts: list[str],
                   rows: list[tuple[int, int, Completion]], p_ids: list[list[int]], r_ids: list[list[int]],
                   responses: list[str], ends: list[list[int]], scored: rewards_lib.Scored,
                   columns: dict[str, list | None]) -> pa.Table:
    """One row per sampled response in the rollouts schema; rows are (prompt index, sample index,
    completion), the other lists are aligned with them, `columns` is what `passes.score` returned."""
    n = len(rows)
    step_rewards = columns["step_rewards"]
    if step_rewards is not None:
        for k, (e, s) in enumerate(zip(ends, step_rewards)):
            if len(e) != len(s):  # both come from steps.step_spans on the same text
                raise RuntimeError(f"row {k}: {len(e)} step ends but the PRM scored {len(s)} steps")
    i32 = pa.list_(pa.int32())
    return pa.table({
        "prompt_id": pa.array([records[i].prompt_id for i, _, _ in rows], pa.string()),
        "sample_idx": pa.array([j for _, j, _ in rows], pa.int32()),
        "iteration": pa.array([cfg.iteration] * n, pa.int32()),
        "prompt": pa.array([prompt_texts[i] for i, _, _ in rows], pa.string()),
        "response": pa.array(responses, pa.string()),
        "prompt_ids": pa.array(p_ids, i32),
        "response_ids": pa.array(r_ids, i32),
        "images": pa.array([records[i].images for i, _, _ in rows], pa.list_(pa.binary())),
        "finish_reason": pa.array([c.finish_reason for _, _, c in rows], pa.string()),
        "behavior_logprobs": _f32_lists([c.logprobs for _, _, c in rows], n),
        "old_logprobs": _f32_lists(columns["old_logprobs"], n),
        "ref_logprobs": _f32_lists(columns["ref_logprobs"], n),
        "values": _f32_lists(columns["values"], n),
        "step_ends": pa.array(ends, i32),
        "step_rewards": _f32_lists(step_rewards, n),
        "outcome_reward": pa.array(scored.outcome, pa.float32()),
        "reward_components": pa.array([list(c.items()) for c in scored.components], pa.map_(pa.string(), pa.float32())),
        "answer": pa.array([records[i].answer for i, _, _ in rows], pa.string()),
        "logprob_temperature": pa.array([logprob_temperature(cfg.sampling.temperature)] * n, pa.float64()),
    })


def rollout_metrics(cfg: Config, records: list[tasks.PromptRecord], rows: list[tuple[int, int, Completion]],
                    responses: list[str], scored: rewards_lib.Scored, columns: dict[str, list | None],
                    truncated: int) -> dict:
    """The `rollout/` metrics of this shard: rewards, accuracy, lengths, step rewards, logprob gaps, KL."""
    reward = np.asarray(scored.outcome, dtype=np.float64)
    lengths = np.asarray([len(c.token_ids) for _, _, c in rows], dtype=np.float64)
    m = {"rollout/reward_mean": float(reward.mean()), "rollout/reward_std": float(reward.std()),
         "rollout/response_length": float(lengths.mean()), "rollout/prompts": len(records), "rollout/samples": len(rows),
         "rollout/finish_length_frac": float(np.mean([c.finish_reason == "length" for _, _, c in rows])),
         "rollout/truncated_prompts": truncated}
    correct = []
    for k, (i, _, _) in enumerate(rows):
        if scored.correct[k] is not None:
            correct.append(scored.correct[k])
        elif records[i].answer is not None:
            correct.append(tasks.verify(records[i], responses[k]))
    if correct:
        m["rollout/accuracy"] = float(np.mean(correct))
    names = sorted({name for c in scored.components for name in c})
    for name in names:
        m[f"rollout/reward/{name}"] = float(np.mean([c[name] for c in scored.components if name in c]))
    if columns["step_rewards"] is not None:
        flat = [s for row in columns["step_rewards"] for s in row]
        m["rollout/step_reward_mean"] = float(np.mean(flat)) if flat else math.nan
        m["rollout/steps_per_response"] = len(flat) / len(rows)
    old = np.concatenate(columns["old_logprobs"])
    behavior = np.concatenate([np.asarray(c.logprobs, np.float32) for _, _, c in rows])
    m["rollout/logprob_gap"] = float(np.abs(old - behavior).mean())  # sampler vs trainer numerics
    m["rollout/neg_logprob_mean"] = float(-old.mean())  # a sampled estimate of the policy entropy
    if columns["ref_logprobs"] is not None:
        m["rollout/kl_k1"] = float((old - np.concatenate(columns["ref_logprobs"])).mean())
    if columns["values"] is not None:
        m["rollout/value_mean"] = float(np.concatenate(columns["values"]).mean())
    return m


def sample_table(cfg: Config, table: pa.Table) -> dict[str, list]:
    """An evenly spaced sample of responses with the PRM score printed before each step."""
    n = table.num_rows
    take = np.unique(np.linspace(0, n - 1, num=min(cfg.log_samples, n)).astype(int)) if cfg.log_samples else []
    rows = table.take(pa.array(take, pa.int64())).to_pylist() if len(take) else []
    def annotated(r):
        parts = steps_lib.steps(r["response"], cfg.step_separator)
        scores = r["step_rewards"] or [None] * len(parts)
        return "\n".join(f"[{s:.3f}] {p}" if s is not None else p for p, s in zip(parts, scores))

    return {
        "prompt_id": [r["prompt_id"] for r in rows], "sample_idx": [r["sample_idx"] for r in rows],
        "prompt": [r["prompt"] for r in rows], "response": [r["response"] for r in rows],
        "steps_with_prm_scores": [annotated(r) for r in rows],
        "step_rewards": [r["step_rewards"] for r in rows], "outcome_reward": [r["outcome_reward"] for r in rows],
        "reward_components": [dict(r["reward_components"] or []) for r in rows],
        "finish_reason": [r["finish_reason"] for r in rows], "answer": [r["answer"] for r in rows],
    }
