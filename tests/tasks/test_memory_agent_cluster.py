"""configs/cluster/agent-memory-qwen2.5.yaml: the memory agent in Qwen2.5's tool-call format compiles with the real
KFP compiler and plans, every stage on the task, rollout and evaluate playing episodes in its environment."""

from __future__ import annotations

from pathlib import Path

import yaml

from prmflow import cli
from prmflow.components import config
from prmflow.components.evaluate import stage as evaluate
from prmflow.components.rollout import config as rollout
from prmflow.pipelines.settings import safe_loader
from prmflow.tasks import memory_agent as ma

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs/cluster/agent-memory-qwen2.5.yaml"
IMAGES = ["--set=images.cpu=registry.example.com/prmflow-cpu@sha256:" + "a" * 64,
          "--set=images.gpu=registry.example.com/prmflow-gpu@sha256:" + "b" * 64]


def test_the_qwen_recipe_compiles_and_plans_with_every_stage_on_the_qwen_task(tmp_path, capsys):
    out = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(RECIPE), "-o", str(out), *IMAGES]) == 0
    spec = next(yaml.load_all(out.read_text(), Loader=safe_loader()))
    params = {k: v["defaultValue"] for k, v in spec["root"]["inputDefinitions"]["parameters"].items()
              if "defaultValue" in v}
    recipe = yaml.safe_load(RECIPE.read_text())
    assert {params[f"{s}_config"]["task"] for s in ("sft", "prm", "rollout", "evaluate")} == {"memory_agent_qwen"}
    assert params["sft_config"]["policy"] == params["rollout_config"]["policy"] == "/workspace/models/Qwen2.5-1.5B-Instruct"
    # rollout and evaluate play episodes in the same environment, with the same limits and weights
    roll = config.load(rollout.Config, overrides=config.flatten(params["rollout_config"]))
    ev = config.load(evaluate.Config, overrides=config.flatten(params["evaluate_config"]))
    assert roll.sampler == "vllm" and ev.sampler == "hf"
    assert config.to_dict(roll.environment) == config.to_dict(ev.environment)
    assert roll.environment.factory == "prmflow.tasks.memory_agent:MemoryEnvironment"
    assert set(roll.environment.step_reward_weights) == {"tool_success", "content_quality"}
    assert set(roll.environment.outcome_weights) == {"qa_accuracy", "compression"}
    # a turn fits: the longest expert turn of the task in Qwen's format is far below max_new_tokens (in characters)
    turns = [m["content"] for r in ma.records(50, task="memory_agent_qwen") for m in ma.demonstration_of(r)
             if m["role"] == "assistant"]
    assert max(len(t) for t in turns) < roll.sampling.max_new_tokens
    executors = spec["deploymentSpec"]["executors"]
    assert sum(e.startswith("exec-rollout") for e in executors) == recipe["pipeline"]["iterations"]
    assert cli.main(["pipeline", "plan", "--config", str(RECIPE)]) == 0
    shown = capsys.readouterr().out
    assert "8 RL iterations x 4 rollout shards" in shown
