"""What a stage may do to the place it writes: `--overwrite` replaces only what prmflow wrote, a place
that cannot be written is refused before any model loads, and every file of an output gets one mode.

Each stage is run through the `prmflow` command, as a user runs it, with the smallest inputs that get it
to the point where it decides about its output.
"""

from __future__ import annotations

import os
import stat

import pyarrow as pa
import pytest

from prmflow import cli, stages
from prmflow.components.data import io, schema
from prmflow.components.models import modeling
from prmflow.errors import OutputExistsError


def _handoff(path, kind: str) -> str:
    """A committed hand-off with the required columns only: enough for a stage to open its input."""
    rows = [{"prompt_id": f"p{i // 2}", "sample_idx": i % 2, "iteration": 0, "response_ids": [1, 2, 3]} for i in range(4)]
    schema.write_dataset(path, pa.Table.from_pylist(rows), kind)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("model") / "tiny"
    assert cli.main(["make-tiny-model", str(out)]) == 0
    return str(out)


def _stage_args(stage: str, inputs, model: str) -> list[str]:
    if stage == "advantage":
        return ["--input", _handoff(inputs / "rollouts", "rollouts")]
    if stage == "prm-update":
        return ["--input", _handoff(inputs / "rollouts", "rollouts"), "--prm", model, "--implicit_beta", "0.05"]
    if stage == "ppo":
        return ["--input", _handoff(inputs / "advantages", "advantages"), "--policy", model]
    if stage == "evaluate":
        return ["--policy", model]
    return []  # sft, prm, prm-label, rollout: the built-in task and the tiny preset


#: Every stage of the registry: a stage added there is checked here too (its inputs: `_stage_args`).
STAGES = list(stages.STAGES)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model (or its tokenizer) fails the test: the refusals below must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output location was checked")
    for name in ("load_causal_lm", "load_tokenizer"):
        monkeypatch.setattr(modeling, name, refuse)


def _tree(root) -> dict[str, bytes | None]:
    return {os.path.relpath(os.path.join(d, n), root): (open(os.path.join(d, n), "rb").read() if n in f else None)
            for d, sub, f in os.walk(root) for n in [*sub, *f]}


