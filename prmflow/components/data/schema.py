"""The Parquet hand-offs between stages: schemas, a streaming writer, validating readers.

A hand-off is a directory of `part-NNNNN.parquet` shards plus `manifest.json` (see io.py). The
manifest carries `schema_version`, the row count and a sha256 per shard. Readers check the manifest,
the columns and their types, and the per-token columns' lengths, and fail with a `DataError` that
names the file, the column and the offending prompt_id.

Several directories (rollout shards written by separate pods) read as one dataset. What does not
depend on the hand-off kinds lives below this module: opening and streaming Parquet files and the
read-ahead / write-behind threads in parquet_io.py. The per-row invariants (`validate`) and their
vectorized row scans (no Python loop over rows) sit at the end of this module.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import io, parquet_io
from ...errors import DataError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
#: Versions this prmflow reads: 1 (before multi-turn episodes: no policy_mask, every response token is the policy's)
#: and 2 (adds policy_mask). A reader refuses a version it does not list, naming it.
READ_VERSIONS = (1, 2)

#: Columns with one entry per response token; their lengths must equal len(response_ids).
PER_TOKEN_COLUMNS = ("behavior_logprobs", "old_logprobs", "ref_logprobs", "values",
                     "token_rewards", "advantages", "returns", "kl", "policy_mask")
#: Columns that must be present (non-null) in every row of a rollouts hand-off.
REQUIRED = ("prompt_id", "sample_idx", "iteration", "response_ids")

_f32_list = pa.list_(pa.float32())
_i32_list = pa.list_(pa.int32())

ROLLOUT_FIELDS = [
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_idx", pa.int32(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    pa.field("prompt", pa.string()),
    pa.field("response", pa.string()),
    pa.field("prompt_ids", _i32_list),
    pa.field("response_ids", _i32_list),
    # 1 where response_ids[t] was sampled by the policy, 0 where the environment appended it (a tool observation of a
    # multi-turn episode); null = every token is the policy's (single-turn rows, version-1 files)
    pa.field("policy_mask", pa.list_(pa.int8())),
    pa.field("images", pa.list_(pa.binary())),
    pa.field("finish_reason", pa.string()),
    pa.field("behavior_logprobs", _f32_list),
    pa.field("old_logprobs", _f32_list),
    pa.field("ref_logprobs", _f32_list),
    pa.field("values", _f32_list),
    pa.field("step_ends", _i32_list),
    pa.field("step_rewards", _f32_list),
    pa.field("outcome_reward", pa.float32()),
    pa.field("reward_components", pa.map_(pa.string(), pa.float32())),
    pa.field("answer", pa.string()),
    pa.field("logprob_temperature", pa.float64()),
]
ADVANTAGE_FIELDS = ROLLOUT_FIELDS + [
    pa.field("token_rewards", _f32_list),
    pa.field("advantages", _f32_list),
    pa.field("returns", _f32_list),
    pa.field("kl", _f32_list),
]

ROLLOUTS = pa.schema(ROLLOUT_FIELDS, metadata={"prmflow.kind": "rollouts", "prmflow.schema_version": str(SCHEMA_VERSION)})
ADVANTAGES = pa.schema(ADVANTAGE_FIELDS, metadata={"prmflow.kind": "advantages", "prmflow.schema_version": str(SCHEMA_VERSION)})
SCHEMAS = {"rollouts": ROLLOUTS, "advantages": ADVANTAGES}

def schema_for(kind: str) -> pa.Schema:
    if kind not in SCHEMAS:
        raise ValueError(f"unknown hand-off kind {kind!r}; known: {sorted(SCHEMAS)}")
    return SCHEMAS[kind]


def conform(table: pa.Table, kind: str, where: str = "table") -> pa.Table:
    """Return `table` with exactly the columns of `kind` in schema order and type.

    Missing nullable columns are added as nulls; a missing required column, an unknown extra
    column, or a column that cannot be cast losslessly is a DataError naming it.
    """
    schema = schema_for(kind)
    _check_unique(table.column_names, where)
    names = set(table.column_names)
    extra = names - set(schema.names)
    if extra:
        raise DataError(f"{where}: unexpected column(s) {sorted(extra)} for a {kind} hand-off; known columns: {schema.names}.")
    arrays = []
    for f in schema:
        if f.name not in names:
            if f.name in REQUIRED:
                raise DataError(f"{where}: required column '{f.name}' is missing.")
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if not col.type.equals(f.type):
            col = _cast(col, f, where)
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=schema)


def _cast(col: pa.ChunkedArray, f: pa.Field, where: str) -> pa.ChunkedArray:
    """`col` as the type of field `f` when that loses nothing, else a DataError naming the column."""
    try:
        return col.cast(f.type, safe=True)
    except pa.ArrowException as e:  # ArrowInvalid, ArrowNotImplementedError, ArrowTypeError
        raise DataError(f"{where}: column '{f.name}' has type {col.type}, expected {f.type} ({e}).") from None


def _check_unique(names: Sequence[str], where: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise DataError(f"{where}: column '{name}' appears {list(names).count(name)} times; a column name must be unique.")
        seen.add(name)


def cast_columns(table: pa.Table, kind: str, where: str = "table") -> pa.Table:
    """`table` with each of its columns that belongs to `kind` cast to that kind's type (DataError if it cannot be)."""
    schema = schema_for(kind)
    _check_unique(table.column_names, where)
    for i, name in enumerate(table.column_names):
        idx = schema.get_field_index(name)
        if idx >= 0 and not table.column(i).type.equals(schema.field(idx).type):
            table = table.set_column(i, schema.field(idx), _cast(table.column(i), schema.field(idx), where))
    return table


