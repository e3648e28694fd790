"""The MLflow UI in a real browser: what a user finds there after a pipeline run.

A real `mlflow server` on loopback serves a SQLite store; headless Chromium (Debian's package,
driven by Playwright with the system browser; no browser download) opens it.

- Two FINISHED pipeline parent runs written through prmflow's own tracking calls
  (`start_pipeline_run` / `finish_pipeline_run`, as the pipeline's init_tracking step and exit
  handler do): the test ticks both in the runs table, clicks Compare, and reads each run's
  `eval/accuracy` off the comparison page, under that run's own column.
- A small `prmflow pipeline run-local` (slow: every stage runs for real, two RL iterations of two
  rollout shards): the page run-local prints opens on the runs table (not MLflow's GenAI overview)
  with every stage run under the parent, the parent charts reward per RL iteration, a stage run
  shows its datasets and the model it wrote, and the registered policy links its parent run.
- The compare links prmflow prints (slow): run-local's last line, opened, compares three real ppo
  iterations under one parent run in the training view, each iteration's clip fraction, entropy and
  approximate KL under its own column; `pipeline compare`'s compares the two parent runs. Their
  screenshots are the ones in docs/mlflow.md.

Screenshots are saved in the test's tmp_path and copied to $PRMFLOW_TEST_ARTIFACTS (default:
tests-output/ in the repository, git-ignored); their paths are printed.
Skipped, with the reason, only when no Chromium is installed; `.ci/run` installs it.
"""

from __future__ import annotations

import contextlib
import io
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
import yaml

from tiny_pipeline import tiny_pipeline
from prmflow import tracking

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


@contextlib.contextmanager
def _serve(uri: str, workdir: Path):
    """`mlflow server` (the venv's) on loopback against the store `uri`; yields its base URL."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = workdir / "mlflow-server.log"
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "server", "--backend-store-uri", uri,
           "--default-artifact-root", str(workdir / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    # no background job runner (it starts several huey consumers): the UI test needs none of it
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
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


@pytest.fixture
def mlflow_server(store, tmp_path):
    with _serve(store[0], tmp_path) as base:
        yield base


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
    print(f"screenshot: {ARTIFACTS / name}")
    return shot


@contextlib.contextmanager
def _screenshot_on_failure(page, tmp_path: Path, name: str):
    """On any failure inside, a screenshot `name` (best effort) before the failure goes on."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            _save(page, tmp_path, name)
        raise


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

        # each run's accuracy is on the page, in that run's column of the comparison, on the eval/accuracy row.
        # The metrics table is two virtualized grids side by side (metric names | one column per run); a cell
        # is a `[role=rowgroup] > div` placed by its inline `top`, so "same row" is read from the DOM, and the
        # boxes are measured after one scroll (a scroll between two measurements moves the second one).
        def cell(text: str):
            found = page.locator("[role=rowgroup] > div", has=page.get_by_text(text, exact=True))
            expect(found).to_have_count(1)
            return found

        label = cell("eval/accuracy")
        values = {name: cell(f"{RUNS[name]['metrics']['eval/accuracy']:.3f}") for name in RUNS}
        label.scroll_into_view_if_needed()
        tops = {"eval/accuracy": label.evaluate("e => e.style.top"),
                **{name: v.evaluate("e => e.style.top") for name, v in values.items()}}
        assert len(set(tops.values())) == 1, f"the accuracies are not on the eval/accuracy row: {tops}"
        assert values["outcome-only"].evaluate("(e, other) => e.parentElement === other.parentElement",
                                               values["prm+outcome"].element_handle()), "not one grid"
        boxes = {"eval/accuracy": label.bounding_box(), **{name: v.bounding_box() for name, v in values.items()}}
        assert max(b["y"] for b in boxes.values()) - min(b["y"] for b in boxes.values()) < 1, boxes
        for name in RUNS:
            column = page.locator("td", has=page.get_by_text(name, exact=True))
            expect(column).to_have_count(1)
            col, val = column.bounding_box(), boxes[name]
            assert col["x"] <= val["x"] + 1 and val["x"] + val["width"] <= col["x"] + col["width"] + 1, \
                (name, col, val)

        page.wait_for_timeout(500)  # let the plot settle before the picture
        shot = _save(page, tmp_path, "mlflow-compare-runs.png")
        assert shot.stat().st_size > 10_000
    except BaseException:
        try:
            _save(page, tmp_path, "mlflow-compare-runs-FAILED.png")
        except Exception:
            pass
        raise


#: A small pipeline (the budgets of tests/pipelines/test_run_local.py): 2 RL iterations of 2 rollout shards.
PIPELINE = tiny_pipeline(pipeline={"experiment": "ui-test"})