@pytest.mark.parametrize("what", ["file", "directory"])
@pytest.mark.parametrize("stage", STAGES)
def test_overwrite_never_replaces_what_prmflow_did_not_write(stage, what, tmp_path, capsys, tiny_model, no_model_loads):
    """`--output notes.txt --overwrite true` on a user's own file (or folder of files) is refused by
    name, in every stage, and nothing at all changes on disk."""
    work = tmp_path / "work"
    work.mkdir()
    if what == "file":
        (work / "notes.txt").write_text("my notes\n")
    else:
        (work / "notes.txt").mkdir()
        (work / "notes.txt" / "thesis.tex").write_text("chapter 1\n")
    args = _stage_args(stage, tmp_path, tiny_model)
    before = _tree(work)
    code = cli.main([stage, "--output", str(work / "notes.txt"), "--overwrite", "true", *args,
                     "--tracking.enabled", "false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"'{work / 'notes.txt'}' already exists" in err and "not an output prmflow wrote" in err, err
    assert "--overwrite true to replace" not in err  # no advice that would delete it
    assert _tree(work) == before


@pytest.mark.parametrize("stage", STAGES)
def test_an_output_under_a_file_is_refused_before_any_model_loads(stage, tmp_path, capsys, tiny_model, no_model_loads):
    """`--output outfile/run` where outfile is a file: the stage says so at once, not after training
    (the issue's sft trained 2:56 and then died with a FileExistsError traceback)."""
    (tmp_path / "outfile").write_text("x")
    code = cli.main([stage, "--output", str(tmp_path / "outfile" / "run"), *_stage_args(stage, tmp_path, tiny_model),
                     "--tracking.enabled", "false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"'{tmp_path / 'outfile'}' is a file, not a directory" in err, err
    assert (tmp_path / "outfile").read_text() == "x"


def test_a_resume_location_that_is_a_file_is_refused_before_any_model_loads(tmp_path, capsys, no_model_loads):
    (tmp_path / ".sft.work").write_text("x")
    assert cli.main(["sft", "--output", str(tmp_path / "sft"), "--tracking.enabled", "false"]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / '.sft.work'}', where the resume checkpoint" in err and "is not a directory" in err, err
    assert (tmp_path / ".sft.work").read_text() == "x"


def test_overwrite_replaces_prmflow_outputs_and_empty_directories(tmp_path):
    """What --overwrite is for still works: a result of ours is replaced, and so is an empty folder."""
    ours, empty = tmp_path / "ours", tmp_path / "empty"
    with io.atomic_output_dir(ours, "policy") as tmp:
        (tmp / "a.txt").write_text("old")
    empty.mkdir()
    for out in (ours, empty):
        with io.atomic_output_dir(out, "policy", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("new")
        assert (out / "a.txt").read_text() == "new" and io.read_manifest(out)["kind"] == "policy"


def test_overwrite_keeps_an_output_of_ours_that_a_user_put_files_into(tmp_path, capsys):
    """A user keeps notes (or a copy of something) inside an output prmflow wrote; a later run with another
    config and --overwrite true replaced the directory and deleted them."""
    with schema.DatasetWriter(tmp_path / "rollouts", "rollouts") as w:
        w.write(pa.Table.from_pylist([{"prompt_id": "p0", "sample_idx": i, "iteration": 0, "response_ids": [1, 2],
                                       "outcome_reward": float(i)} for i in range(2)]))
    out = tmp_path / "advantages"
    argv = ["advantage", "--input", str(tmp_path / "rollouts"), "--output", str(out), "--estimator", "grpo",
            "--tracking.enabled", "false", "--overwrite", "true"]
    assert cli.main(argv) == 0
    (out / "notes.txt").write_text("mine")
    assert cli.main([*argv, "--gamma", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"output '{out}' already exists and is a prmflow output holding files prmflow did not write there (notes.txt)" in err
    assert (out / "notes.txt").read_text() == "mine" and io.read_manifest(out)["config"]["gamma"] == 1.0
    (out / "notes.txt").unlink()  # as prmflow wrote it again: replaced
    assert cli.main([*argv, "--gamma", "0.5"]) == 0 and io.read_manifest(out)["config"]["gamma"] == 0.5


def test_a_foreign_file_put_there_while_the_stage_worked_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="not an output prmflow wrote"):
        with io.atomic_output_dir(out, "policy", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("ours")
            out.write_text("theirs")  # appeared during the run
    assert out.read_text() == "theirs" and not list(tmp_path.glob(".out.tmp-*"))


def test_every_file_of_an_output_gets_the_mode_open_gives(tmp_path):
    """safetensors' save_file writes 0600; in a committed output every file has the mode of the rest
    (0666 less the umask), so a model shared with a group or copied into an image is readable."""
    from safetensors.torch import save_file
    import torch

    with io.atomic_output_dir(tmp_path / "model", "policy") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
    files = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "model").iterdir()}
    assert files["model.safetensors"] == files["config.json"] == files[io.MANIFEST] == 0o666 & ~io.UMASK, files
    assert files["sub"] == stat.S_IMODE(os.stat(tmp_path / "model").st_mode) == 0o777 & ~io.UMASK


def test_run_local_refuses_a_root_that_is_a_file(tmp_path, capsys):
    """`pipeline run-local --root notes.txt`: one line naming it, before kfp.local makes anything there
    (it used to end in a FileExistsError traceback); the file is untouched."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert cli.main(["pipeline", "run-local", "--root", str(notes)]) == 2
    err = capsys.readouterr().err
    assert f"--root '{notes}' is a file, not a directory" in err, err
    assert notes.read_text() == "my notes\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_an_output_starting_with_a_tilde_is_refused_not_made_as_a_folder_named_tilde(tmp_path, monkeypatch, capsys):
    """`output: ~/outputs/adv` in a YAML file (or --set output=~/...) is not expanded by any shell: the stage made
    a folder named '~' in the working directory, wrote its temporary into the real home (pyarrow expands '~'),
    and died in a FileNotFoundError traceback. A later `rm -rf ~` to clean up would be a disaster."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    with schema.DatasetWriter(tmp_path / "rollouts", "rollouts") as w:
        w.write(pa.Table.from_pylist([{"prompt_id": "p0", "sample_idx": i, "iteration": 0, "response_ids": [1, 2],
                                       "outcome_reward": float(i)} for i in range(2)]))
    assert cli.main(["advantage", "--input", str(tmp_path / "rollouts"), "--estimator", "grpo", "--tracking.enabled", "false",
                     "--set", "output=~/adv"]) == 2
    err = capsys.readouterr().err
    assert "output '~/adv' starts with '~', which only a shell expands" in err and f"e.g. '{home / 'adv'}'" in err
    assert list(work.iterdir()) == [] and list(home.iterdir()) == []
