"""Bring the inputs of a recorded stage run to this machine, checked against the digests MLflow holds.

    local = fetch_inputs(handoffs_of_run(run), cache=Path("~/.cache/prmflow").expanduser())

Each stage run records its hand-offs as MLflow datasets (`tracking/handoffs.py`): the URI as KFP gave
it and the fingerprint of its manifest. A hand-off in an object store (`s3://`, `minio://`,
`gs://`) is downloaded with fsspec into `CACHE/<scheme>/<bucket>/<key>`: its manifest.json first,
whose fingerprint must equal the recorded digest, then every file the manifest lists (only those
under the part the stage read, e.g. `policy/` of a ppo output), each checked against its sha256.
Everything lands in a temporary sibling that is renamed into place only when all of it checked out,
so the cache never holds a half or a tampered copy; a later fetch of the same hand-off is free. A
hand-off on a local path is checked the same way where it is and used in place.

Credentials come from where the clients usually take them: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (or ~/.aws, an instance role) for s3:// and minio://, with the endpoint from
MLFLOW_S3_ENDPOINT_URL or AWS_ENDPOINT_URL (minio:// is S3 at the MinIO endpoint, which it needs:
e.g. a port-forward of KFP's minio-service to http://localhost:9000); Google's default credentials
for gs:// (`pip install gcsfs`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import DataError, PrmflowError
from ..components.data.io import MANIFEST, fingerprint_files, safe_child, sha256_file
from ..tracking.handoffs import DIGEST_CHARS, SIZED, Handoff, hash_tree

REMOTE = ("s3://", "minio://", "gs://")


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prmflow" / "handoffs"


def filesystem(uri: str):
    """(fsspec filesystem, path inside it) for a hand-off URI."""
    import fsspec

    scheme, _, rest = uri.partition("://")
    if scheme in ("s3", "minio"):
        endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        if scheme == "minio" and not endpoint:
            raise PrmflowError(f"'{uri}' is in KFP's MinIO: set AWS_ENDPOINT_URL (or MLFLOW_S3_ENDPOINT_URL) to its "
                               "address, e.g. `kubectl -n kubeflow port-forward svc/minio-service 9000:9000` and "
                               "AWS_ENDPOINT_URL=http://localhost:9000, with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.")
        return fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint} if endpoint else {}), rest
    if scheme == "gs":
        try:
            return fsspec.filesystem("gs"), rest
        except ImportError:
            raise PrmflowError(f"'{uri}' is in Google Cloud Storage: `pip install gcsfs` to fetch it.") from None
    raise PrmflowError(f"'{uri}': no way to fetch a {scheme}:// hand-off (s3://, minio://, gs:// or a local path).")


def _refuse(h: Handoff, what: str) -> DataError:
    return DataError(f"{what}; it is input '{h.key}'{f' ({h.shard})' if h.shard else ''} of the recorded run "
                     f"(dataset {h.name}, digest {h.digest}). It was changed after the run, or is not the artifact the "
                     "run read: nothing was re-run.")


def _check_manifest(h: Handoff, manifest_path: Path, where: str) -> dict:
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _refuse(h, f"'{where}/{MANIFEST}' is not a readable prmflow manifest ({e})") from None
    if fingerprint_files(files)[:DIGEST_CHARS] != h.digest[:DIGEST_CHARS]:
        raise _refuse(h, f"'{where}/{MANIFEST}' does not match the digest MLflow recorded")
    return manifest


def _wanted(h: Handoff, manifest: dict) -> dict[str, str]:
    """The manifest's files under the part the run read ('' = all); a file is itself. Never none."""
    sub = h.path.rstrip("/")
    files = {n: d for n, d in manifest["files"].items() if not sub or n == sub or n.startswith(sub + "/")}
    if not files:
        raise _refuse(h, f"the manifest of '{h.uri}' lists no files{f' under {sub!r}' if sub else ''}")
    return files


def verify_local(h: Handoff, local: Path) -> None:
    """Check a hand-off where it is: manifest fingerprint, then the sha256 of every file the run read."""
    if not h.has_manifest:
        if not local.exists():
            raise _refuse(h, f"'{local}' does not exist")
        if fingerprint_files(hash_tree(local, h.kind == SIZED))[:DIGEST_CHARS] != h.digest[:DIGEST_CHARS]:
            raise _refuse(h, f"'{local}' does not match the digest MLflow recorded")
        return
    manifest = _check_manifest(h, local / MANIFEST, str(local))
    for name, digest in _wanted(h, manifest).items():
        path = safe_child(local, name)
        if not path.is_file() or sha256_file(path) != digest:
            raise _refuse(h, f"'{local}/{name}' does not match the sha256 in its manifest"
                          if path.is_file() else f"'{local}/{name}' is missing")