@pytest.fixture
def pipeline_run(tmp_path, monkeypatch):
    """A finished `pipeline run-local` in a SQLite store: (uri, the page run-local says to open, client)."""
    from mlflow.tracking import MlflowClient

    from prmflow import cli

    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(PIPELINE))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the task subprocesses: one thread each, this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["pipeline", "run-local", "--config", str(tmp_path / "pipeline.yaml"), "--root",
                         str(tmp_path / "root"), "--param", f"tracking_uri={uri}"]) == 0
    printed = out.getvalue()
    page = re.search(r"then open (http://\S+)", printed)
    assert page, f"run-local printed no MLflow page to open:\n{printed[-2000:]}"
    return uri, page.group(1), MlflowClient(uri)


def _close_assistant(page) -> None:
    close = page.get_by_role("button", name="Close", exact=True)  # the assistant side panel, if shown
    if close.count() == 1:
        close.click()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_pipeline_run_as_the_mlflow_ui_shows_it(pipeline_run, page, tmp_path):
    from playwright.sync_api import expect

    uri, printed_page, client = pipeline_run
    exp = client.get_experiment_by_name("ui-test")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], max_results=100)}
    [parent] = [r for r in runs.values() if r.data.tags.get("prmflow.role") == "pipeline"]
    ppo = runs["ppo-iter1"]
    # what the UI will be asked to show, read from the store first
    rewards = [(m.step, m.value) for m in client.get_metric_history(parent.info.run_id, "pipeline/reward_mean")]
    assert [s for s, _ in rewards] == [0, 1]
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id]).to_list()}
    assert {"policy", "prm", "policy-iter0", "policy-iter1"} <= set(models)
    datasets = [d.dataset.name for d in ppo.inputs.dataset_inputs]
    assert datasets, "the ppo run logged no datasets"
    [version] = client.search_model_versions("name = 'ui-test-policy'")
    assert (version.run_id, version.source) == (parent.info.run_id, f"models:/{models['policy-iter1'].model_id}")

    with _serve(uri, tmp_path) as base:
        step = "landing"
        try:
            # 1. the page run-local printed opens on the runs table, every stage run under the parent
            page.goto(printed_page.replace("http://127.0.0.1:5000", base), wait_until="domcontentloaded")
            parent_link = page.get_by_role("link", name=parent.info.run_name, exact=True)
            expect(parent_link).to_be_visible(timeout=90_000)  # first load parses the whole UI bundle
            assert "/runs" in page.url and "overview" not in page.url, page.url
            _close_assistant(page)
            # the parent's row expands into its child runs (the [+] before its name)
            parent_row = page.locator(f'[role=row][row-id="{parent.info.run_id}"]')
            parent_row.get_by_role("button").first.click()
            for name in ("sft", "prm", "rollout-iter1 shard 0/2", "rollout-iter1 shard 1/2", "ppo-iter1", "evaluate"):
                link = page.locator(f'a[href$="/runs/{runs[name].info.run_id}"]').first  # the run's name cell
                expect(link).to_be_visible()
                expect(link).to_have_text(name)
            # a stage run's row: its first dataset and the model it wrote (Dataset and Models columns)
            ppo_row = page.locator(f'[role=row][row-id="{ppo.info.run_id}"]')
            expect(ppo_row.get_by_text(datasets[0], exact=False).first).to_be_visible()
            expect(ppo_row.locator(f'a[href$="/models/{models["policy-iter1"].model_id}"]').first).to_be_visible()
            _close_assistant(page)
            _save(page, tmp_path, "mlflow-landing-runs.png")

            # 2. the parent run's chart of reward per RL iteration
            step = "parent-reward-chart"
            parent_link.click()
            page.get_by_role("tab", name="Model metrics").click()
            page.get_by_placeholder("Search metric charts").fill("reward_mean")
            expect(page.get_by_text("reward_mean", exact=True).first).to_be_visible(timeout=30_000)
            _close_assistant(page)
            page.wait_for_timeout(1000)  # let the plot settle before the picture
            _save(page, tmp_path, "mlflow-parent-reward-per-iteration.png")

            # 3. a stage run: its datasets and the model it wrote
            step = "stage-run"
            page.goto(f"{base}/#/experiments/{exp.experiment_id}/runs/{ppo.info.run_id}?workflowType=machine_learning")
            expect(page.get_by_text("Datasets", exact=True)).to_be_visible(timeout=30_000)
            expect(page.get_by_text(re.compile("|".join(re.escape(d) for d in datasets))).first).to_be_visible()
            expect(page.get_by_role("link", name="policy-iter1", exact=True).first).to_be_visible()
            expect(page.get_by_text("PPO update of the policy", exact=False)).to_be_visible()  # the description
            _close_assistant(page)
            _save(page, tmp_path, "mlflow-stage-run-datasets-models.png")

            # 4. the registered final policy: its evaluation and a link to the pipeline's parent run
            step = "registered-model"
            page.goto(f"{base}/#/models/ui-test-policy/versions/{version.version}?workflowType=machine_learning")
            expect(page.get_by_role("link", name=parent.info.run_name, exact=True)).to_be_visible(timeout=30_000)
            expect(page.get_by_role("link", name="policy-iter1", exact=True)).to_be_visible()
            expect(page.get_by_text("final/accuracy", exact=True)).to_be_visible()
            _close_assistant(page)
            _save(page, tmp_path, "mlflow-registered-policy.png")
        except BaseException:
            try:
                _save(page, tmp_path, f"mlflow-{step}-FAILED.png")
            except Exception:
                pass
            raise


