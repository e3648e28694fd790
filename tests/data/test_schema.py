import json

import pyarrow as pa
import pytest

from prmflow.components.data import schema
from prmflow.errors import DataError


def rollouts(n=4, prompt="p", start=0, **override):
    rows = {
        "prompt_id": [f"{prompt}{i // 2}" for i in range(start, start + n)],
        "sample_idx": [i % 2 for i in range(start, start + n)],
        "iteration": [0] * n,
        "response_ids": [[1, 2, 3]] * n,
        "old_logprobs": [[-0.1, -0.2, -0.3]] * n,
        "step_ends": [[1, 2]] * n,
        "step_rewards": [[0.9, 0.2]] * n,
        "outcome_reward": [1.0] * n,
        "reward_components": [[("verifier", 1.0)]] * n,
    }
    rows.update(override)
    rows["reward_components"] = pa.array(rows["reward_components"], type=pa.map_(pa.string(), pa.float32()))
    return pa.table(rows)


def test_reading_some_columns_returns_just_those(tmp_path):
    out = schema.write_dataset(tmp_path / "r", rollouts(), "rollouts")
    full = schema.read_dataset(out, "rollouts")
    part = schema.read_dataset(out, "rollouts", ["response_ids", "old_logprobs"])
    assert part.column_names == ["response_ids", "old_logprobs"]
    assert part.to_pylist() == full.select(["response_ids", "old_logprobs"]).to_pylist()
    assert schema.read_dataset(out, "rollouts", ["values"]).column("values").null_count == 4  # stored as nulls


def test_round_trip_fills_missing_nullable_columns(tmp_path):
    out = schema.write_dataset(tmp_path / "r", rollouts(), "rollouts", config={"a": 1}, parents=["sft"])
    table = schema.read_dataset(out, "rollouts")
    assert table.schema.equals(schema.ROLLOUTS, check_metadata=False)
    assert table.column("old_logprobs").to_pylist()[0] == pytest.approx([-0.1, -0.2, -0.3])
    assert table.column("values").null_count == 4
    m = json.loads((out / "manifest.json").read_text())
    assert (m["rows"], m["schema_version"], m["parents"], m["config"]) == (4, 2, ["sft"], {"a": 1})


def test_shards_written_separately_read_as_one(tmp_path):
    for i in range(3):
        schema.write_dataset(tmp_path / "all" / f"shard-{i}", rollouts(4, prompt=f"s{i}-"), "rollouts")
    ds = schema.open_dataset(tmp_path / "all", "rollouts")
    t = ds.read()
    keys = list(zip(t.column("prompt_id").to_pylist(), t.column("sample_idx").to_pylist()))
    assert ds.num_rows == 12 and len(keys) == len(set(keys)) == 12


def test_writer_rotates_shards(tmp_path):
    with schema.DatasetWriter(tmp_path / "r", "rollouts", rows_per_shard=3) as w:
        w.write(rollouts(4))
        w.write(rollouts(4, start=4))
    names = sorted(p.name for p in (tmp_path / "r").glob("*.parquet"))
    assert names == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert schema.read_dataset(tmp_path / "r", "rollouts").num_rows == 8


@pytest.mark.parametrize("override,needle", [
    ({"old_logprobs": [[-0.1, -0.2]] * 4}, "column 'old_logprobs' has 2 entries but response_ids has 3 in row 0 (prompt_id='p0'"),
    ({"step_ends": [[1, 2]] * 3 + [[1, 3]]},
     "'step_ends' points outside the response (0..len(response_ids)-1) in row 3 (prompt_id='p1'"),
    ({"step_rewards": [[0.9]] * 4}, "'step_rewards' and 'step_ends' differ in length"),
    ({"outcome_reward": [1.0, float("nan"), 1.0, 1.0]}, "column 'outcome_reward' holds NaN or inf in row 1"),
    ({"old_logprobs": [[-0.1, -0.2, -0.3]] * 2 + [[-0.1, float("inf"), 0.0]] + [[-0.1, -0.2, -0.3]]},
     "column 'old_logprobs' holds NaN or inf in row 2"),
    ({"reward_components": [[("v", 1.0)]] * 3 + [[("v", float("nan"))]]}, "column 'reward_components' holds NaN or inf in row 3"),
    ({"prompt_id": ["a", None, "b", "c"]}, "column 'prompt_id' is null in row 1"),
    ({"logprob_temperature": [0.7, 0.7, 0.0, None]}, "column 'logprob_temperature' is 0.0 in row 2 (prompt_id='p1'"),
])
def test_bad_rows_are_named_and_nothing_is_written(tmp_path, override, needle):
    with pytest.raises(DataError) as e:
        schema.write_dataset(tmp_path / "r", rollouts(**override), "rollouts")
    assert needle in str(e.value)
    assert not (tmp_path / "r").exists() and list(tmp_path.iterdir()) == []


def test_wrong_columns(tmp_path):
    with pytest.raises(DataError, match="required column 'response_ids' is missing"):
        schema.conform(rollouts().drop(["response_ids"]), "rollouts")
    with pytest.raises(DataError, match=r"unexpected column\(s\) \['bogus'\]"):
        schema.conform(rollouts().append_column("bogus", pa.array([1] * 4)), "rollouts")
    with pytest.raises(DataError, match="column 'outcome_reward' has type string"):
        schema.conform(rollouts(outcome_reward=["x"] * 4), "rollouts")


def test_reader_checks_manifest_version_and_kind(tmp_path):
    out = schema.write_dataset(tmp_path / "r", rollouts(), "rollouts")
    with pytest.raises(DataError, match="holds a 'rollouts' hand-off, but a 'advantages' one is needed here: "
                                        "point the input at the output of advantage"):
        schema.open_dataset(out, "advantages")
    m = json.loads((out / "manifest.json").read_text())
    m["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="schema version 99"):
        schema.open_dataset(out, "rollouts")


def test_truncated_shard_is_caught(tmp_path):
    out = schema.write_dataset(tmp_path / "r", rollouts(), "rollouts")
    shard = out / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(DataError, match="does not match the sha256"):
        schema.open_dataset(out, "rollouts")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(schema.open_dataset(out, "rollouts", verify_checksums=False).iter_batches())


def test_empty_output_is_refused(tmp_path):
    with pytest.raises(DataError, match="empty"):
        schema.write_dataset(tmp_path / "r", rollouts().slice(0, 0), "rollouts")
    assert not (tmp_path / "r").exists()


def test_missing_input_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        schema.open_dataset(tmp_path / "nope", "rollouts")
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="no manifest.json"):
        schema.open_dataset(tmp_path / "half", "rollouts")
