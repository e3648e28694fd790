"""Fixtures of the reliability tests, and the reliability report printed at the end of the run.

Tests add numbers with `reliability.add(section, **counts)`; the terminal summary prints them, and
PRMFLOW_RELIABILITY_REPORT=FILE also writes them there as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kill_harness  # noqa: E402
from kill_harness import free_port  # noqa: E402
from stage_cases import ALL_CASES  # noqa: E402


class Report:
    def __init__(self):
        self.sections: dict[str, dict] = defaultdict(dict)

    def add(self, section: str, **values) -> None:
        for k, v in values.items():
            have = self.sections[section].get(k)
            self.sections[section][k] = have + v if isinstance(v, (int, float)) and isinstance(have, (int, float)) else v


REPORT = Report()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """In-process training on one thread, as the stage subprocesses run (OMP_NUM_THREADS=1): on 2 shared
    cores a second thread only adds contention, and both runs of a bit-for-bit comparison match it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reliability() -> Report:
    return REPORT


def pytest_terminal_summary(terminalreporter):
    if not REPORT.sections:
        return
    terminalreporter.section("reliability report")
    for name, values in sorted(REPORT.sections.items()):
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    path = os.environ.get("PRMFLOW_RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT.sections, indent=2, sort_keys=True))


# --- stage references (one uninterrupted run per case, shared by every test that needs it) -------------

@pytest.fixture(scope="session")
def stage_runs(tmp_path_factory):
    """`get(name) -> (root, inputs, ref_dir, ref_seconds)`: the case's uninterrupted reference run."""
    root = tmp_path_factory.mktemp("stages")
    done: dict[str, tuple] = {}

    def get(name: str):
        if name not in done:
            case = ALL_CASES[name]
            inputs = root / "inputs"
            inputs.mkdir(exist_ok=True)
            if case.prepare:
                case.prepare(inputs)
            ref_dir, seconds = kill_harness.reference(case, root / name, inputs)
            done[name] = (root / name, inputs, ref_dir, seconds)
        return done[name]

    return get


# --- a real MLflow tracking server, killed and restarted by the tests -------------------------------

class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store; start/kill/restart keep the port and the store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.store = f"sqlite:///{root / 'mlflow.db'}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner subprocesses
        mlflow = Path(sys.executable).parent / "mlflow"
        log = open(self.root / f"server-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--backend-store-uri", self.store, "--artifacts-destination",
             str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    def start_async(self) -> threading.Thread:
        t = threading.Thread(target=lambda: (self.start(), self.wait_up()), daemon=True)
        t.start()
        return t

    def is_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_up(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.root}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow server not up after {timeout} s")
            time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL the server and its workers (its own process group): an outage, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 30
        while self.is_up():  # a worker that outlived its parent would still answer
            assert time.monotonic() < deadline, "the mlflow server still answers after SIGKILL"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.kill()
    shutil.rmtree(server.root / "artifacts", ignore_errors=True)
