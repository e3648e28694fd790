"""Rollout split over ranks (one engine per GPU): every rank writes its own directory, and together
they read as one dataset holding the rows one process writes with the same seed."""

from __future__ import annotations

import sys

import pytest

from prmflow.components import config
from prmflow.components.data import schema
from prmflow.errors import ConfigError
from prmflow.components.sampling import vllm_engine
from prmflow.components.rollout import stage
from prmflow.components.sampling.vllm_engine import VLLMSettings

# 12 prompts x 2 samples in batches of 4 sequences: 6 generation batches, 3 per rank
SMALL = {"num_prompts": 12, "n_samples": 2, "batch_sequences": 4, "sampling.max_new_tokens": 24,
         "tracking.enabled": False}
KEY = ("prompt_id", "sample_idx")
#: columns produced by the models: equal up to float noise of a differently padded scoring batch
FLOATS = ("behavior_logprobs", "old_logprobs", "ref_logprobs")


def run(policy, output, **over):
    return stage.run(config.load(stage.Config, overrides={**SMALL, "policy": str(policy), "ref": str(policy),
                                                          "prm": "oracle", "output": str(output), **over}))


def by_key(rows):
    return {tuple(r[k] for k in KEY): r for r in rows}


def test_two_ranks_write_two_shards_that_read_as_the_one_rank_rows(tmp_path, sft_policy, monkeypatch):
    run(sft_policy, tmp_path / "one")
    for rank in (0, 1):  # as torchrun starts them: the same command, its own $RANK
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        run(sft_policy, tmp_path / "two")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["rank-0", "rank-1"]
    one = by_key(schema.read_dataset(tmp_path / "one", "rollouts").to_pylist())
    two_rows = schema.read_dataset(tmp_path / "two", "rollouts").to_pylist()
    parts = [by_key(schema.read_dataset(tmp_path / "two" / f"rank-{r}", "rollouts").to_pylist()) for r in (0, 1)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])  # each rank its own prompts
    two = by_key(two_rows)
    assert len(two_rows) == len(two) == len(one) == 24 and set(two) == set(one)
    for key, row in one.items():
        other = two[key]
        for col, value in row.items():
            if col in FLOATS:
                assert other[col] == pytest.approx(value, abs=1e-5), (key, col)
            else:
                assert other[col] == value, (key, col)


def test_rank_keys_are_checked_and_taken_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = config.load(stage.Config, overrides={"output": str(tmp_path / "r")})
    assert cfg.ranks() == (3, 4) and stage.output_dir(cfg) == tmp_path / "r" / "rank-3"
    with pytest.raises(ConfigError, match="rank is 2 with world_size=2"):
        config.load(stage.Config, overrides={"rank": 2, "world_size": 2})
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert stage.output_dir(config.load(stage.Config, overrides={"output": str(tmp_path / "r")})) == tmp_path / "r"


def test_vllm_engine_gets_tensor_parallel_size_and_samples_only_its_ranks_prompts(monkeypatch):
    """vLLM cannot run here: a stand-in `vllm` module records what the adapter passes it."""
    import types

    calls = {}

    class LLM:
        def __init__(self, **kwargs):
            calls["init"] = kwargs

        def generate(self, requests, sampling, use_tqdm=False):
            calls["requests"], calls["seeds"] = requests, [s.seed for s in sampling]
            out = types.SimpleNamespace
            return [out(outputs=[out(index=0, token_ids=[7], logprobs=[{7: out(logprob=-0.5)}], finish_reason="stop")])
                    for _ in requests]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, __version__="0.33.0"))
    from prmflow.components.sampling.engines import SamplingParams as Params
    from prmflow.components.sampling.vllm_engine import VLLMEngine

    engine = VLLMEngine("/models/qwen-7b", "bfloat16", seed=5, settings=VLLMSettings(tensor_parallel_size=2))
    assert calls["init"]["tensor_parallel_size"] == 2 and calls["init"]["model"] == "/models/qwen-7b"
    done = engine.generate([[1], [2], [3], [4], [5]], Params(n=1, seed=5), rank=1, world=2)
    assert [r["prompt_token_ids"] for r in calls["requests"]] == [[2], [4]]
    seeds = vllm_engine.request_seeds(5, 5, 1)
    assert calls["seeds"] == [seeds[1], seeds[3]]  # the seeds one process gives these prompts
    assert [len(c) for c in done] == [0, 1, 0, 1, 0]

