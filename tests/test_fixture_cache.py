"""The cached SFT fixtures cannot lie: a damaged cache entry is rebuilt, not trusted."""

from __future__ import annotations

import hashlib

from sft_cache import cached_sft

TINY = {"max_steps": 2, "optim.warmup_steps": 1, "eval_every": 2, "save_every": 0, "num_prompts": 64, "eval_size": 4,
        "engine.backend": "torch", "tracking.enabled": False}


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PRMFLOW_TEST_CACHE", str(tmp_path))
    first = cached_sft("probe", TINY)
    good = digest(first)
    weights = first / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16] + bytes(16))  # same size, wrong bytes
    again = cached_sft("probe", TINY)
    assert again == first and digest(again) == good  # retrained (deterministic), not the damaged file
