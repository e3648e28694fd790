"""Tracking inputs a user can get wrong: one clear line naming the path and what to do, exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prmflow import cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _stage_output(root):
    """A committed stage output as a user sees it: shards and a manifest, and no tracking file (MLflow missed nothing)."""
    out = root / "outputs" / "sft"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"schema_version": 1, "rows": 0}, indent=2))
    (out / "part-00000.parquet").write_bytes(b"PAR1\x00\x00PAR1")
    return out


def _missing(root):
    return root / "outputs" / ".sft.tracking.jsonl"


def _empty_dir(root):
    (root / "empty").mkdir()
    return root / "empty"


def _not_a_fallback_file(root):
    return _stage_output(root) / "manifest.json"


def _output_with_fallback_beside(root):
    out = _stage_output(root)
    (out.parent / ".sft.tracking.jsonl").write_text(json.dumps({"op": "create_run", "key": "k", "id": "1"}) + "\n")
    return out


CASES = {  # what the user passed -> what the one line must say besides the path
    "a file that does not exist": (_missing, ["does not exist", "'.<output>.tracking.jsonl'"]),
    "an empty directory": (_empty_dir, ["is a directory", "nothing to upload"]),
    "a run output with no tracking data": (_stage_output, ["is a directory", "nothing to upload"]),
    "a file that is not a fallback file": (_not_a_fallback_file, ["is not a tracking fallback file", "Pass the"]),
    "a stage output whose fallback file sits beside it": (_output_with_fallback_beside,
                                                          ["is a directory", "pass '{root}/outputs/.sft.tracking.jsonl'"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tracking_sync_refuses_what_is_not_a_fallback_file(case, tmp_path, capsys):
    make, says = CASES[case]
    path = make(tmp_path)
    capsys.readouterr()
    assert cli.main(["tracking-sync", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prmflow tracking-sync: error: "), err  # one line
    assert f"'{path}'" in err and "Traceback" not in err
    for said in says:
        assert said.format(root=tmp_path) in err, err


def test_a_fallback_file_that_opens_with_a_torn_line_is_still_one(tmp_path):
    """A kill mid-write leaves a line without its end; the next run's append finishes that line, then writes whole
    ones. The file is still a fallback file (FallbackLog.read skips the torn line)."""
    from prmflow.tracking.sync import check_fallback_file

    fallback = tmp_path / ".sft.tracking.jsonl"
    whole = json.dumps({"op": "create_run", "key": "k", "id": "1"})
    fallback.write_text(whole[:12] + whole + "\n" + whole.replace('"1"', '"2"') + "\n")
    assert check_fallback_file(fallback) == fallback


# A sqlite tracking URI with a typo: MLflow would create the store (and its directories), silently empty.

def test_reading_runs_from_a_sqlite_store_that_does_not_exist_is_refused(tmp_path, monkeypatch, capsys):
    """stage-command reads a logged run: a typo (mlrun.db for mlruns.db) names the store files that do exist."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "mlruns.db").write_bytes(b"")
    assert cli.main(["stage-command", "advantage", "--run-id", "0" * 32, "--tracking-uri", "sqlite:///outputs/mlrun.db",
                     "--no-container", "--output", str(tmp_path / "rerun")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tracking-uri 'sqlite:///outputs/mlrun.db'" in err, err
    assert f"no MLflow store at '{tmp_path / 'outputs' / 'mlrun.db'}'" in err and "mlruns.db" in err, err
    assert not (tmp_path / "outputs" / "mlrun.db").exists()  # no empty store left behind


def test_syncing_into_a_sqlite_store_that_does_not_exist_is_refused(tmp_path, capsys):
    fallback = tmp_path / ".sft.tracking.jsonl"
    fallback.write_text(json.dumps({"op": "create_run", "key": "k", "id": "1", "experiment": "e"}) + "\n")
    assert cli.main(["tracking-sync", str(fallback), "--uri", f"sqlite:///{tmp_path / 'mlrun.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--uri" in err and "no MLflow store at" in err and "--create-store" in err, err
    assert not (tmp_path / "mlrun.db").exists()
    assert "done" not in fallback.read_text()  # nothing marked delivered


@pytest.mark.parametrize("command", ["stage", "run-local", "stage-command", "tracking-sync"])
def test_a_sqlite_store_in_a_directory_that_does_not_exist_is_refused_everywhere(command, tmp_path, capsys):
    from prmflow import tracking
    from prmflow.errors import ConfigError

    uri = f"sqlite:///{tmp_path / 'outptus' / 'mlflow.db'}"
    if command == "stage":  # a stage's own run (the write path): before any work
        with pytest.raises(ConfigError) as refused:
            tracking.start_stage_run(tracking.TrackingConfig(uri=uri), "sft", params={"output": str(tmp_path / "o")})
        err = f"prmflow sft: error: {refused.value}\n"
        assert "tracking.uri" in err
    elif command == "run-local":  # refused before kfp.local starts a task (whose traceback would be buried in its log)
        root = tmp_path / "kfp"
        assert cli.main(["pipeline", "run-local", "--config", str(CONFIGS / "quickstart.yaml"), "--root", str(root),
                         "--param", f"tracking_uri={uri}"]) == 2
        err = capsys.readouterr().err
        assert "tracking_uri" in err and not root.exists()
    elif command == "stage-command":
        assert cli.main(["stage-command", "sft", "--run-id", "0" * 32, "--tracking-uri", uri, "--no-container",
                         "--output", str(tmp_path / "rerun")]) == 2
        err = capsys.readouterr().err
    else:
        fallback = tmp_path / "fb.jsonl"
        fallback.write_text(json.dumps({"op": "create_run", "key": "k", "id": "1", "uri": uri}) + "\n")
        assert cli.main(["tracking-sync", str(fallback)]) == 2
        err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the directory '{tmp_path / 'outptus'}' does not exist" in err, err
    assert "Traceback" not in err and not (tmp_path / "outptus").exists()  # MLflow was not asked to make it



# The first-run path (a stage creating its store in a directory that exists, as the quickstart does on a fresh
# checkout) is what tests/tracking/test_tracking.py does with its `sqlite_store` fixture: a file not made yet.


def test_an_empty_fallback_file_left_by_a_kill_is_nothing_to_upload(tmp_path, capsys):
    """A stage killed before it recorded its first undelivered call leaves an empty `.<output>.tracking.jsonl`
    (the stage's own next run passes over it quietly). `prmflow tracking-sync` on it, as docs/mlflow.md says to
    run, exited 2 telling the user to "pass the fallback file a stage writes", the file they had passed. Now:
    one line saying it is empty, exit 0, and no store made."""
    fallback = tmp_path / "outputs" / ".sft.tracking.jsonl"
    fallback.parent.mkdir()
    fallback.touch()
    store = tmp_path / "mlflow.db"
    assert cli.main(["tracking-sync", str(fallback), "--uri", f"sqlite:///{store}"]) == 0
    out, err = capsys.readouterr()
    assert out == (f"tracking-sync {fallback}: the file is empty (its stage stopped before MLflow missed a call); "
                   "nothing to upload\n")
    assert err == "" and not store.exists() and fallback.read_bytes() == b""


def test_an_unreachable_server_is_reported_with_its_cause():
    """MLflow's error for a server that refuses connections names the cause last, after the URL and urllib3's
    retry text; cut at 300 characters, the outage warning and tracking-sync's error ended mid-word
    ("HTTPConnection(host='127.0.0.1', ).") without saying why. The cut keeps the start and the cause, marked."""
    from prmflow.tracking.delivery import short_error

    message = ("API request to http://127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name failed with exception "
               "HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded with url: /api/2.0/mlflow/"
               "experiments/get-by-name?experiment_name=prmflow (Caused by NewConnectionError(\"HTTPConnection(host="
               "'127.0.0.1', port=9): Failed to establish a new connection: [Errno 111] Connection refused\"))")
    shown = short_error(RuntimeError(message + "\nthe response body"))
    assert len(message) > 300 and len(shown) <= 300
    assert shown.startswith("API request to http://127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name failed")
    assert "[Errno 111] Connection refused" in shown and " ... " in shown and "response body" not in shown
    assert short_error(RuntimeError("short\nmore")) == "short" and short_error(RuntimeError()) == "RuntimeError"