# --- writing -----------------------------------------------------------------------------------

#: Columns whose values repeat across a group's samples, where Parquet dictionary encoding pays.
#: On float and token-id lists it does not (nearly every value is new), yet pyarrow's default
#: dictionary attempt on them costs more CPU than zstd itself and leaves files ~20% larger.
DICTIONARY_COLUMNS = ["prompt_id", "prompt", "images", "finish_reason", "answer"]

class DatasetWriter:
    """Stream record batches into a hand-off directory, committed atomically on `close()`.

    Use as a context manager: on an exception nothing is left at `path`.

        with DatasetWriter(out, "rollouts", config=cfg_dict, parents=[...]) as w:
            w.write(table)
    """

    def __init__(self, path: str | Path, kind: str, rows_per_shard: int = 65536, config: dict | None = None,
                 parents: Sequence[str] = (), overwrite: bool = False, extra: dict | None = None):
        self.path = Path(path)
        self.kind = kind
        self.schema = schema_for(kind)
        self.rows_per_shard = rows_per_shard
        self.meta = {"schema_version": SCHEMA_VERSION, "config": config or {}, "parents": list(parents), **(extra or {})}
        self._ctx = io.atomic_output_dir(self.path, kind, overwrite=overwrite, manifest=self.meta)
        self._tmp: Path | None = None
        self._writer: pq.ParquetWriter | None = None
        self._shard = 0
        self._rows_in_shard = 0
        self.rows = 0

    def __enter__(self) -> "DatasetWriter":
        self._tmp = self._ctx.__enter__()
        return self

    def _open_shard(self) -> None:
        assert self._tmp is not None
        self._writer = pq.ParquetWriter(self._tmp / f"part-{self._shard:05d}.parquet", self.schema,
                                        compression="zstd", use_dictionary=DICTIONARY_COLUMNS)
        self._rows_in_shard = 0

    def write(self, table: pa.Table | pa.RecordBatch, validated: bool = False) -> None:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        table = conform(table, self.kind, where=f"writing {self.path}")
        if not validated:
            validate(table, self.kind, where=f"writing {self.path}")
        offset = 0
        while offset < table.num_rows:
            if self._writer is None:
                self._open_shard()
            take = min(table.num_rows - offset, self.rows_per_shard - self._rows_in_shard)
            self._writer.write_table(table.slice(offset, take))  # type: ignore[union-attr]
            offset += take
            self._rows_in_shard += take
            self.rows += take
            if self._rows_in_shard >= self.rows_per_shard:
                self._writer.close()  # type: ignore[union-attr]
                self._writer = None
                self._shard += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if exc_type is None:
            if self.rows == 0:
                exc = DataError(f"Refusing to write an empty {self.kind} hand-off to '{self.path}': no rows were produced.")
                self._ctx.__exit__(type(exc), exc, None)
                raise exc
            self.meta["rows"] = self.rows  # read by atomic_output_dir when it writes the manifest
        return bool(self._ctx.__exit__(exc_type, exc, tb))


