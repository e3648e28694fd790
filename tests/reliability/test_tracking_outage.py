"""Tracking outages: a stage keeps training when MLflow is down at its start or goes down mid-run;
every metric arrives once the server is back, or sits in the fallback file until `sync_fallback`
uploads it; checkpoints never wait for the tracking server.

The fast tests put a switchable fault in front of a real SQLite-backed MlflowClient, and drive the
tracker's clock by hand (no wall-clock limits: what must not stall is checked as "no wait, no call");
the slow ones start a real `mlflow server` on 127.0.0.1, SIGKILL it mid-run and start it again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from kill_harness import free_port
from stage_cases import make_rollouts
from prmflow.components.advantage import stage as advantage
from prmflow.components.training import checkpoint
from prmflow.components import config
from prmflow import tracking
from prmflow.components.sft import stage as sft


class FlakyClient:
    """A real MlflowClient behind a switch: while `down`, every call fails as a refused connection does."""

    def __init__(self, uri: str):
        self.real = MlflowClient(uri)
        self.down = False
        self.refuse: set[str] = set()  # param names the "server" rejects as invalid
        self.calls = 0

    def __getattr__(self, name):
        method = getattr(self.real, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise MlflowException(f"API request to /{name} failed with exception Max retries exceeded "
                                      f"(Connection refused)", error_code=INTERNAL_ERROR)
            if any(p.key in self.refuse for p in kwargs.get("params", [])):
                raise MlflowException("Changing param values is not allowed", error_code=INVALID_PARAMETER_VALUE)
            return method(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the fast tests (creating one costs seconds); each test uses its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture
def flaky(monkeypatch, store):
    client = FlakyClient(store)
    monkeypatch.setattr(tracking.runs, "mlflow_client", lambda uri: client)
    monkeypatch.setattr(tracking.tracker, "FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(tracking.tracker, "MAX_BACKOFF_S", 0.05)
    return client


class FakeTime:
    """The tracker's clock, moved by the test: `sleep` returns at once, advances it and is recorded;
    `time` (the timestamps MLflow stores) stays the real one."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    @staticmethod
    def time() -> float:
        return time.time()


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(tracking.tracker, "time", fake)
    return fake


@pytest.fixture
def connections(monkeypatch):
    """Every TCP connection MLflow's HTTP client (requests/urllib3) opens, refused or not: one per
    attempt, so MLflow's own retries would show as several per call."""
    import urllib3.connection

    opened = []
    real = urllib3.connection.HTTPConnection.connect

    def connect(self):
        opened.append((self.host, self.port))
        return real(self)

    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", connect)
    return opened


def clean_http_env(monkeypatch):
    """Unset MLflow's HTTP settings for this test only (start_run sets them for the process)."""
    import os

    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setitem(os.environ, var, "placeholder")  # records the original state for undo
        monkeypatch.delitem(os.environ, var)


def history(client, run_id, key):
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_down_at_start_then_back_delivers_everything_in_order(flaky, clock, tmp_path, store, reliability):
    flaky.down = True
    fallback = tmp_path / "fb.jsonl"
    cfg = tracking.TrackingConfig(uri=store, experiment="back", fallback_path=str(fallback), finish_wait_s=5)
    t0 = int(time.time() * 1000)
    tracker = tracking.start_stage_run(cfg, "sft", params={"lr": 0.1, "output": "x"})
    assert tracker.run_id == "" and tracker.pending == 2  # create_run and params wait for the server
    calls = flaky.calls
    for step in range(1, 6):
        tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
    # training is not stalled by the outage: within the retry backoff the calls are queued at once,
    # with no wait and no call to the server
    assert flaky.calls == calls and clock.slept == []
    assert tracker.pending == 7 and fallback.is_file()
    flaky.down = False
    clock.now += 0.1  # past the retry backoff (0.05 s here)
    tracker.log_metrics({"train/loss": 0.1}, step=6)
    assert tracker.pending == 0 and tracker.run_id
    tracker.finish()
    run = flaky.real.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1", "output": "x"}
    assert run.data.tags["prmflow.stage"] == "sft"
    assert run.info.start_time <= t0 + 1000  # the run starts when the stage did, not when the server came back
    got = history(flaky.real, tracker.run_id, "train/loss")
    assert [s for s, _, _ in got] == [1, 2, 3, 4, 5, 6]
    assert got[0][2] <= got[4][2]  # original timestamps, not the delivery time
    ops = [r for r in records(fallback) if r["op"] not in ("done", "run_created")]
    done = {r["id"] for r in records(fallback) if r["op"] == "done"}
    assert ops and all(r["id"] in done for r in ops)  # every buffered call is marked delivered
    assert tracking.sync_fallback(fallback)["delivered"] == 0  # nothing left to upload
    reliability.add("tracking/fault-injected", calls_buffered=len(ops), delivered_after_outage=tracker.delivered_late,
                    lost=7 - tracker.delivered_late)


