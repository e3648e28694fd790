"""The smallest whole pipeline the run-local, MLflow UI and stage-command tests run (each adjusts a few budgets)."""

from __future__ import annotations

import copy

#: 2 RL iterations of 2 rollout shards; every stage on the tiny model with budgets of seconds.
BASE = {
    "pipeline": {"iterations": 2, "rollout_shards": 2, "experiment": "prmflow-test"},
    "sft": {"policy": "tiny-llama", "max_steps": 12, "micro_batch_size": 8, "optim": {"warmup_steps": 1}, "eval_size": 4,
            "eval_every": 0, "save_every": 0, "engine": {"backend": "torch"}},
    "prm": {"max_steps": 4, "num_prompts": 16, "eval_size": 4, "micro_batch_size": 8, "optim": {"warmup_steps": 1},
            "eval_every": 0, "save_every": 0, "engine": {"backend": "torch"}},
    "rollout": {"num_prompts": 4, "n_samples": 2, "sampling": {"max_new_tokens": 16}},
    "advantage": {"estimator": "grpo_process"},
    "ppo": {"epochs": 1, "minibatch_size": 8, "micro_batch_size": 8, "engine": {"backend": "torch"}},
    "evaluate": {"num_prompts": 4, "n_samples": 2, "sampling": {"max_new_tokens": 16}},
}


def tiny_pipeline(**sections: dict) -> dict:
    """BASE with each given section's keys replaced (one level deep: `sft={"max_steps": 4}` keeps sft's other keys)."""
    out = copy.deepcopy(BASE)
    for name, keys in sections.items():
        out[name] = {**out.get(name, {}), **keys}
    return out
