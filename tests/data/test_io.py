import json

import pytest

from prmflow.components.data import io
from prmflow.errors import DataError, OutputExistsError


def test_commit_writes_manifest_with_checksums(tmp_path):
    out = tmp_path / "out"
    with io.atomic_output_dir(out, "thing", manifest={"rows": 3}) as tmp:
        (tmp / "a.txt").write_text("hello")
        assert not out.exists()  # nothing visible before the commit
    m = io.read_manifest(out)
    assert m["kind"] == "thing" and m["rows"] == 3
    assert m["files"] == {"a.txt": io.sha256_file(out / "a.txt")}
    io.verify_files(out, m)


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with io.atomic_output_dir(out, "thing") as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("crash")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_replaced_silently(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        with io.atomic_output_dir(out, "thing"):
            pass


def test_tampered_file_is_detected(tmp_path):
    out = tmp_path / "out"
    with io.atomic_output_dir(out, "thing") as tmp:
        (tmp / "a.txt").write_text("hello")
    (out / "a.txt").write_text("hellO")
    with pytest.raises(DataError, match="does not match the sha256"):
        io.verify_files(out, io.read_manifest(out))


def test_names_cannot_escape(tmp_path):
    with pytest.raises(DataError, match="escape"):
        io.safe_child(tmp_path, "../etc/passwd")
    assert io.safe_child(tmp_path, "sub/file") == (tmp_path / "sub/file").resolve()


def test_missing_or_broken_manifest(tmp_path):
    with pytest.raises(DataError, match="no manifest.json"):
        io.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(DataError, match="not valid JSON"):
        io.read_manifest(tmp_path)


def test_stale_temporaries_are_cleaned(tmp_path):
    stale = tmp_path / ".out.tmp-abc"
    stale.mkdir()
    with io.atomic_output_dir(tmp_path / "out", "thing") as tmp:
        (tmp / "x").write_text("1")
    assert not stale.exists()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["kind"] == "thing"


def test_finished_output_decides_what_a_stage_does_with_an_existing_output(tmp_path, capsys):
    """The one "already complete?" check every stage makes (io.finished_output)."""
    out, data = tmp_path / "out", tmp_path / "data.jsonl"
    data.write_text('{"x": 1}\n')
    config = {"lr": 0.1, "output": str(out), "tracking": {"uri": "a"}}
    inputs = io.input_fingerprints([str(data), "", "tiny-llama"])  # a file counts; an empty path and a name do not
    assert inputs == {str(data): io.fingerprint_files({"data.jsonl": io.sha256_file(data)})}
    assert io.finished_output("sft", out, config, overwrite=False, inputs=inputs) is None  # nothing there: start
    with io.atomic_output_dir(out, "thing", manifest={"config": config, "inputs": inputs, "metrics": {"m": 1.0}}):
        pass
    work = io.work_dir_for(out)
    work.mkdir()  # a resume checkpoint left by a kill between the commit and its cleanup
    capsys.readouterr()
    same = {**config, "tracking": {"uri": "b"}}  # tracking settings do not change the result
    done = io.finished_output("sft", out, same, overwrite=False, inputs=inputs)
    assert done["metrics"] == {"m": 1.0} and not work.exists()
    assert capsys.readouterr().out == f"sft: '{out}' is already complete for this config and these inputs; nothing to do.\n"
    with pytest.raises(OutputExistsError, match=r"sft: output '.*' already exists, but it does not match this run "
                                                r"\(different config\)\. Pass --overwrite true"):
        io.finished_output("sft", out, {**config, "lr": 0.2}, overwrite=False, inputs=inputs)
    data.write_text('{"x": 2}\n')
    with pytest.raises(OutputExistsError, match=r"\(different inputs\)"):
        io.finished_output("sft", out, config, overwrite=False, inputs=io.input_fingerprints([str(data)]))
    assert io.finished_output("sft", out, {**config, "lr": 0.2}, overwrite=True, inputs=inputs) is None  # replace it
    with pytest.raises(OutputExistsError, match=r"\(different kl_coef_used\)"):  # what else the stage records
        io.finished_output("advantage", out, config, overwrite=False, inputs=inputs, kl_coef_used=0.5)


def test_a_second_writer_of_one_output_is_refused_and_the_first_is_left_to_finish(tmp_path, capsys):
    """`prmflow advantage ... --output adv` started twice: the second run swept the first one's temporary
    directory away as a crash's leftover, and the first died in a FileNotFoundError traceback. Here another
    process is inside its atomic_output_dir; this one's command, then its own atomic write, are refused."""
    import subprocess
    import sys

    import pyarrow as pa

    from prmflow import cli
    from prmflow.components.data import schema

    with schema.DatasetWriter(tmp_path / "rollouts", "rollouts") as w:
        w.write(pa.Table.from_pylist([{"prompt_id": "p0", "sample_idx": i, "iteration": 0, "response_ids": [1, 2],
                                       "outcome_reward": float(i)} for i in range(2)]))
    out = tmp_path / "adv"
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from prmflow.components.data import io\n"
         "with io.atomic_output_dir(sys.argv[1], 'advantages') as tmp:\n"
         "    (tmp / 'part-00000.parquet').write_text('first'); print(tmp.name, flush=True); sys.stdin.readline()",
         str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first_tmp = tmp_path / first.stdout.readline().strip()
        assert first_tmp.is_dir()
        assert cli.main(["advantage", "--input", str(tmp_path / "rollouts"), "--output", str(out), "--estimator", "grpo",
                         "--tracking.enabled", "false"]) == 2
        assert f"another process (pid {first.pid}) is writing '{out}' now" in capsys.readouterr().err
        with pytest.raises(OutputExistsError, match="another process"):
            with io.atomic_output_dir(out, "advantages", overwrite=True):
                raise AssertionError("the block must not run")
        assert first_tmp.is_dir() and not out.exists()
    finally:
        first.communicate("\n", timeout=30)
    assert first.returncode == 0 and (out / "part-00000.parquet").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adv", "rollouts"]  # no lock file left
