"""Atomic directory outputs with a manifest.

A stage never writes into its output path directly. It writes into a hidden temporary sibling
(`.NAME.tmp-XXXX`) and renames it into place only when everything, `manifest.json` last, is on disk.
A reader that finds `manifest.json` therefore finds a complete result; a crash leaves at most a
temporary sibling, which the next run removes. The manifest records what was written (sha256 of
every file), by which config, from which parents: the lineage that MLflow links to.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ..runtime import distributed
from ...errors import ConfigError, DataError, OutputExistsError

MANIFEST = "manifest.json"
# The process umask, read once at import (os.umask can only be read by setting it): outputs made through
# temporary files and directories get the modes open() and mkdir() would give them.
UMASK = os.umask(0o022)
os.umask(UMASK)

#: Config keys that may change between a run and its resume or re-run without changing the result.
NOT_IDENTITY = ("tracking", "resume", "overwrite")


def config_identity(config: dict) -> dict:
    """The part of a config that decides the result, normalized through JSON (tuples -> lists)."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_IDENTITY}, default=str, sort_keys=True))


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
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp's 0600 would hide the file from other readers
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
    """`directory/name`, refusing names that would escape `directory` (../, absolute paths, symlinks out)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise DataError(f"{name!r} is not a valid file name inside '{directory}'.")
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
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise DataError(f"'{path}' is not valid JSON ({e}). Re-run the stage that wrote it.") from None
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise DataError(f"'{path}' is not a prmflow manifest (no 'files' entry). Re-run the stage that wrote it.")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise DataError(f"'{path}': field 'files' must map file names to sha256 strings. Re-run the stage that wrote it.")
    rows = manifest.get("rows", 0)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise DataError(f"'{path}': field 'rows' is {rows!r}, not a row count. Re-run the stage that wrote it.")
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


def give_default_modes(directory: Path) -> None:
    """Give every file under `directory` the mode open() gives (0666 less the umask, execute bits kept)
    and every directory the mode mkdir gives. Some writers make their files private: safetensors'
    save_file writes 0600, so a model directory shared with a group or copied into an image would be
    unreadable to every other user while the rest of the output is not.

    A hard-linked file (`link_or_copy_tree`) is shared with where it came from, which may be a user's
    own model directory: its mode is left as it is."""
    for p in [Path(directory), *Path(directory).rglob("*")]:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            continue
        mode = st.st_mode & 0o7777
        want = (0o777 if stat.S_ISDIR(st.st_mode) else 0o666 | (mode & 0o111)) & ~UMASK
        if mode != want:
            os.chmod(p, want)


def link_or_copy_tree(src: str | Path, dst: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Every file under `src` at the same place under `dst`, hard-linked (no bytes written) where the
    filesystem allows, else copied; names in `skip` are left out. For files that are never changed in
    place: a committed output's."""
    src, dst = Path(src), Path(dst)
    for f in sorted(src.rglob("*")):
        if f.is_file() and f.name not in skip:
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def recover_interrupted_replace(path: Path) -> bool:
    """Put back a committed `path` that a crash left moved aside mid-replace; True if it did.

    Replacing an existing output takes two renames (old aside, new in). A process killed between
    them leaves no `path` but a complete `.NAME.tmp-old-PID` sibling: that previous result (e.g. the
    last resume checkpoint) is still good, so it is restored rather than swept away as a temporary.
    """
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return False
    for old in sorted(path.parent.glob(f".{path.name}.tmp-old-*")):
        if (old / MANIFEST).is_file():
            os.replace(old, path)
            _fsync_dir(path.parent)
            return True
    return False


def clean_stale_temporaries(path: Path) -> None:
    """Remove temporaries left next to `path` by a crashed earlier run (after recovering a moved-aside result)."""
    path = Path(path)
    if path.parent.is_dir():
        recover_interrupted_replace(path)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