def write_dataset(path: str | Path, table: pa.Table, kind: str, **kwargs: Any) -> Path:
    """Write a whole table as a hand-off directory (atomically). Returns the path."""
    with DatasetWriter(path, kind, **kwargs) as w:
        w.write(table)
    return Path(path)


# --- reading -----------------------------------------------------------------------------------

@dataclass
class Dataset:
    """One or more committed hand-off directories of one kind, read as a single dataset."""

    dirs: list[Path]
    kind: str
    manifests: list[dict]

    @property
    def files(self) -> list[Path]:
        out = []
        for d, m in zip(self.dirs, self.manifests):
            if d.is_file():  # a plain Parquet file (open_plain)
                out.append(d)
                continue
            out += [io.safe_child(d, name) for name in sorted(m["files"]) if name.endswith(".parquet")]
        return out

    @property
    def num_rows(self) -> int:
        return sum(int(m.get("rows", 0)) for m in self.manifests)

    def iter_batches(self, batch_size: int = 4096, columns: Iterable[str] | None = None,
                     validate_rows: bool = True) -> Iterator[pa.Table]:
        """Tables of at most `batch_size` rows, shard by shard, with bounded memory.

        validate_rows=True: conformed to the full schema (columns not read or not stored come back
        as nulls) and checked by `validate`. validate_rows=False: just the requested columns, as
        stored; a missing one is a DataError.
        """
        cols = list(columns) if columns is not None else None
        for path in self.files:
            pf = parquet_io.open_parquet(path)
            _check_columns(pf.schema_arrow, self.kind, path, cols if not validate_rows else None)
            present = None if cols is None else [c for c in cols if c in pf.schema_arrow.names]
            for table in parquet_io.read_tables(pf, path, batch_size, present):
                if validate_rows:
                    table = conform(table, self.kind, where=str(path))
                    validate(table, self.kind, where=str(path))
                else:
                    table = cast_columns(table, self.kind, where=str(path))
                yield table

    def read(self, columns: Iterable[str] | None = None) -> pa.Table:
        """Everything, conformed and validated; with `columns`, just those columns as their schema
        types (a column that is not stored is a DataError naming it)."""
        cols = list(columns) if columns is not None else None
        tables = list(self.iter_batches(batch_size=1 << 20, columns=cols, validate_rows=cols is None))
        if not tables:
            full = schema_for(self.kind)
            return full.empty_table() if cols is None else pa.schema([full.field(c) for c in cols]).empty_table()
        return pa.concat_tables(tables)


def _check_columns(schema: pa.Schema, kind: str, path: Path, cols: list[str] | None) -> None:
    """Required columns must be stored; so must every column of `cols` (when given)."""
    expected = schema_for(kind)
    for name in cols or []:
        if name not in expected.names:
            raise ValueError(f"{name!r} is not a {kind} column")
    _check_unique(schema.names, f"'{path}'")
    for name in sorted(set(cols or []) | set(REQUIRED)):
        if schema.get_field_index(name) < 0:
            raise DataError(f"'{path}': column '{name}' is missing.")