# --- the compare links prmflow prints ---------------------------------------------------------------------

def _open_compare(page, url: str, n: int) -> None:
    """Open a printed compare link and wait for MLflow's comparison of `n` runs."""
    from playwright.sync_api import expect

    page.goto(url, wait_until="domcontentloaded")
    expect(page.get_by_text(f"Comparing {n} Runs", exact=False)).to_be_visible(timeout=90_000)
    _close_assistant(page)
    # the training view: its side bar has the model registry; GenAI's has prompts and the AI gateway instead
    expect(page.get_by_role("link", name="Model registry", exact=True)).to_be_visible()
    expect(page.get_by_role("link", name="AI Gateway", exact=False)).to_have_count(0)


def _format_metric(v: float) -> str:
    """How MLflow 3.17's UI prints a metric (Utils.formatMetric in its bundle, main.c2f5f8d4.js)."""
    if v == 0:
        return "0"
    if abs(v) < 1e-3:
        mantissa, exp = f"{v:.3e}".split("e")
        return f"{mantissa}e{int(exp):+d}"
    digits = 3 if abs(v) < 10 else 2 if abs(v) < 100 else 1
    return f"{round(v, digits):g}" if digits < 3 else f"{round(v, 3):.3f}".rstrip("0").rstrip(".")


def _row_values(page, metric: str) -> list[str]:
    """The texts on `metric`'s row of the comparison's metrics table, left to right (one per run column)."""
    from playwright.sync_api import expect

    label = page.locator("[role=rowgroup] > div", has=page.get_by_text(metric, exact=True))
    expect(label).to_have_count(1)
    label.scroll_into_view_if_needed()
    return page.evaluate("""(label) => {
        const top = label.style.top;
        const cells = [...document.querySelectorAll('[role=rowgroup] > div')]
            .filter(c => c !== label && c.style.top === top && c.parentElement !== label.parentElement);
        return cells.sort((a, b) => a.getBoundingClientRect().x - b.getBoundingClientRect().x).map(c => c.innerText.trim());
    }""", label.element_handle())


def _metrics_row(page, metric: str, values: dict[str, str]) -> None:
    """On the comparison page: each run's value of `metric` on that metric's row, in that run's column.
    The metrics table is two virtualized grids side by side (metric names | one column per run); a cell
    is a `[role=rowgroup] > div` placed by its inline `top`."""
    from playwright.sync_api import expect

    def cell(text: str):
        found = page.locator("[role=rowgroup] > div", has=page.get_by_text(text, exact=True))
        expect(found).to_have_count(1)
        return found

    label = cell(metric)
    label.scroll_into_view_if_needed()
    shown = {name: cell(text) for name, text in values.items()}
    tops = {metric: label.evaluate("e => e.style.top"), **{n: c.evaluate("e => e.style.top") for n, c in shown.items()}}
    assert len(set(tops.values())) == 1, f"the values are not on the {metric} row: {tops}"
    for name, c in shown.items():
        column = page.locator("td", has=page.get_by_text(name, exact=True))
        expect(column).to_have_count(1)
        col, val = column.bounding_box(), c.bounding_box()
        assert col["x"] <= val["x"] + 1 and val["x"] + val["width"] <= col["x"] + col["width"] + 1, (name, col, val)


