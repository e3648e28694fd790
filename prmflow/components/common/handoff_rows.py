"""The per-row invariants of a rollouts / advantages table (schema.py's readers and writer check them).

Vectorized over the table (no Python row loop); a violation is a DataError naming the column and
the first offending row by prompt_id and sample_idx.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import arrow_ops
from ...errors import DataError

#: Columns with one entry per response token; their lengths must equal len(response_ids).
PER_TOKEN_COLUMNS = ("behavior_logprobs", "old_logprobs", "ref_logprobs", "values",
                     "token_rewards", "advantages", "returns", "kl")
#: Columns that must be present (non-null) in every row of a rollouts hand-off.
REQUIRED = ("prompt_id", "sample_idx", "iteration", "response_ids")


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
    - no NaN or inf in any float column.
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
                    f"{where}: column 'step_ends' points outside the response (0..len(response_ids)-1) in {first_bad(table, mask)}."
                )
    for f in table.schema:
        bad = arrow_ops.null_entry_rows(table.column(f.name))
        if bad is not None and bad.any():
            raise DataError(f"{where}: column '{f.name}' has a null entry inside its list in {first_bad(table, bad)}; "
                            f"a list may be null as a whole, but not hold nulls.")
        bad = arrow_ops.nonfinite_rows(table.column(f.name))
        if bad is not None and bad.any():
            raise DataError(f"{where}: column '{f.name}' holds NaN or inf in {first_bad(table, bad)}.")