def open_dataset(dirs: str | Path | Sequence[str | Path], kind: str, verify_checksums: bool = True) -> Dataset:
    """Open committed hand-off directories of `kind`, checking manifests and schema versions.

    A directory that itself holds shard directories (no manifest, but subdirectories with one)
    is expanded, so `--shard i --num-shards N` outputs under one parent read as one dataset. A
    plain Parquet file, or a directory of them with no manifest at all (rollouts made by another
    tool), is accepted too: its files' columns and types are checked against the contract now
    (a DataError naming the file and the column), its rows as they are read, and a note is logged
    that no checksum could be verified (`open_plain`).
    """
    if isinstance(dirs, (str, Path)):
        dirs = [dirs]
    expanded: list[Path] = []
    manifests: list[dict] = []
    for d in map(Path, dirs):
        if not d.exists():
            raise DataError(f"Input '{d}' does not exist. Point the stage at the output directory of the stage before it.")
        if d.is_dir() and not (d / io.MANIFEST).exists():
            dangling = sorted(p for p in d.iterdir() if p.is_symlink() and not p.exists())
            if dangling:  # a gathered-shards directory (entries link to the shards) whose shard is not here
                raise DataError(
                    f"Input '{d}' gathers shards by links, but '{dangling[0]}' links to '{os.readlink(dangling[0])}', "
                    "which does not exist here: the shard was moved or deleted, or (in a container) its host path is "
                    "not mounted. Mount each shard itself (`prmflow stage-command` does) or re-run the stage that wrote it.")
        if d.is_file() or not (d / io.MANIFEST).exists():
            subs = sorted(p for p in d.iterdir() if p.is_dir() and (p / io.MANIFEST).exists()) if d.is_dir() else []
            if subs:
                expanded += subs
                manifests += [None] * len(subs)
            else:
                expanded.append(d)
                manifests.append(open_plain(d, kind))
            continue
        expanded.append(d)
        manifests.append(None)
    for i, d in enumerate(expanded):
        if manifests[i] is not None:
            continue
        m = io.read_manifest(d)
        if m.get("kind") != kind:
            writer = {"rollouts": "rollout", "advantages": "advantage"}.get(kind, "the stage before this one")
            raise DataError(f"'{d}' holds a {m.get('kind')!r} hand-off, but a {kind!r} one is needed here: point the "
                            f"input at the output of {writer}.")
        if type(m.get("schema_version")) is not int or m.get("schema_version") not in READ_VERSIONS:
            raise DataError(
                f"'{d}' was written with schema version {m.get('schema_version')}, this prmflow reads version(s) "
                f"{', '.join(map(str, READ_VERSIONS))}. Re-run the stage that wrote it with this prmflow version, or "
                f"read it with the prmflow that wrote it."
            )
        if verify_checksums:
            io.verify_files(d, m)
        _check_row_count(d, m)
        manifests[i] = m
    return Dataset(expanded, kind, manifests)


_noted_plain: set[str] = set()


def open_plain(path: Path, kind: str) -> dict:
    """A manifest-like record of a plain Parquet file or directory of them (no prmflow manifest).

    Every file's columns must be the contract's (the required ones present, none unknown, each
    castable to its type): checked on the footers now, before any data is read; rows are validated
    as they are read, like any hand-off. There is no checksum to verify: a file changed or cut
    short by its writer is only caught where it no longer parses, which is logged once per path.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".parquet":
            raise DataError(f"Input '{path}' is a file but not .parquet; point the stage at the {kind} directory (the one "
                            f"holding {io.MANIFEST}) written by the stage before it, or at Parquet files with its columns.")
        if (path.parent / io.MANIFEST).exists():
            raise DataError(f"Input '{path}' is a file of the hand-off '{path.parent}'; point the stage at that directory "
                            f"(the one holding {io.MANIFEST}), so its checksums are verified.")
        names, base = [path.name], path.parent
    else:
        names, base = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix == ".parquet"), path
        if not names:
            raise DataError(f"'{path}' has no {io.MANIFEST} and no .parquet files: it is not a finished prmflow output (a "
                            f"crashed or still-running stage leaves none) nor a directory of {kind} Parquet files. Re-run "
                            f"the stage that writes it, or point at the Parquet files.")
    rows = 0
    for name in names:
        f = base / name
        pf = parquet_io.open_parquet(f)
        _check_columns(pf.schema_arrow, kind, f, None)
        conform(pf.schema_arrow.empty_table(), kind, where=f"'{f}'")  # unknown columns, types that cannot be cast
        rows += pf.metadata.num_rows
    if str(path) not in _noted_plain:
        _noted_plain.add(str(path))
        log.warning("'%s' has no %s: read as plain Parquet %s (%d file(s), %d rows) after checking its columns and "
                    "types; no checksum was verified.", path, io.MANIFEST, kind, len(names), rows)
    return {"kind": kind, "schema_version": SCHEMA_VERSION, "rows": rows, "plain": True,
            "files": {name: "" for name in names}}


def _check_row_count(d: Path, manifest: dict) -> None:
    """The shards' footers must hold the rows the manifest promises (no shard dropped from 'files')."""
    shards = [io.safe_child(d, name) for name in sorted(manifest["files"]) if name.endswith(".parquet")]
    stored = sum(parquet_io.open_parquet(p).metadata.num_rows for p in shards)
    if stored != manifest.get("rows", 0):
        raise DataError(f"'{d}': field 'rows' of its {io.MANIFEST} says {manifest.get('rows', 0)} rows, but the "
                        f"shards it lists hold {stored}. Re-run the stage that wrote it.")