def test_killed_process_leaves_calls_that_sync_uploads_once(flaky, tmp_path, store, reliability):
    flaky.down = True
    fallback = tmp_path / "fb.jsonl"
    cfg = tracking.TrackingConfig(uri=store, experiment="killed", fallback_path=str(fallback), finish_wait_s=0)
    tracker = tracking.start_stage_run(cfg, "ppo", params={"lr": 0.1}, iteration=3)
    for step in range(4):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
    del tracker  # the pod is killed: no finish(), nothing in memory survives
    counts = tracking.sync_fallback(fallback)  # later, by `prmflow tracking-sync FILE`, with the server back
    assert counts == {"delivered": 6, "rejected": 0, "skipped": 0}  # create, params, 4 metric batches
    exp = flaky.real.get_experiment_by_name("killed")
    runs = flaky.real.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["prmflow.iteration"] == "3"
    assert [s for s, _, _ in history(flaky.real, runs[0].info.run_id, "train/loss")] == [0, 1, 2, 3]
    assert tracking.sync_fallback(fallback)["delivered"] == 0
    # a sync killed after creating the run but before recording it: the run is found again, not duplicated
    fallback.write_text("\n".join(line for line in fallback.read_text().splitlines()
                                  if json.loads(line)["op"] not in ("done", "run_created")) + "\n")
    assert tracking.sync_fallback(fallback)["delivered"] == 6
    assert len(flaky.real.search_runs([exp.experiment_id])) == 1
    assert len(history(flaky.real, runs[0].info.run_id, "train/loss")) == 4  # replayed points are not doubled
    reliability.add("tracking/fault-injected", synced_after_kill=6)


def test_finish_gives_up_after_the_bounded_wait_and_keeps_the_file(flaky, clock, tmp_path, store, caplog):
    flaky.down = True
    fallback = tmp_path / "fb.jsonl"
    cfg = tracking.TrackingConfig(uri=store, fallback_path=str(fallback), finish_wait_s=1.0)
    tracker = tracking.start_stage_run(cfg, "sft")
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    calls = flaky.calls
    with caplog.at_level(logging.WARNING):
        tracker.finish()
    assert sum(clock.slept) == pytest.approx(1.0)  # it waited finish_wait_s for the server, no longer
    assert flaky.calls - calls == len(clock.slept)  # and tried the server once after each wait
    assert f"tracking-sync {fallback}" in caplog.text
    assert {r["op"] for r in records(fallback)} >= {"create_run", "log_batch", "set_terminated"}


def test_a_call_the_server_refuses_is_dropped_not_retried_forever(flaky, tmp_path, store):
    flaky.refuse = {"bad"}
    cfg = tracking.TrackingConfig(uri=store, fallback_path=str(tmp_path / "fb.jsonl"), finish_wait_s=1)
    with tracking.start_stage_run(cfg, "sft", params={"bad": 1}) as tracker:
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        assert tracker.pending == 0
    assert history(flaky.real, tracker.run_id, "train/loss") and flaky.real.get_run(tracker.run_id).info.status == "FINISHED"


def test_unreachable_server_costs_little_and_mlflow_retries_are_off(tmp_path, monkeypatch, clock, connections):
    clean_http_env(monkeypatch)
    cfg = tracking.TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", fallback_path=str(tmp_path / "fb.jsonl"),
                                  finish_wait_s=0.5, http_timeout_s=3)
    attempts = []
    real_send = tracking.tracker.MlflowTracker._send
    monkeypatch.setattr(tracking.tracker.MlflowTracker, "_send", lambda self, op: (attempts.append(op["op"]),
                                                                                   real_send(self, op))[1])
    with tracking.start_stage_run(cfg, "sft", params={"a": 1}) as tracker:
        for step in range(20):
            tracker.log_metrics({"train/loss": 1.0}, step=step)
    # one refused connection per attempt (MLflow's default: 7 retries with backoff, minutes per call), and
    # attempts only at the start and once after finish's bounded wait: not one per logged metric
    assert attempts == ["create_run", "create_run"] and len(connections) == 2, (attempts, connections)
    assert sum(clock.slept) == pytest.approx(0.5)
    import os

    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "3"
    assert tracker.pending == 23


