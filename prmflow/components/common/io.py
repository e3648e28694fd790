"""Atomic directory outputs with a manifest.

A stage never writes into its output path directly. It writes into a hidden temporary sibling
(`.NAME.tmp-XXXX`) and renames it into place only when everything, `manifest.json` last, is on disk.
A reader that finds `manifest.json` therefore finds a complete result; a crash leaves at most a
temporary sibling, which the next run removes. The manifest records what was written (sha256 of
every file), by which config, from which parents: the lineage that MLflow links to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError, OutputExistsError

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def safe_child(directory: Path, name: str) -> Path:
    """`directory/name`, refusing names that would escape `directory` (../, absolute paths)."""
    directory = Path(directory).resolve()
    candidate = (directory / name).resolve()
    if candidate != directory and directory not in candidate.parents:
        raise DataError(f"'{name}' would escape the directory '{directory}'; file names must stay inside it.")
    return candidate


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a committed output directory, or a DataError saying what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"'{directory}' has no {MANIFEST}: it is not a finished prmflow output (a crashed or "
            f"still-running stage leaves none). Re-run the stage that writes it."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"'{path}' is not valid JSON ({e}). Re-run the stage that wrote it.") from None
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise DataError(f"'{path}' is not a prmflow manifest (no 'files' entry). Re-run the stage that wrote it.")
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Check that every file the manifest lists exists with its recorded sha256."""
    for name, digest in manifest["files"].items():
        path = safe_child(Path(directory), name)
        if not path.is_file():
            raise DataError(f"'{path}' is listed in the manifest of '{directory}' but missing.")
        if sha256_file(path) != digest:
            raise DataError(f"'{path}' does not match the sha256 in its manifest: the file was changed or truncated.")


def build_manifest(directory: Path, kind: str, **extra: Any) -> dict[str, Any]:
    from prmflow import __version__

    files = {}
    for p in sorted(Path(directory).rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(directory).as_posix()] = sha256_file(p)
    return {"kind": kind, "files": files, "created_at": time.time(), "prmflow_version": __version__, **extra}


def clean_stale_temporaries(path: Path) -> None:
    """Remove temporaries left next to `path` by a crashed earlier run."""
    path = Path(path)
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, kind: str, overwrite: bool = False,
                      manifest: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temporary directory; on success write its manifest and rename it to `path`.

    On any exception the temporary directory is removed and `path` is left as it was. `manifest`
    holds extra manifest entries; the caller may keep adding to it until the block ends.
    """
    manifest_extra = manifest if manifest is not None else {}
    path = Path(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(
            f"Output '{path}' already exists. Choose another output path, delete it, or pass overwrite."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        write_json_atomic(tmp / MANIFEST, build_manifest(tmp, kind, **manifest_extra))
        _fsync_dir(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.tmp-old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
