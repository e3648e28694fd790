"""A run-local pipeline killed in its last RL iteration and run again: what was finished is not
recomputed, and the final policy is bit-identical to a run that was never interrupted.

The kill is real (SIGKILL to the whole run-local process group while ppo-1 trains); the second run
uses the same ROOT, so kfp.local's cache (ROOT/cache) and the workspace (ROOT/workspace) are the
ones a re-submitted cluster run would find on its PVC.
"""

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tiny_pipeline import tiny_pipeline

CONFIG = tiny_pipeline(pipeline={"experiment": "resume", "cluster": {"cache_sampling": True}},
                       ppo={"minibatch_size": 4, "micro_batch_size": 4})


def run_local(cfg: Path, root: Path, store: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-m", "prmflow.cli", "pipeline", "run-local", "--config", str(cfg),
                             "--root", str(root), "--param", f"tracking_uri={store}"], env=env, cwd=root.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def final_policy_sha(root: Path) -> str:
    """sha256 of the last ppo step's policy weights on the workspace."""
    policies = sorted(root.glob("workspace/ppo-1-*/policy/model.safetensors"))
    assert len(policies) == 1, policies
    return hashlib.sha256(policies[0].read_bytes()).hexdigest()


def log_of(root: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", (root / "run-local.log").read_text())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_killed_run_resumes_without_recomputing_and_ends_bit_identical(tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))

    whole = tmp_path / "whole"
    whole.mkdir()
    p = run_local(cfg, whole, f"sqlite:///{tmp_path / 'whole.db'}")
    assert p.wait() == 0, p.stdout.read().decode()[-3000:]

    root = tmp_path / "killed"
    root.mkdir()
    p = run_local(cfg, root, f"sqlite:///{tmp_path / 'killed.db'}")
    while p.poll() is None and "Executing task 'ppo-2'" not in (log_of(root) if (root / "run-local.log").exists() else ""):
        time.sleep(0.5)
    assert p.poll() is None, "the run ended before its last ppo step began"
    os.killpg(p.pid, signal.SIGKILL)  # the run-local process and every task subprocess it started
    p.wait()
    assert not list(root.glob("workspace/ppo-1-*/policy"))  # the last iteration had not committed
    before = len(log_of(root))

    p = run_local(cfg, root, f"sqlite:///{tmp_path / 'killed.db'}")
    assert p.wait() == 0, p.stdout.read().decode()[-3000:]
    rerun = log_of(root)[before:]
    hits = set(re.findall(r"Task (\S+) cache hit", rerun))
    executed = set(re.findall(r"Executing task '(\S+)'", rerun))
    # everything up to the kill came from the cache; only the killed step and what follows it ran again
    assert {"sft", "prm", "rollout", "advantage", "ppo", "rollout-2", "advantage-2"} <= hits, sorted(hits)
    assert {"sft", "prm", "ppo", "advantage", "advantage-2"}.isdisjoint(executed), sorted(executed)
    assert {"ppo-2", "evaluate"} <= executed
    assert final_policy_sha(root) == final_policy_sha(whole)