def fingerprint_files(files: dict[str, str]) -> str:
    """sha256 over a {relative path: sha256} map: the fingerprint of a manifest listing these files."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def fingerprint(directories) -> dict[str, str]:
    """{directory: sha256 of its manifest's file digests} for committed inputs: what a re-run compares.

    Cheap (no data is read) and exact: the manifest's per-file sha256 already pins every byte. A
    plain Parquet file or directory (no manifest; what schema.open_plain accepts) is hashed instead.
    """
    out = {}
    for d in directories:
        d = Path(d)
        if d.is_file() or (d.is_dir() and not (d / MANIFEST).exists() and any(d.glob("*.parquet"))):
            # plain Parquet from another tool (schema.open_plain): no digests recorded, so hash the bytes
            shards = [d] if d.is_file() else sorted(d.glob("*.parquet"))
            files = {p.name: sha256_file(p) for p in shards}
        else:
            files = read_manifest(d)["files"]
        out[str(d)] = fingerprint_files(files)
    return out


def input_fingerprints(paths) -> dict[str, str]:
    """{path: digest} of a stage's inputs, the part of a result's identity that is not its config: a
    prmflow output by its manifest's file digests, plain Parquet or another data file by its bytes
    (`fingerprint`). An empty path, a name (a tiny preset, a built-in task, `hub:...`) or a model
    directory with no manifest (a base model from elsewhere) has no entry."""
    out: dict[str, str] = {}
    for p in paths:
        path = Path(p) if p else None
        if path is not None and (path.is_file() or (path / MANIFEST).is_file()
                                 or (path.is_dir() and any(path.glob("*.parquet")))):
            out.update(fingerprint([path]))
    return out


#: {absolute output path: fd of its lock file} for the outputs this process is writing (`claim`).
_claimed: dict[str, int] = {}


def lock_path_for(output: str | Path) -> Path:
    """The hidden sibling `.NAME.writing` whose lock says a process is writing `output` (`claim`). Not
    `.NAME.lock`: a caller may hold a lock of its own by that name around a stage (tests/sft_cache.py)."""
    output = Path(output)
    return output.parent / f".{output.name}.writing"


def claim(output: str | Path, stage: str = "") -> None:
    """Make this process the one writer of `output` until `release` (or until it exits, when the OS
    drops the lock): an OutputExistsError when another process holds it. Claiming what this process
    already holds does nothing. `atomic_output_dir` holds it from its sweep of stale temporaries to
    its commit; `finished_output` only looks, so a second run of a command refuses at its start when
    the first is writing.

    Two runs of one command at once: the second swept the first's temporary directory away as a
    crash's leftover, and the first died in a FileNotFoundError. The lock is an flock on `.NAME.writing`
    (released by the kernel whatever way the process ends); the file is removed on release, and a
    holder checks that the file it locked is still the one at that path (a releaser may have removed
    it between our open and our lock)."""
    key = os.path.abspath(output)
    if key in _claimed:
        return
    lock = lock_path_for(key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666 & ~UMASK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputExistsError(
                f"{stage + ': ' if stage else ''}another process (pid {holder}) is writing '{output}' now. Wait for it to "
                f"finish (a run of the same config then finds it complete), or choose another output.") from None
        except OSError:  # a filesystem without locks: carry on unguarded, as before
            os.close(fd)
            return
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # removed (and maybe re-made) by a releasing holder after we opened it: take the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _claimed[key] = fd


def release(output: str | Path) -> None:
    """Give up the claim on `output` (`claim`) if this process holds it."""
    fd = _claimed.pop(os.path.abspath(output), None)
    if fd is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path_for(os.path.abspath(output)))
        os.close(fd)


def check_unclaimed(output: str | Path, stage: str = "") -> None:
    """The OutputExistsError of `claim` if another process is writing `output` now; nothing is held or made
    after (a holder keeps its `.NAME.writing` until it releases, so with no such file nobody holds one)."""
    if os.path.abspath(output) not in _claimed and lock_path_for(os.path.abspath(output)).exists():
        claim(output, stage)
        release(output)


def work_dir_for(output: str | Path) -> Path:
    """The hidden sibling `.NAME.work` where a training stage keeps its resume checkpoint until it commits `output`."""
    output = Path(output)
    return output.parent / f".{output.name}.work"


def foreign(path: str | Path) -> str | None:
    """Why `--overwrite` may not replace what is at `path`, or None when it may.

    It may replace only what prmflow wrote (a directory holding our manifest.json) or an empty
    directory (nothing to lose). A file, a link, or a directory of anything else is someone's data:
    replacing it would delete it, so it is never ours to replace."""
    path = Path(path)
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file, not a directory"
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None if not any(path.iterdir()) else f"a directory without prmflow's {MANIFEST}"
    except (OSError, ValueError, RecursionError):
        return f"a directory whose {MANIFEST} is not prmflow's"
    if not (isinstance(manifest, dict) and "kind" in manifest and isinstance(manifest.get("files"), dict)):
        return f"a directory whose {MANIFEST} is not prmflow's"
    # files put into our output since (a user's notes, a copy of something): replacing it would delete them. Looked
    # for only while every listed file is in place: a damaged output of ours (a shard gone, a name that escapes) is
    # still ours to replace
    listed = {*manifest["files"], MANIFEST}
    in_place = all(not Path(n).is_absolute() and ".." not in Path(n).parts and (path / n).is_file() for n in listed)
    added = sorted(rel for p in path.rglob("*") if (p.is_symlink() or not p.is_dir())
                   and (rel := p.relative_to(path).as_posix()) not in listed) if in_place else []
    if added:
        return (f"a prmflow output holding files prmflow did not write there ({', '.join(added[:3])}"
                f"{', ...' if len(added) > 3 else ''})")
    return None


def refuse_foreign(path: str | Path, stage: str = "") -> None:
    """An OutputExistsError naming `path` when something prmflow did not write is there (`foreign`)."""
    why = foreign(path)
    if why is not None:
        raise OutputExistsError(
            f"{stage + ': ' if stage else ''}output '{path}' already exists and is {why}: not an output prmflow wrote "
            f"as it stands, so it is left as it is (--overwrite only replaces prmflow's own outputs, unchanged). "
            f"Choose another output path, or move it away yourself.")


def check_output_location(output: str | Path, stage: str, key: str = "output") -> None:
    """Fail now, before any model is loaded, when `output` or its resume work directory (`work_dir_for`)
    could not be created at the end: a parent that is a file, or a directory this process may not
    write to. A stage that trained for an hour must not die at its first mkdir."""
    output = Path(output)
    work = work_dir_for(output)
    if (work.exists() or work.is_symlink()) and not work.is_dir():
        raise OutputExistsError(f"{stage}: '{work}', where the resume checkpoint of {key} '{output}' goes, exists "
                                f"and is not a directory. Move it away, or choose another {key}.")
    check_creatable(output, stage, key)


def check_not_an_input(output: str | Path, inputs, stage: str) -> None:
    """An OutputExistsError when `output` is one of the stage's `inputs` (paths) or a folder that holds one:
    `--output` typed as `--input` was refused as "already exists", and with --overwrite the result replaced
    the data it was computed from."""
    out = os.path.realpath(output)
    for src in inputs:
        real = os.path.realpath(src)
        if real == out or real.startswith(out.rstrip(os.sep) + os.sep):
            what = "is its input" if real == out else "holds its input"
            raise OutputExistsError(f"{stage}: output '{output}' {what} '{src}': writing it would replace what the stage "
                                    f"reads. Choose another output.")


def check_creatable(path: str | Path, who: str, key: str) -> None:
    """An OutputExistsError unless the directory `path` (given as `key`) exists or can be made: its
    nearest existing ancestor is a directory this process may create entries in."""
    if Path(path).parts and Path(path).parts[0].startswith("~"):  # from YAML or --set KEY=~/x: no shell expanded it
        raise ConfigError(f"{who}: {key} '{path}' starts with '~', which only a shell expands: here it would make a "
                          f"folder named '~'. Write the path in full, e.g. '{os.path.expanduser(path)}'.")
    parent = Path(os.path.abspath(path)).parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputExistsError(f"{who}: cannot create {key} '{path}': '{parent}' is a file, not a directory. "
                                f"Choose another {key}, or move '{parent}' away.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputExistsError(f"{who}: cannot create {key} '{path}': no permission to write in '{parent}'. "
                                f"Choose another {key}.")


def finished_output(stage: str, output: str | Path, config: dict, overwrite: bool, inputs: dict | None = None,
                    per_rank: bool = False, announce: bool = True, **recorded: Any) -> dict | None:
    """Is `output` already complete for this run? Every stage asks this before it starts work.

    Returns the manifest when `output` is a finished, intact output whose manifest records the same
    `config` (its `config_identity`), the same `inputs` ({path: digest}, `input_fingerprints`) and the
    same `recorded` entries: the stage has nothing to do, says so (unless not `announce`), and a
    resume work directory left by a kill between commit and cleanup is removed. None: there is
    nothing there, or (with `overwrite`) a different result to replace. Anything else is an
    OutputExistsError (`completed_output`). With N ranks, rank 0 looks and tells the others, unless
    each rank writes its own `output` (`per_rank`)."""
    expected = {"config": config_identity(config), **({} if inputs is None else {"inputs": inputs}), **recorded}

    def look():
        check_not_an_input(output, inputs or {}, stage)
        check_output_location(output, stage)
        check_unclaimed(output, stage)
        return completed_output(output, expected, overwrite, stage)
    done = look() if per_rank else distributed.on_main(look)
    if done is None:
        return None
    if announce:
        print(f"{stage}: '{output}' is already complete for this config{'' if inputs is None else ' and these inputs'}; "
              f"nothing to do.")
    work = work_dir_for(output)
    if per_rank or distributed.is_main():
        shutil.rmtree(work, ignore_errors=True)
    if not per_rank:
        distributed.barrier()
    return done


def completed_output(path: str | Path, expected: dict[str, Any], overwrite: bool, stage: str) -> dict | None:
    """Decide what to do about an existing output before a stage starts work.

    Returns the manifest when `path` is a finished, intact output whose manifest agrees with
    `expected` on every key (the caller has nothing to do); None when there is nothing at `path`, or
    when it differs and `overwrite` is set (the caller replaces it). Anything else is an
    OutputExistsError: an existing result is never silently replaced. `expected["config"]`, if
    given, is compared with `config_identity` of the stored config, so tracking settings do not count.
    """
    path = Path(path)
    recover_interrupted_replace(path)
    if not path.exists():
        return None
    why = None
    try:
        manifest = read_manifest(path)
        verify_files(path, manifest)
    except DataError as e:
        manifest, why = None, f"it is not an intact finished output ({e})"
    if manifest is not None:
        differs = [k for k, v in expected.items()
                   if (config_identity(manifest.get(k) or {}) if k == "config" else manifest.get(k)) != v]
        if not differs:
            return manifest
        why = f"it does not match this run (different {' and '.join(differs)})"
    refuse_foreign(path, stage)  # someone else's file or directory: never replaced, overwrite or not
    if overwrite:
        return None
    raise OutputExistsError(
        f"{stage}: output '{path}' already exists, but {why}. Pass --overwrite true to replace it, or choose "
        f"another --output."
    )


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, kind: str, overwrite: bool = False,
                      manifest: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temporary directory; on success write its manifest and rename it to `path`.

    On any exception the temporary directory is removed and `path` is left as it was. `manifest`
    holds extra manifest entries; the caller may keep adding to it until the block ends.
    """
    manifest_extra = manifest if manifest is not None else {}
    path = Path(path)
    recover_interrupted_replace(path)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise OutputExistsError(
                f"Output '{path}' already exists. Choose another output path, delete it, or pass overwrite."
            )
        refuse_foreign(path)
    check_creatable(path, f"writing the {kind}", "output")  # a file on the way: one line, not mkdir's traceback
    path.parent.mkdir(parents=True, exist_ok=True)
    claim(path)  # before the sweep: another writer's temporary directory is not a crash's leftover
    try:
        clean_stale_temporaries(path)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    except BaseException:
        release(path)
        raise
    try:
        # mkdtemp's 0700 would make the committed output readable by its owner only (a container
        # running as another uid could not read its inputs): the mode mkdir gives, and at the end
        # the same for every file (give_default_modes).
        os.chmod(tmp, 0o777 & ~UMASK)
        yield tmp
        give_default_modes(tmp)
        write_json_atomic(tmp / MANIFEST, build_manifest(tmp, kind, **manifest_extra))
        _fsync_dir(tmp)
        if path.exists() or path.is_symlink():
            refuse_foreign(path)  # checked again: something may have been put there while we worked
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
    finally:
        release(path)


@contextlib.contextmanager
def shared_output_dir(path: str | Path, kind: str, overwrite: bool = False,
                      manifest: dict[str, Any] | None = None) -> Iterator[Path]:
    """`atomic_output_dir` for N ranks that all write into it (collective saves: DeepSpeed checkpoints,
    gathered ZeRO-3 weights): rank 0 creates the temporary directory and hands its path to the others;
    when every rank has finished its part, rank 0 alone writes the manifest and renames it into place,
    and no rank goes on before that. One process: exactly `atomic_output_dir`.

    Inside the block, files that are not per-rank are written on rank 0 only (`distributed.is_main`).
    A rank that fails leaves the others waiting at the barrier until torchrun stops them or the
    collective timeout passes; the temporary directory is then never committed.
    """
    if distributed.world_size() == 1:
        with atomic_output_dir(path, kind, overwrite, manifest) as tmp:
            yield tmp
        return
    if distributed.is_main():
        with atomic_output_dir(path, kind, overwrite, manifest) as tmp:
            distributed.on_main(lambda: tmp)
            yield tmp
            distributed.barrier()  # every rank's part is on disk: commit
        distributed.barrier()  # committed: the others may go on
    else:
        tmp = distributed.on_main(lambda: None)
        yield tmp
        distributed.barrier()
        distributed.barrier()
