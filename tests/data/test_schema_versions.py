"""The rollouts contract across versions, against the real previous reader and writer.

Version 2 (multi-turn episodes) adds `policy_mask`. The version-1 prmflow (the commit before it, taken
from git history and run in a subprocess) must refuse a version-2 file with a message naming the
version, and this prmflow must still read what version 1 wrote, every token the policy's."""

import subprocess
import sys
import tarfile
import io
from pathlib import Path

import pyarrow as pa
import pytest

from prmflow.components.data import schema
from prmflow.errors import DataError

REPO = Path(__file__).resolve().parents[2]
VERSION_1 = "f64bf3b6374ac2f8fb01b8e1a55a0a460f802766"  # the last commit whose data/schema.py writes version 1


@pytest.fixture(scope="module")
def version_1(tmp_path_factory) -> Path:
    """The version-1 `prmflow` package, extracted from git history."""
    try:
        blob = subprocess.run(["git", "-C", str(REPO), "archive", VERSION_1, "prmflow"], capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs the git history of the checkout (commit {VERSION_1[:10]}): {e}")
    root = tmp_path_factory.mktemp("v1")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(root)
    return root


def _run_v1(root: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_version_1_reader_refuses_a_version_2_file_naming_the_version(tmp_path, version_1):
    out = tmp_path / "rollouts"
    schema.write_dataset(out, pa.Table.from_pylist([{
        "prompt_id": "p", "sample_idx": 0, "iteration": 0, "response_ids": [1, 2, 3, 4], "policy_mask": [1, 0, 0, 1],
        "step_ends": [0, 3], "step_rewards": [1.0, 0.0], "outcome_reward": 1.0}]), "rollouts")
    got = _run_v1(version_1, "from prmflow.components.data import schema\n"
                             f"assert schema.SCHEMA_VERSION == 1\nschema.read_dataset({str(out)!r}, 'rollouts')")
    assert got.returncode != 0
    assert "DataError" in got.stderr and "schema version 2" in got.stderr and "reads version 1" in got.stderr


def test_a_version_1_file_still_reads_every_token_the_policys(tmp_path, version_1):
    out = tmp_path / "rollouts"
    got = _run_v1(version_1, "import pyarrow as pa\nfrom prmflow.components.data import schema\n"
                             "schema.write_dataset(" + repr(str(out)) + ", pa.Table.from_pylist([{'prompt_id': 'p', "
                             "'sample_idx': 0, 'iteration': 0, 'response_ids': [1, 2, 3], 'step_ends': [2], "
                             "'step_rewards': [0.5], 'outcome_reward': 1.0}]), 'rollouts')")
    assert got.returncode == 0, got.stderr
    row, = schema.read_dataset(out, "rollouts").to_pylist()
    assert schema.open_dataset(out, "rollouts").manifests[0]["schema_version"] == 1
    assert row["response_ids"] == [1, 2, 3] and row["policy_mask"] is None  # null: every token the policy's


def test_a_version_this_prmflow_does_not_know_is_refused(tmp_path):
    out = tmp_path / "rollouts"
    schema.write_dataset(out, pa.Table.from_pylist([{"prompt_id": "p", "sample_idx": 0, "iteration": 0,
                                                     "response_ids": [1]}]), "rollouts")
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"schema_version": 2', '"schema_version": 3'))
    with pytest.raises(DataError, match="schema version 3, this prmflow reads version"):
        schema.open_dataset(out, "rollouts", verify_checksums=False)


def test_a_step_end_on_an_environment_token_is_refused(tmp_path):
    rows = [{"prompt_id": "p", "sample_idx": 0, "iteration": 0, "response_ids": [1, 2, 3], "policy_mask": [1, 0, 1],
             "step_ends": [1, 2], "step_rewards": [0.5, 0.5]}]
    with pytest.raises(DataError, match="'step_ends' points at an environment token .*prompt_id='p'"):
        schema.write_dataset(tmp_path / "r", pa.Table.from_pylist(rows), "rollouts")
    rows[0].update(policy_mask=[1, 2, 1], step_ends=[0, 2])
    with pytest.raises(DataError, match="'policy_mask' holds 2"):
        schema.write_dataset(tmp_path / "r", pa.Table.from_pylist(rows), "rollouts")