@pytest.mark.slow
def test_the_printed_compare_link_shows_two_pipeline_runs_side_by_side(store, mlflow_server, page, tmp_path):
    """`prmflow pipeline compare` ends with a link; opened, it compares the variants' pipeline runs in the
    training view, each run's accuracy under its own column."""
    from prmflow.pipelines.compare import compare_hint

    uri, _, ids = store
    hint = compare_hint(uri, ids)
    url = re.search(r"then open (http://\S+)", hint).group(1).replace("http://127.0.0.1:5000", mlflow_server)
    with _screenshot_on_failure(page, tmp_path, "mlflow-compare-pipeline-runs-FAILED.png"):
        _open_compare(page, url, 2)
        for run_id in ids.values():
            assert run_id in page.url
        _metrics_row(page, "eval/accuracy", {name: f"{RUNS[name]['metrics']['eval/accuracy']:.3f}" for name in RUNS})
        page.get_by_text("Comparing 2 Runs", exact=False).scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        _save(page, tmp_path, "mlflow-compare-pipeline-runs.png")


@pytest.fixture
def ppo_iterations(tmp_path, monkeypatch):
    """Three real ppo runs, iterations 0-2 (each continuing the last one's policy and optimizer) under one
    pipeline parent run, in a SQLite store: (uri, experiment, parent run id)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ppo"))
    from ppo_helpers import FAST, build_rows, write_advantages

    from prmflow import cli
    from prmflow.components import config
    from prmflow.components.ppo import stage

    monkeypatch.chdir(tmp_path)
    uri, experiment = f"sqlite:///{tmp_path / 'mlflow.db'}", "prmflow-iterations"
    parent_cfg = tracking.TrackingConfig(uri=uri, experiment=experiment, pipeline_run_id="kfp-iterations",
                                         run_name="pipeline", fallback_path=str(tmp_path / "parent.jsonl"))
    parent = tracking.start_pipeline_run(parent_cfg, params={}).run_id
    assert cli.main(["make-tiny-model", str(tmp_path / "sft")]) == 0
    rows = build_rows(tmp_path / "sft", 8)
    policy, optimizer = str(tmp_path / "sft"), ""
    for k in range(3):
        adv = write_advantages(tmp_path / f"adv-{k}", rows, lambda i, t, k=k: (-1) ** (i + k) * (1 + t / 10))
        out = tmp_path / f"ppo-{k}"
        stage.run(config.load(stage.Config, overrides={
            **FAST, "policy": policy, "input": str(adv), "output": str(out), "iteration": k, "rl_iterations": 3,
            "epochs": 2, "minibatch_size": 4, "micro_batch_size": 4, "optimizer_state": optimizer,
            "tracking.enabled": True, "tracking.uri": uri, "tracking.experiment": experiment,
            "tracking.parent_run_id": parent, "tracking.pipeline_run_id": "kfp-iterations",
            "tracking.run_name": f"ppo-iter{k}"}))
        policy, optimizer = str(out / "policy"), str(out / "optimizer")
    assert tracking.finish_pipeline_run(parent_cfg, "FINISHED") == parent
    return uri, experiment, parent


@pytest.mark.slow
def test_the_printed_compare_link_shows_the_rl_iterations_side_by_side(ppo_iterations, page, tmp_path):
    """run-local's closing lines end with a link comparing the RL iterations' ppo runs; opened, it shows
    the three runs in the training view, each iteration's clip fraction under its own column."""
    from mlflow.tracking import MlflowClient

    from prmflow.pipelines.summary import iteration_runs, ui_hint

    uri, experiment, parent = ppo_iterations
    hint = ui_hint(uri, experiment, parent)  # as run-local prints it for its own pipeline run
    found = re.search(r"compare the 3 RL iterations \(their ppo runs\) side by side: (http://\S+)", hint)
    assert found, hint
    runs = iteration_runs(MlflowClient(uri), parent)
    assert [r.info.run_name for r in runs] == ["ppo-iter0", "ppo-iter1", "ppo-iter2"]
    with _serve(uri, tmp_path) as base:
        with _screenshot_on_failure(page, tmp_path, "mlflow-compare-rl-iterations-FAILED.png"):
            _open_compare(page, found.group(1).replace("http://127.0.0.1:5000", base), 3)
            for r in runs:
                assert r.info.run_id in page.url
            assert "workflowType=machine_learning" in page.url
            # the iterations' own numbers, each under its run, in iteration order
            for metric in ("ppo/clip_frac", "ppo/entropy", "ppo/approx_kl"):
                assert _row_values(page, metric) == [_format_metric(r.data.metrics[metric]) for r in runs], metric
            # the picture: only the parameters that differ (the rest would fill pages), then the metrics
            page.get_by_text("Show diff only", exact=True).first.click()
            page.get_by_text("Parameters", exact=True).last.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(1000)
            _save(page, tmp_path, "mlflow-compare-rl-iterations.png")