def read_dataset(dirs: str | Path | Sequence[str | Path], kind: str, columns: Iterable[str] | None = None) -> pa.Table:
    """Open and read everything (small data; stream with `open_dataset(...).iter_batches`)."""
    return open_dataset(dirs, kind).read(columns)


# --- per-row invariants ------------------------------------------------------------------------

def first_bad(table: pa.Table, mask: pa.Array | np.ndarray) -> str:
    idx = int(np.flatnonzero(np.asarray(mask))[0])
    pid = table.column("prompt_id")[idx].as_py()
    sid = table.column("sample_idx")[idx].as_py()
    return f"row {idx} (prompt_id={pid!r}, sample_idx={sid})"


def validate(table: pa.Table, kind: str, where: str = "table") -> None:
    """Check the per-row invariants of a rollouts/advantages table (vectorized, no Python row loop).

    - required columns have no nulls;
    - every per-token column that is present has len == len(response_ids);
    - step_rewards has the length of step_ends and 0 <= step_end < len(response_ids);
    - no NaN or inf in any float column; logprob_temperature > 0 where set.
    """
    for name in REQUIRED:
        col = table.column(name)
        if col.null_count:
            mask = pc.is_null(col).to_numpy(zero_copy_only=False)
            raise DataError(f"{where}: column '{name}' is null in {first_bad(table, mask)}.")
    n_resp = pc.list_value_length(table.column("response_ids")).to_numpy(zero_copy_only=False)
    for name in PER_TOKEN_COLUMNS:
        if name not in table.column_names:
            continue
        col = table.column(name)
        if col.null_count == len(col):
            continue
        lens = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        present = ~pc.is_null(col).to_numpy(zero_copy_only=False)
        bad = present & (lens != n_resp)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{where}: column '{name}' has {int(lens[i])} entries but response_ids has {int(n_resp[i])} "
                f"in {first_bad(table, bad)}; every per-token column needs one value per response token."
            )
    ends, rewards = table.column("step_ends"), table.column("step_rewards")
    if ends.null_count < len(ends):
        n_ends = pc.list_value_length(ends).fill_null(0).to_numpy(zero_copy_only=False)
        if rewards.null_count < len(rewards):
            n_rew = pc.list_value_length(rewards).fill_null(0).to_numpy(zero_copy_only=False)
            has_rew = ~pc.is_null(rewards).to_numpy(zero_copy_only=False)
            bad = has_rew & (n_rew != n_ends)
            if bad.any():
                raise DataError(f"{where}: column 'step_rewards' and 'step_ends' differ in length in {first_bad(table, bad)}.")
        flat = pc.list_flatten(ends).to_numpy(zero_copy_only=False)
        if len(flat):
            row_of = np.repeat(np.arange(len(n_ends)), n_ends)
            bad_flat = (flat < 0) | (flat >= n_resp[row_of])
            if bad_flat.any():
                mask = np.zeros(len(n_ends), bool)
                mask[row_of[bad_flat]] = True
                raise DataError(
                    f"{where}: column 'step_ends' points outside the response (0..len(response_ids)-1) in "
                    f"{first_bad(table, mask)}."
                )
    if "policy_mask" in table.column_names and table.column("policy_mask").null_count < table.num_rows:
        _check_policy_mask(table, where)
    if "logprob_temperature" in table.column_names:
        temp = table.column("logprob_temperature").to_numpy(zero_copy_only=False)
        bad = ~np.isnan(temp) & (temp <= 0)  # null reads as NaN here: 1 to the trainer
        if bad.any():
            raise DataError(f"{where}: column 'logprob_temperature' is {float(temp[bad][0])} in {first_bad(table, bad)}; "
                            f"it is the softmax temperature of the log-prob columns and must be > 0 (1 for greedy rows).")
    for f in table.schema:
        bad = null_entry_rows(table.column(f.name))
        if bad is not None and bad.any():
            raise DataError(f"{where}: column '{f.name}' has a null entry inside its list in {first_bad(table, bad)}; "
                            f"a list may be null as a whole, but not hold nulls.")
        bad = nonfinite_rows(table.column(f.name))
        if bad is not None and bad.any():
            raise DataError(f"{where}: column '{f.name}' holds NaN or inf in {first_bad(table, bad)}.")


