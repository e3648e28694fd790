"""A long run as a chain of runs (pipelines/chain.py) under run-local: 4 iterations run as 2 runs of 2.

The chain is stopped between its two runs (`--runs 1`, what a kill between them leaves), then the same
command runs again: it continues from the workspace (the first run's tasks hit the cache), ends with
the final policy of one uninterrupted 4-iteration run bit for bit, and leaves ONE MLflow parent run
whose iteration metrics run 0..3 (those of the uninterrupted run) and whose closing table keeps the
SFT row although SFT was a cache hit of the first command. The config turns on every piece of state a
run hands to the next: the critic (GAE), Adam's moments, the KL controller (kl_coef > 0) and an LR
schedule over the whole RL run (rl_iterations = 4), so a run that numbered its iterations from 0 again,
or dropped a piece, would end elsewhere.
"""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny_pipeline import tiny_pipeline

CONFIG = tiny_pipeline(
    pipeline={"iterations": 4, "rollout_shards": 1, "experiment": "chain", "cluster": {"cache_sampling": True}},
    sft={"max_steps": 4}, prm={"max_steps": 2, "num_prompts": 8},
    advantage={"estimator": "gae", "kl_coef": 0.05},
    ppo={"minibatch_size": 4, "micro_batch_size": 4, "train_critic": True, "save_optimizer": True, "rl_iterations": 4,
         "optim": {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1}},
)


def run_local(cfg: Path, root: Path, store: str, *extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.run([sys.executable, "-m", "prmflow.cli", "pipeline", "run-local", "--config", str(cfg),
                        "--root", str(root), "--param", f"tracking_uri={store}", *extra], env=env, cwd=root.parent,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.returncode == 0, p.stdout[-3000:]
    return p.stdout


def final_policy_sha(root: Path) -> str:
    policies = sorted(root.glob("workspace/ppo-3-*/policy/model.safetensors"))
    assert len(policies) == 1, policies
    return hashlib.sha256(policies[0].read_bytes()).hexdigest()


def log_of(root: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", (root / "run-local.log").read_text())


def parent_of(store: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("chain")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`prmflow.role` = 'pipeline'")
    return client, parents


@pytest.mark.slow  # ~9 min alone on 2 cores (14 beside other work): three run-local commands
@pytest.mark.timeout(3600)
def test_a_chain_of_two_runs_stopped_between_them_ends_bit_for_bit_as_one_run_with_one_parent(tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))

    root, store = tmp_path / "chained", f"sqlite:///{tmp_path / 'chained.db'}"
    root.mkdir()
    out = run_local(cfg, root, store, "--set", "run_iterations=2", "--runs", "1")
    assert "run 1/2 of the chain: iterations 0..1 of 4" in out and "run 2/2" not in out
    assert list(root.glob("workspace/ppo-1-*/policy")) and not list(root.glob("workspace/ppo-2-*"))
    assert len(list(root.glob("workspace/chain-*/after-2.json"))) == 1
    before = len(log_of(root))

    out = run_local(cfg, root, store, "--set", "run_iterations=2")
    assert "run 2/2 of the chain: iterations 2..3 of 4" in out
    again = log_of(root)[before:]
    hits = set(re.findall(r"Task (\S+) cache hit", again))
    executed = set(re.findall(r"Executing task '(\S+)'", again))
    # the first run's tasks all come from the cache; the second run starts from its recorded state
    assert {"sft", "prm", "rollout", "advantage", "ppo", "rollout-2", "advantage-2", "ppo-2"} <= hits, sorted(hits)
    assert {"chain-resume", "evaluate"} <= executed and "sft" not in executed, sorted(executed)
    chained_sha = final_policy_sha(root)  # iteration 3's ppo wrote it: the second run numbered its iterations 2, 3

    client, parents = parent_of(store)
    assert len(parents) == 1, [p.data.tags for p in parents]
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    series = {key: sorted((m.step, m.value) for m in client.get_metric_history(parent.info.run_id, key))
              for key in ("pipeline/reward_mean", "pipeline/kl_to_sft")}
    assert all([s for s, _ in points] == [0, 1, 2, 3] for points in series.values()), series
    # the closing table of the second command: SFT (a cache hit of the first command's run) and all 4 iterations
    table = out[out.index("MLflow run"):]
    assert re.search(r"^sft\s", table, re.M) and all(re.search(rf"^iter {k}\s", table, re.M) for k in range(4)), table
    assert re.search(r"^final\s", table, re.M), table

    # the reference: the same 4 iterations as one run
    whole = tmp_path / "whole"
    whole.mkdir()
    out = run_local(cfg, whole, f"sqlite:///{tmp_path / 'whole.db'}")
    assert "of the chain" not in out  # 4 iterations fit one run here
    assert chained_sha == final_policy_sha(whole)
    whole_client, (whole_parent,) = parent_of(f"sqlite:///{tmp_path / 'whole.db'}")
    assert series == {key: sorted((m.step, m.value) for m in whole_client.get_metric_history(
        whole_parent.info.run_id, key)) for key in series}


OFF_BY_ONE = {**CONFIG, "pipeline": {**CONFIG["pipeline"], "schedule": "off_by_one"},
              "ppo": {**CONFIG["ppo"], "rollout_correction": "token_truncate", "recompute_old_logprobs": True}}


@pytest.mark.slow  # two run-local commands
@pytest.mark.timeout(3600)
def test_off_by_one_a_chain_ends_bit_for_bit_as_one_run(tmp_path):
    """Off by one, the second run's first rollout samples with the policy (and critic) one update older than the
    newest, which the first run recorded: a run that sampled the newest there would end elsewhere."""
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(OFF_BY_ONE))
    shas = {}
    for name, extra in (("chained", ("--set", "run_iterations=2")), ("whole", ())):
        root = tmp_path / name
        root.mkdir()
        out = run_local(cfg, root, f"sqlite:///{tmp_path / name}.db", *extra)
        assert ("run 2/2 of the chain: iterations 2..3 of 4" in out) == (name == "chained")
        shas[name] = final_policy_sha(root)
    assert shas["chained"] == shas["whole"]