def cache_path(cache: Path, uri: str) -> Path:
    scheme, _, rest = uri.partition("://")
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
    return cache.joinpath(scheme, *parts)


def fetch(h: Handoff, cache: Path) -> Path:
    """The local path the stage should read for hand-off `h`: downloaded (remote) or in place (local), verified."""
    if not h.uri.startswith(REMOTE):
        root = Path(h.uri)
        verify_local(h, root)
        return root / h.path if h.path else root
    fs, remote = filesystem(h.uri)
    dest = cache_path(cache, h.uri)
    try:
        if h.has_manifest:
            _fetch_manifested(h, fs, remote, dest)
        else:
            _fetch_whole(h, fs, remote, dest)
    except FileNotFoundError as e:
        raise _refuse(h, f"'{h.uri}' is not in the object store ({e})") from None
    return dest / h.path if h.path else dest


def _get_checked(h: Handoff, fs, remote: str, local: Path, digest: str, name: str) -> None:
    """Download one file beside `local`, check its sha256, then rename it into place."""
    local.parent.mkdir(parents=True, exist_ok=True)
    part = local.with_name(f".{local.name}.part-{os.getpid()}")
    try:
        try:
            fs.get(remote, str(part))
        except FileNotFoundError:
            raise _refuse(h, f"'{h.uri}/{name}' is listed in its manifest but missing") from None
        if sha256_file(part) != digest:
            raise _refuse(h, f"'{h.uri}/{name}' does not match the sha256 in its manifest")
        os.replace(part, local)
    finally:
        part.unlink(missing_ok=True)


def _fetch_manifested(h: Handoff, fs, remote: str, dest: Path) -> None:
    """manifest.json first (its fingerprint must be the recorded digest), then each file the run read.

    A file already in the cache with the right sha256 is kept; every file placed was checked first."""
    manifest_path = dest / MANIFEST
    manifest = None
    if manifest_path.is_file():
        try:
            manifest = _check_manifest(h, manifest_path, str(dest))
        except DataError:  # the cache holds another version of this URI: fetch this run's
            manifest = None
    if manifest is None:
        dest.mkdir(parents=True, exist_ok=True)
        part = dest / f".{MANIFEST}.part-{os.getpid()}"
        try:
            fs.get(f"{remote}/{MANIFEST}", str(part))
            manifest = _check_manifest(h, part, h.uri)
            os.replace(part, manifest_path)
        finally:
            part.unlink(missing_ok=True)
    for name, digest in _wanted(h, manifest).items():
        local = safe_child(dest, name)
        if not (local.is_file() and sha256_file(local) == digest):
            _get_checked(h, fs, f"{remote}/{name}", local, digest, name)


def _fetch_whole(h: Handoff, fs, remote: str, dest: Path) -> None:
    """A file or directory no manifest covers: all of it, checked as a whole, then renamed into place."""
    if dest.exists():
        try:
            verify_local(h, dest)
            return
        except DataError:
            pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        if fs.isdir(remote):
            fs.get(remote.rstrip("/") + "/", str(tmp), recursive=True)
            got = tmp
        else:
            got = tmp / Path(remote).name
            fs.get(remote, str(got))
        if fingerprint_files(hash_tree(got, h.kind == SIZED))[:DIGEST_CHARS] != h.digest[:DIGEST_CHARS]:
            raise _refuse(h, f"'{h.uri}' does not match the digest MLflow recorded")
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.replace(got, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_inputs(handoffs: list[Handoff], cache: Path) -> dict[str, Path | dict[str, Path]]:
    """{config key: local path} for every input hand-off; a gathered-shards input maps to {shard: path}."""
    out: dict[str, Path | dict[str, Path]] = {}
    for h in handoffs:
        if h.context == "output":
            continue
        local = fetch(h, cache)
        if h.shard:
            shards = out.setdefault(h.key, {})
            if not isinstance(shards, dict):
                raise PrmflowError(f"input '{h.key}' was recorded both whole and as shards; the run's datasets are inconsistent.")
            shards[h.shard] = local
        else:
            out[h.key] = local
    return out


def gather(shards: dict[str, Path], into: Path) -> Path:
    """A gathered-shards directory (entries linking to `shards`) for a stage run outside a container."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for name, path in sorted(shards.items()):
        (into / name).symlink_to(Path(path).resolve(), target_is_directory=True)
    return into
