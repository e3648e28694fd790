"""Where a dataset's rows come from: local files and directories, object stores, the Hugging Face Hub.

A dataset is named by one string (a stage's `task` key), `LOCATION[?option=value&...]`:

| LOCATION | read as |
|---|---|
| `data/train.jsonl`, `data/train.parquet` | one local file (`.json` is read as JSONL) |
| `data/gsm8k/` | a Hugging Face `datasets` directory (`save_to_disk`: `state.json` or `dataset_dict.json`), else every `*.parquet` / `*.jsonl` file in it, in name order |
| `s3://bucket/gsm8k/train.parquet`, `gs://...`, any fsspec URL | the same through fsspec: one file, or a prefix whose `*.parquet` / `*.jsonl` files are read in name order |
| `hub:openai/gsm8k?config=main&split=test` | `datasets.load_dataset` (needs the Hub, or its cache; offline it fails with what to do instead) |

Options: `format` (the row format, see public.py; default: detected from the columns of each file's
first row, so a directory may hold GSM8K and MATH files side by side),
`split` (a `datasets` directory holding several splits, or a Hub dataset; default `train`, and
`test` where a stage reads held-out data: evaluate's task, best-of-N's, SFT's eval_task),
`config` (a Hub dataset's configuration, e.g. `main` for GSM8K), `neutral` (PRM800K: the label of
a neutral step, see public.py).

Object-store credentials and endpoints come from the environment as their libraries read them:
for S3, `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` and `AWS_ENDPOINT_URL` (MinIO, Ceph, ...; else
`MLFLOW_S3_ENDPOINT_URL`, which a pipeline's `cluster.object_store_secret` sets);
any fsspec storage option from `FSSPEC_<PROTOCOL>_<OPTION>` variables, e.g.
`FSSPEC_S3_ENDPOINT_URL` (fsspec's own configuration). Every row comes with where it is (`FILE,
line N` / `FILE, row N`), so a bad row is reported by file and row.
"""  # noqa: E501  (a markdown table's rows are one line each)

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from ..errors import DataError

OPTIONS = ("format", "split", "config", "neutral")
"""Options a dataset string may carry after `?`."""
HUB_PREFIX = "hub:"
ROW_FILES = (".parquet", ".jsonl", ".json")
BATCH_ROWS = 1024


@dataclass
class Spec:
    """A parsed dataset string."""

    location: str
    options: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.location


def parse(task: str) -> Spec:
    """Split `LOCATION?key=value&...` into the location and its options (unknown options are an error)."""
    location, sep, query = str(task).partition("?")
    options: dict[str, str] = {}
    if sep:
        for part in filter(None, query.split("&")):
            key, eq, value = part.partition("=")
            if not eq or key not in OPTIONS:
                raise DataError(f"Dataset '{task}': '{part}' is not an option; give {', '.join(o + '=...' for o in OPTIONS)} "
                                f"after '?', joined by '&' (e.g. data.jsonl?format=gsm8k).")
            options[key] = value
    if not location:
        raise DataError(f"Dataset '{task}' names no file, directory, URL or hub:ID.")
    return Spec(location, options)


def iter_rows(spec: Spec, held_out: bool = False) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of the dataset, in order; where = 'FILE, line N' or 'FILE, row N'
    (`file_of(where)` gives FILE: a directory's files may hold different formats). `held_out`: the
    caller scores on these rows, so a dataset with splits and no ?split= gives its `test` split."""
    loc = spec.location
    if loc.startswith(HUB_PREFIX):
        yield from _hub_rows(loc[len(HUB_PREFIX):], spec.options, held_out)
    elif "://" in loc:
        yield from _fsspec_rows(loc)
    else:
        path = Path(loc)
        if path.is_dir():
            if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
                yield from _hf_disk_rows(path, spec.options, held_out)
            elif kind := _handoff_kind(path):  # its manifest.json was read as the first JSONL row: "not valid JSON"
                raise DataError(f"Dataset '{path}' is a prmflow {kind!r} hand-off (its manifest.json says so), not a "
                                f"dataset of prompts or solutions. Point it at a .jsonl/.parquet file (or a directory "
                                f"of them), a built-in task, or, for the prm stage, a prm-label output.")
            else:
                files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in ROW_FILES)
                if not files:
                    raise DataError(f"Dataset directory '{path}' holds no .parquet or .jsonl files and is not a Hugging "
                                    f"Face datasets directory (save_to_disk). Point at a file, or at a directory of them.")
                for f in files:
                    with open(f, "rb") as fh:
                        yield from _file_rows(fh, str(f))
        elif path.is_file():
            with open(path, "rb") as fh:
                yield from _file_rows(fh, str(path))
        else:
            raise DataError(f"Dataset '{loc}' does not exist. Pass a .jsonl/.parquet file, a directory of them, a "
                            f"datasets directory, an object-store URL (s3://...) or hub:ID.")


def _handoff_kind(path: Path) -> str | None:
    """The kind of the prmflow output at directory `path` (its manifest.json's), or None when it is not one."""
    try:
        manifest = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(manifest, dict) and isinstance(manifest.get("kind"), str) and isinstance(manifest.get("files"), dict):
        return manifest["kind"]
    return None


# --- files ----------------------------------------------------------------------------------------

def file_of(where: str) -> str:
    """The file (or split) part of a row's `where`."""
    return where.rsplit(", ", 1)[0]


def _file_rows(f: IO[bytes], name: str) -> Iterator[tuple[str, dict]]:
    if name.endswith((".jsonl", ".json")):
        yield from jsonl_rows(f, name)
    elif name.endswith(".parquet"):
        yield from parquet_rows(f, name)
    else:
        raise DataError(f"Dataset '{name}': unknown format '{Path(name).suffix}'. Use .jsonl or .parquet (or a directory "
                        f"of them, or a Hugging Face datasets directory).")


def jsonl_rows(f: IO[bytes], name: str) -> Iterator[tuple[str, dict]]:
    """Rows of a JSONL stream; a line that is not UTF-8, not JSON or not an object is a DataError naming it."""
    for lineno, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name}, line {lineno}: not UTF-8 text ({e.reason} at byte {e.start}). "
                            f"Save the file as UTF-8.") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            # json's msg stops where its position goes ("Invalid control character at"): give the column
            where = f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"
            raise DataError(f"{name}, line {lineno}: not valid JSON ({where}). Fix or remove the line.") from None
        except RecursionError:
            raise DataError(f"{name}, line {lineno}: JSON nested too deeply to be a dataset row.") from None
        if not isinstance(row, dict):
            raise DataError(f"{name}, line {lineno}: expected a JSON object, got {type(row).__name__}.")
        yield f"{name}, line {lineno}", row