def _check_policy_mask(table: pa.Table, where: str) -> None:
    """policy_mask holds 0/1 only, and every step_end of a masked row is a policy token (a step is a policy turn)."""
    mask_col = table.column("policy_mask")
    flat = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False)
    lens = pc.list_value_length(mask_col).fill_null(0).to_numpy(zero_copy_only=False)
    row_of = np.repeat(np.arange(table.num_rows), lens)
    bad_flat = (flat != 0) & (flat != 1)
    if bad_flat.any():
        bad = np.zeros(table.num_rows, bool)
        bad[row_of[bad_flat]] = True
        raise DataError(f"{where}: column 'policy_mask' holds {int(flat[bad_flat][0])} in {first_bad(table, bad)}; "
                        f"it is 1 for a policy token and 0 for an environment token.")
    ends = table.column("step_ends")
    if ends.null_count == len(ends):
        return
    n_ends = pc.list_value_length(ends).fill_null(0).to_numpy(zero_copy_only=False)
    has_mask = ~pc.is_null(mask_col).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])  # offset of each row's mask in `flat`
    end_flat = pc.list_flatten(ends).to_numpy(zero_copy_only=False)
    end_row = np.repeat(np.arange(table.num_rows), n_ends)
    on_mask = has_mask[end_row]
    if on_mask.any():
        at = flat[starts[end_row[on_mask]] + end_flat[on_mask]]
        if (at != 1).any():
            bad = np.zeros(table.num_rows, bool)
            bad[end_row[on_mask][at != 1]] = True
            raise DataError(f"{where}: column 'step_ends' points at an environment token (policy_mask 0) in "
                            f"{first_bad(table, bad)}; a step ends on the last token of a policy turn.")


def null_entry_rows(col: pa.ChunkedArray) -> np.ndarray | None:
    """(B,) bool: rows whose numeric list (token ids, per-token floats) holds a null element.

    Equivalent to `[row is not None and None in row for row in col.to_pylist()]`.
    """
    t = col.type
    if not (pa.types.is_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))):
        return None
    flat = pc.list_flatten(col)
    if not flat.null_count:
        return None
    parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
    out = np.zeros(len(col), bool)
    out[parents[pc.is_null(flat).to_numpy(zero_copy_only=False)]] = True
    return out


def nonfinite_rows(col: pa.ChunkedArray) -> np.ndarray | None:
    """(B,) bool: rows holding a NaN/inf anywhere in a float, list<float> or map<_, float> column.

    Equivalent to testing `math.isfinite` on every non-null number of every row's Python value.
    """
    t = col.type
    if pa.types.is_floating(t):
        return ~pc.fill_null(pc.is_finite(col), True).to_numpy(zero_copy_only=False)
    if pa.types.is_map(t) and pa.types.is_floating(t.item_type):
        col = pa.chunked_array([pa.ListArray.from_arrays(c.offsets, c.items) for c in col.chunks],
                               type=pa.list_(t.item_type))
    elif not (pa.types.is_list(t) and pa.types.is_floating(t.value_type)):
        return None
    flat = pc.list_flatten(col)
    finite = pc.fill_null(pc.is_finite(flat), True).to_numpy(zero_copy_only=False)
    out = np.zeros(len(col), bool)
    if not finite.all():
        parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
        out[parents[~finite]] = True
    return out