def test_preempted_stage_marks_its_run_killed(store):
    from prmflow.components.runtime.preemption import Preempted

    with pytest.raises(Preempted):
        with tracking.start_stage_run(tracking.TrackingConfig(uri=store), "sft") as tracker:
            raise Preempted("sft", 3)
    assert MlflowClient(store).get_run(tracker.run_id).info.status == "KILLED"


# --- a real MLflow server, killed mid-run -----------------------------------------------------------

SFT = {"num_prompts": 64, "eval_size": 4, "max_steps": 10, "micro_batch_size": 4, "optim.warmup_steps": 2,
       "eval_every": 5, "save_every": 2, "log_every": 1, "eval_max_new_tokens": 4, "max_seq_len": 64,
       "engine.backend": "torch"}


@pytest.mark.slow
def test_training_survives_a_real_mlflow_server_going_down_and_coming_back(mlflow_server, tmp_path, monkeypatch,
                                                                           reliability):
    server = mlflow_server
    server.kill()
    untracked = config.load(sft.Config, overrides={**SFT, "output": str(tmp_path / "untracked"), "tracking.enabled": False})
    sft.run(untracked)

    monkeypatch.setattr(tracking.tracker, "MAX_BACKOFF_S", 2.0)
    clean_http_env(monkeypatch)
    cfg = config.load(sft.Config, overrides={**SFT, "output": str(tmp_path / "out"), "tracking.uri": server.uri,
                                             "tracking.experiment": "outage", "tracking.finish_wait_s": 300})
    trackers, call_s, saves, steps = [], [], [], []
    real_start, real_step, real_save = tracking.start_stage_run, sft.TrainEngine.step, checkpoint.save

    def start(*a, **k):
        t = real_start(*a, **k)
        real_log = t.log_metrics

        def timed(*a, **k):
            started = time.perf_counter()
            real_log(*a, **k)
            call_s.append((len(steps), time.perf_counter() - started))
        t.log_metrics = timed
        trackers.append(t)
        return t

    def step(self):
        norm = real_step(self)
        steps.append(1)
        n, t = len(steps), trackers[0]
        if n == 2:
            server.start_async()  # the server was down when the stage started; it comes up now
        elif n == 4:
            server.wait_up()
        elif n == 6:  # by now the deferred run exists and everything so far was delivered...
            assert t.run_id and t.pending == 0, (t.run_id, t.pending)
            server.kill()  # ...then the server dies mid-run
        elif n == 8:
            server.start_async()
        return norm

    def save(*a, **k):
        saves.append(server.is_up())
        return real_save(*a, **k)

    monkeypatch.setattr(sft.tracking, "start_stage_run", start)
    monkeypatch.setattr(sft.TrainEngine, "step", step)
    monkeypatch.setattr(sft.checkpoint, "save", save)
    metrics = sft.run(cfg)

    tracker = trackers[0]
    assert tracker.pending == 0
    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["prmflow.stage"] == "sft"
    assert run.data.params["max_steps"] == "10"
    assert [s for s, _, _ in history(client, tracker.run_id, "train/loss")] == list(range(1, 11))  # nothing lost
    assert [s for s, _, _ in history(client, tracker.run_id, "sft/eval_accuracy")] == [5, 10]
    assert run.data.metrics["sft/eval_loss"] == pytest.approx(metrics["eval/loss"])
    assert False in saves  # checkpoints were written while the server was down
    during_outage = [s for n, s in call_s if 6 <= n < 8]  # between the kill and the restart
    assert during_outage and max(during_outage) < 1.0  # a down server costs a refused connection, not a stall
    a, b = load_file(str(tmp_path / "untracked" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all((a[n] == b[n]).all() for n in a)  # tracking trouble does not change training
    reliability.add("tracking/real-server", server_restarts=server.starts, metric_points_expected=12,
                    metric_points_arrived=len(history(client, tracker.run_id, "train/loss")) +
                    len(history(client, tracker.run_id, "sft/eval_accuracy")),
                    calls_delivered_late=tracker.delivered_late,
                    slowest_call_during_outage_s=round(max(during_outage), 3),
                    checkpoints_while_down=saves.count(False))


@pytest.mark.slow
def test_stage_with_tracking_down_throughout_then_sync(mlflow_server, tmp_path, monkeypatch, reliability):
    make_rollouts(tmp_path, prompts=8)
    dead = f"http://127.0.0.1:{free_port()}"
    clean_http_env(monkeypatch)
    cfg = advantage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "adv"), estimator="grpo",
                           tracking=tracking.TrackingConfig(uri=dead, experiment="later", finish_wait_s=0.5))
    summary = advantage.run(cfg)
    assert (tmp_path / "adv" / "manifest.json").is_file()  # the stage's work is done and committed regardless
    fallback = tmp_path / ".adv.tracking.jsonl"  # the default: beside the output
    assert fallback.is_file()
    with pytest.raises(tracking.TrackingUnavailable, match=str(fallback)):
        tracking.sync_fallback(fallback, dead)  # still down: a clear error, nothing marked

    if not mlflow_server.is_up():
        if mlflow_server.proc is None or mlflow_server.proc.poll() is not None:
            mlflow_server.start()
        mlflow_server.wait_up()
    counts = tracking.sync_fallback(fallback, mlflow_server.uri)
    assert counts["delivered"] >= 4 and counts["rejected"] == 0
    client = MlflowClient(mlflow_server.uri)
    run, = client.search_runs([client.get_experiment_by_name("later").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["estimator"] == "grpo"
    assert run.data.metrics["advantage/rows_out"] == summary["advantage/rows_out"]
    assert tracking.sync_fallback(fallback, mlflow_server.uri)["delivered"] == 0
    reliability.add("tracking/real-server", synced_later=counts["delivered"])


def test_sync_command_line(flaky, tmp_path, store, capsys, monkeypatch, reliability, connections):
    """`prmflow tracking-sync FILE` (cli.main) uploads a fallback file into a real SQLite MLflow store."""
    from prmflow import cli

    flaky.down = True
    fallback = tmp_path / "fb.jsonl"
    cfg = tracking.TrackingConfig(uri=store, experiment="cli", fallback_path=str(fallback), finish_wait_s=0)
    with tracking.start_stage_run(cfg, "sft", params={"lr": 0.5}) as tracker:
        for step in (1, 2):
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert tracker.run_id == ""  # nothing reached the store: it is all in the file
    untouched = tmp_path / "untouched.jsonl"
    untouched.write_bytes(fallback.read_bytes())
    flaky.down = False
    capsys.readouterr()
    assert cli.main(["tracking-sync", str(fallback)]) == 0
    # create_run, params, 2 metric batches, set_terminated
    assert "5 call(s) delivered, 0 refused by the server, 0 already delivered" in capsys.readouterr().out
    client = MlflowClient(store)
    run, = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.5"}
    assert [s for s, _, _ in history(client, run.info.run_id, "train/loss")] == [1, 2]
    assert cli.main(["tracking-sync", str(fallback)]) == 0  # again: nothing is sent twice
    assert "0 call(s) delivered" in capsys.readouterr().out
    assert len(history(client, run.info.run_id, "train/loss")) == 2
    # a missing file or an unreachable server: one clear line, exit 2, no traceback
    assert cli.main(["tracking-sync", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl' does not exist" in err and "Traceback" not in err
    clean_http_env(monkeypatch)
    assert cli.main(["tracking-sync", str(untouched), "--uri", f"http://127.0.0.1:{free_port()}"]) == 2
    assert len(connections) == 1  # one refused connection, then it stops: no MLflow retry storm against a dead server
    err = capsys.readouterr().err
    assert "untouched.jsonl" in err and "run the same command again" in err and "Traceback" not in err
    # no --uri: each call goes where it was meant to go, here a server that is still down
    flaky.down = True
    meant = tmp_path / "meant.jsonl"
    dead = tracking.TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", experiment="cli", fallback_path=str(meant),
                                   finish_wait_s=0)
    with tracking.start_stage_run(dead, "sft") as tracker:
        tracker.log_metrics({"train/loss": 1.0}, step=1)
    clean_http_env(monkeypatch)
    connections.clear()
    assert cli.main(["tracking-sync", str(meant)]) == 2
    assert len(connections) == 1
    err = capsys.readouterr().err
    assert dead.uri in err and "meant.jsonl" in err and "Traceback" not in err
    reliability.add("tracking/cli-sync", calls_uploaded_by_command=5)