def parquet_rows(f: Any, name: str) -> Iterator[tuple[str, dict]]:
    """Rows of a Parquet file (path or binary stream), read a batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        batches = pf.iter_batches(batch_size=BATCH_ROWS)
        i = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{name}, row {i}", row
                i += 1
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{name}: not a readable Parquet file ({e}).") from None


def _fsspec_rows(url: str) -> Iterator[tuple[str, dict]]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **_storage_options(url))
        protocol = url.split("://", 1)[0]
        if fs.isdir(path):
            files = sorted(p for p in fs.ls(path, detail=False) if p.endswith(ROW_FILES))
            if not files:
                raise DataError(f"Dataset '{url}' is a prefix with no .parquet or .jsonl objects under it.")
        elif fs.isfile(path):
            files = [path]
        else:
            raise DataError(f"Dataset '{url}' does not exist (no such object or prefix). Check the bucket and key.")
        for p in files:
            name = f"{protocol}://{p}"
            with fs.open(p, "rb") as fh:
                yield from _file_rows(fh, name)
    except DataError:
        raise
    except (OSError, ValueError, ImportError) as e:  # credentials, endpoint, permissions, unknown protocol
        raise DataError(f"Dataset '{url}' cannot be read ({type(e).__name__}: {e}). Check the URL, the credentials "
                        f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the endpoint (AWS_ENDPOINT_URL).") from None


def _storage_options(url: str) -> dict:
    """S3-compatible stores: the endpoint from AWS_ENDPOINT_URL(_S3), else MLFLOW_S3_ENDPOINT_URL, when
    fsspec's own config gives none."""
    import fsspec.config

    if url.startswith(("s3://", "s3a://")) and "endpoint_url" not in fsspec.config.conf.get("s3", {}):
        endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                    or os.environ.get("MLFLOW_S3_ENDPOINT_URL"))  # what the pipeline's object_store_secret provides
        if endpoint:
            return {"endpoint_url": endpoint}
    return {}


# --- Hugging Face datasets ------------------------------------------------------------------------

def _table_rows(ds, name: str) -> Iterator[tuple[str, dict]]:
    i = 0
    for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
        for row in table.to_pylist():
            yield f"{name}, row {i}", row
            i += 1


def _pick_split(dd, where: str, split: str | None, held_out: bool):
    names = list(dd.keys())
    if split is None and held_out:
        if "test" not in names:  # train (or the only split) is what a training stage reads: not held out
            raise DataError(f"Dataset '{where}' has splits {names} and none is 'test': held-out prompts (evaluate, "
                            f"best-of-N, eval_task) need a split the policy did not train on; add ?split=NAME.")
        split = "test"
    if split is None:
        split = "train" if "train" in names or len(names) != 1 else names[0]
    if split not in names:
        raise DataError(f"Dataset '{where}' has splits {names}, not '{split}'; add ?split=NAME.")
    return dd[split], split


def _hf_disk_rows(path: Path, options: dict, held_out: bool) -> Iterator[tuple[str, dict]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"'{path}' is not a readable Hugging Face datasets directory ({e}). Re-save it with "
                        f"save_to_disk, or export it to Parquet.") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, str(path), options.get("split"), held_out)
        yield from _table_rows(ds, f"{path} (split {split})")
    else:
        yield from _table_rows(ds, str(path))


def _hub_rows(repo: str, options: dict, held_out: bool) -> Iterator[tuple[str, dict]]:
    import datasets

    split = options.get("split", "test" if held_out else "train")
    name = f"{HUB_PREFIX}{repo} (split {split})"
    try:
        ds = datasets.load_dataset(repo, options.get("config") or None, split=split)
    except Exception as e:  # noqa: BLE001 - the hub client's errors have no common base (connection, offline, 404, auth)
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") else ""
        raise DataError(
            f"Dataset '{HUB_PREFIX}{repo}' could not be loaded from the Hugging Face Hub{offline}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. Where the Hub is not reachable, load it once where it is "
            f"(datasets.load_dataset('{repo}'{', ' + repr(options['config']) if options.get('config') else ''})"
            f".save_to_disk(DIR), or .to_parquet(FILE)) and pass DIR or FILE, or an s3:// copy of the Parquet files."
        ) from None
    yield from _table_rows(ds, name)
