"""A pipeline task's process skips the shutdown garbage collections (prmflow/components/runtime/shutdown.py).

Each entry point a process starts from (the `prmflow` command, a KFP stage component through the
shim, the pipeline's own tracking steps) is run in a fresh interpreter. An exit handler registered
before it, which therefore runs after prmflow's, reports how many objects were frozen by then and
proves the other exit handlers still run; the exit status must be the one the entry point chose.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))  # runs after prmflow's handlers
"""

ENTRY_POINTS = {
    # the prmflow command (also every rank under torchrun, and the parent of `pipeline run-local`)
    "cli": "from prmflow import cli\nsys.exit(cli.main([]))",
    # a user error still exits 2
    "cli-error": "from prmflow import cli\nsys.exit(cli.main(['advantage', '--estimator', 'no-such']))",
    # a KFP stage component: the shim around stage.run
    "kfp-shim": textwrap.dedent("""
        import dataclasses, types
        from prmflow.pipelines import kfp_shim
        from prmflow.tracking import TrackingConfig
        @dataclasses.dataclass
        class Config:
            steps: int = 1
            tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
        stage = types.SimpleNamespace(Config=Config, run=lambda cfg: {"steps": cfg.steps})
        print("metrics:", kfp_shim.run_stage("toy", stage, {"steps": 3}, {}))
    """),
    # the pipeline's first step (opens the MLflow parent run)
    "init-tracking": textwrap.dedent("""
        import sys
        from prmflow.pipelines.lineage import init_tracking
        init_tracking("kfp-1", "sqlite:///" + sys.argv[1] + "/mlflow.db", "e", {}, {}, {}, {}, {}, {})
    """),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_process_freezes_its_objects_at_exit_and_keeps_its_exit_status(entry, tmp_path):
    script = PRELUDE + ENTRY_POINTS[entry]
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == (2 if entry == "cli-error" else 0), p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("frozen at exit:")]
    assert len(lines) == 1, p.stdout[-2000:]  # the other exit handlers still ran
    frozen = int(lines[0].split(":")[1])
    assert frozen > 10_000, f"{entry}: {frozen} objects frozen at exit: the shutdown collections walk them all"
    if entry == "kfp-shim":
        assert "metrics: {'steps': 3}" in p.stdout
    if entry == "cli-error":
        assert "no-such" in p.stderr
