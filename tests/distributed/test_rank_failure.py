"""A 2-rank sft run that loses a rank, or is stopped with SIGTERM, commits nothing, and the same
command then resumes and ends with the weights of an uninterrupted 2-rank run.

- SIGKILL to rank 1 (a worker pid, as the OOM killer or a lost node would): torchrun's agent stops
  rank 0, the command exits non-zero with an error naming rank 1, and no output is committed.
- SIGTERM to the command (what Kubernetes sends the container): torchrun passes it to both ranks,
  they agree on the step, save one checkpoint and the command exits 143.

The waits below are hang guards (a stuck collective would otherwise stall the suite), not timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dp_helpers import (ARGS, COLLECTIVE_TIMEOUT_S, command, env, max_abs_diff, rank_pid, run_cli,
                        weights)

pytestmark = pytest.mark.slow

HANG_GUARD_S = COLLECTIVE_TIMEOUT_S + 120  # torchrun waits up to 30 s for the survivors to exit


def _values(run_dir: Path) -> dict:
    # enough steps after the first checkpoint (step 3) that the run is still going when it is stopped
    return {**ARGS["sft"], "max_steps": 24, "save_every": 3, "output": str(run_dir / "out"),
            "engine.backend": "deepspeed", "engine.zero_stage": 2, "engine.nproc_per_node": 2,
            "engine.collective_timeout_s": COLLECTIVE_TIMEOUT_S, "tracking.enabled": False}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = run_cli("sft", _values(run_dir), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return weights(run_dir / "out" / "model.safetensors")


def _start_and_stop(run_dir: Path, how: str) -> subprocess.CompletedProcess:
    """Start the 2-rank run, wait for its first resume checkpoint, then kill rank 1 or SIGTERM the command."""
    proc = subprocess.Popen(command("sft", _values(run_dir)), cwd=run_dir, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    checkpoint = run_dir / ".out.work" / "latest" / "manifest.json"
    try:
        deadline = time.monotonic() + 600
        while not checkpoint.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert checkpoint.is_file(), "the run wrote no resume checkpoint"
        if how == "kill rank 1":
            pid = rank_pid(proc.pid, 1)
            assert pid is not None, "no worker with RANK=1 among the command's children"
            os.kill(pid, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("how", ["kill rank 1", "sigterm"])
def test_stopped_run_commits_nothing_and_resumes_to_the_same_weights(how, uninterrupted, tmp_path):
    stopped = _start_and_stop(tmp_path, how)
    if how == "kill rank 1":
        assert stopped.returncode not in (0, 143), stopped.stderr[-3000:]
        assert "rank 1 of 2" in stopped.stderr and "killed by signal 9" in stopped.stderr, stopped.stderr[-3000:]
    else:
        assert stopped.returncode == 143, stopped.stderr[-3000:]
        assert "stopped after step" in stopped.stderr, stopped.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # nothing committed
    assert (tmp_path / ".out.work" / "latest" / "manifest.json").is_file()  # a whole checkpoint to resume from

    again = run_cli("sft", _values(tmp_path), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [line for line in again.stdout.splitlines() if line.startswith("sft: resuming from step")]
    assert resumed, again.stdout[-2000:]
    assert int(resumed[0].split()[4]) >= 3
    diff = max_abs_diff(uninterrupted, weights(tmp_path / "out" / "model.safetensors"))
    print(f"{how}: resumed at {resumed[0]!r}; max |w_resumed - w_uninterrupted| = {diff:.3g}")
    assert diff == 0.0  # same ranks, same partitions, same order of every sum: bit for bit
    assert not (tmp_path / ".out.work").exists()
