"""A committed output is readable by the other users the umask allows, as mkdir and open would make it:
a container running as another uid (`docker run --user 1000` on outputs written by root, the CI case)
reads its inputs through those bits. The container test shows the failure end to end; this one runs
everywhere."""

import stat

import pytest

from prmflow.components.data import io


def test_committed_output_has_the_umask_modes_not_the_temporary_ones(tmp_path):
    if io.UMASK & 0o055:
        pytest.skip(f"this process's umask {io.UMASK:03o} keeps outputs from other users anyway")
    with io.atomic_output_dir(tmp_path / "advantages", "advantages") as d:
        (d / "part-00000.parquet").write_bytes(b"x")
    out = tmp_path / "advantages"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~io.UMASK           # not mkdtemp's 0700
    assert stat.S_IMODE((out / io.MANIFEST).stat().st_mode) == 0o666 & ~io.UMASK  # not mkstemp's 0600
