"""The MLflow UI in a real browser: two finished prmflow parent runs, selected and compared.

A real `mlflow server` on loopback serves a SQLite store holding two FINISHED pipeline parent runs
written through prmflow's own tracking calls (`start_pipeline_run` / `finish_pipeline_run`, as the
pipeline's init_tracking step and exit handler do). Headless Chromium (Debian's package, driven by
Playwright with the system browser; no browser download) opens the experiment's runs table, ticks
both runs, clicks Compare, and the test reads each run's `eval/accuracy` off the comparison page,
under that run's own column. The comparison page is saved as a PNG in the test's tmp_path and
copied to $PRMFLOW_TEST_ARTIFACTS (default: tests-output/ in the repository, git-ignored).

Skipped, with the reason, only when no Chromium is installed; `.ci/run` installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prmflow.components.common import tracking

CHROMIUM = os.environ.get("PRMFLOW_CHROMIUM", "/usr/bin/chromium")
#: What Chromium needs as root on a machine with a closed network (no sandbox, nothing fetched in the
#: background). Playwright adds --headless and a fresh temporary --user-data-dir itself.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXPERIMENT = "prmflow-compare"
#: Two parent runs as `prmflow pipeline compare` names them; accuracies chosen to be unique on the page.
RUNS = {
    "outcome-only": {"params": {"advantage.estimator": "grpo", "advantage.step_rewards": False,
                                "ppo.lr": 1e-5, "rollout.n_samples": 4},
                     "metrics": {"eval/accuracy": 0.412, "eval/baseline_accuracy": 0.305}},
    "prm+outcome": {"params": {"advantage.estimator": "reinforce_baseline", "advantage.step_rewards": True,
                               "ppo.lr": 1e-5, "rollout.n_samples": 4},
                    "metrics": {"eval/accuracy": 0.538, "eval/baseline_accuracy": 0.305}},
}
ARTIFACTS = Path(os.environ.get("PRMFLOW_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "tests-output"))

pytestmark = [
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"no Chromium browser installed at {CHROMIUM} (Debian: apt-get install chromium; "
                              f".ci/run installs it)"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A SQLite MLflow store with the two finished parent runs: (uri, experiment id, {name: run id})."""
    monkeypatch.chdir(tmp_path)  # nothing (mlruns/, fallback files) lands in the repository
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = {}
    for i, (name, run) in enumerate(RUNS.items()):
        cfg = tracking.TrackingConfig(uri=uri, experiment=EXPERIMENT, pipeline_run_id=f"kfp-{i}", run_name=name,
                                      fallback_path=str(tmp_path / f"{name}.tracking.jsonl"))
        ids[name] = tracking.start_pipeline_run(cfg, params=run["params"]).run_id
        assert tracking.finish_pipeline_run(cfg, "FINISHED", run["metrics"]) == ids[name]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for name, run_id in ids.items():  # the store holds what the UI is expected to show
        run = client.get_run(run_id)
        assert (run.info.run_name, run.info.status) == (name, "FINISHED")
        assert run.data.metrics["eval/accuracy"] == RUNS[name]["metrics"]["eval/accuracy"]
    return uri, client.get_experiment_by_name(EXPERIMENT).experiment_id, ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(store, tmp_path):
    """`mlflow server` (the venv's) on loopback against the store; yields its base URL."""
    uri, _, _ = store
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "mlflow-server.log"
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "server", "--backend-store-uri", uri,
           "--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    # no background job runner (it starts several huey consumers): the UI test needs none of it
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer {base}/health in 120 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield base
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End the server and everything it started (its own session/process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
    try:  # children left behind after the leader exited
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def page():
    """A page in headless system Chromium, closed with the browser afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 1600})
            context.set_default_timeout(30_000)
            yield context.new_page()
        finally:
            browser.close()


def _save(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    return shot


def test_two_runs_compared_in_the_mlflow_ui(store, mlflow_server, page, tmp_path):
    from playwright.sync_api import expect

    _, experiment_id, ids = store
    try:
        # the experiment's runs table (the "Model training" view; MLflow 3 opens GenAI's overview otherwise)
        page.goto(f"{mlflow_server}/#/experiments/{experiment_id}/runs?workflowType=machine_learning",
                  wait_until="domcontentloaded")
        for name in RUNS:  # first load parses the whole UI bundle: be generous
            expect(page.get_by_role("link", name=name, exact=True)).to_be_visible(timeout=90_000)

        # tick both runs' selection checkboxes (ag-grid rows carry the run id)
        for name, run_id in ids.items():
            box = page.locator(f'[role=row][row-id="{run_id}"] .ag-selection-checkbox input[type=checkbox]')
            box.check()
            expect(box).to_be_checked()

        page.get_by_role("button", name="Compare", exact=True).click()
        page.wait_for_url(re.compile(r".*#/compare-runs\?runs=.*"), timeout=60_000)
        for run_id in ids.values():
            assert run_id in page.url
        expect(page.get_by_text("Comparing 2 Runs", exact=False)).to_be_visible(timeout=60_000)

        close = page.get_by_role("button", name="Close", exact=True)  # the assistant side panel, if shown
        if close.count() == 1:
            close.click()

        # each run's accuracy is on the page, in that run's column of the comparison
        acc_rows = []
        for name in RUNS:
            value = page.get_by_text(f"{RUNS[name]['metrics']['eval/accuracy']:.3f}", exact=True)
            expect(value).to_be_visible()
            value.scroll_into_view_if_needed()
            column = page.locator("td", has=page.get_by_text(name, exact=True))
            expect(column).to_have_count(1)
            col, val = column.bounding_box(), value.bounding_box()
            assert col["x"] <= val["x"] and val["x"] + val["width"] <= col["x"] + col["width"], (name, col, val)
            acc_rows.append(val["y"])
        assert abs(acc_rows[0] - acc_rows[1]) < 5, acc_rows  # both in one row ...
        labels = page.get_by_text("eval/accuracy", exact=True)
        assert any(abs(box["y"] - acc_rows[0]) < 10 for box in
                   (labels.nth(i).bounding_box() for i in range(labels.count())) if box), \
            "no 'eval/accuracy' label on the row of the accuracies"  # ... the eval/accuracy row

        page.wait_for_timeout(500)  # let the plot settle before the picture
        shot = _save(page, tmp_path, "mlflow-compare-runs.png")
        assert shot.stat().st_size > 10_000
    except BaseException:
        try:
            _save(page, tmp_path, "mlflow-compare-runs-FAILED.png")
        except Exception:
            pass
        raise
