"""Tracking inputs a user can get wrong: one clear line naming the path and what to do, exit 2, no traceback."""

from __future__ import annotations

import json

import pytest

from prmflow import cli


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
