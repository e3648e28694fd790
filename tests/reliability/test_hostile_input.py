"""Hostile input, property-based: every bad hand-off, config or dataset ends in a PrmflowError that
names the file and the field, never a library traceback, and never an output.

Each property draws a valid input and one corruption of it; a corruption that must be refused is
asserted to be refused (so the tests can fail), one that may be harmless (a castable type, a
dropped optional column) must either work or be refused clearly. Counts go to the reliability report.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.components.data import io, schema
from prmflow.components.models import modeling
from prmflow.components.training.engine import EngineConfig
from prmflow.errors import ConfigError, DataError, PrmflowError
from prmflow.tasks.datasets import load_records
from prmflow.tracking import TrackingConfig
from prmflow.components.training import supervised_data as sft_data
from prmflow.components.sft import stage as sft

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TOKENIZER = modeling.build_tokenizer()


def tally(reliability, section: str, outcome: str) -> None:
    reliability.add(section, tried=1, **{outcome: 1})


# --- Parquet hand-offs ----------------------------------------------------------------------------

PER_TOKEN = ("old_logprobs", "ref_logprobs", "values")
FLOAT_COLUMNS = ("outcome_reward", "old_logprobs", "ref_logprobs", "values", "step_rewards")
NUMERIC_LISTS = ("response_ids", "old_logprobs", "ref_logprobs", "values", "step_ends", "step_rewards")
PRESENT = ("prompt_id", "sample_idx", "iteration", "prompt", "response", "response_ids", *PER_TOKEN,
           "step_ends", "step_rewards", "outcome_reward")


def valid_table(n_prompts: int = 2, samples: int = 2) -> pa.Table:
    rows = []
    for i in range(n_prompts * samples):
        L = 3 + i
        rows.append({"prompt_id": f"p{i // samples}", "sample_idx": i % samples, "iteration": 0, "prompt": "1+1?",
                     "response": "2", "response_ids": list(range(4, 4 + L)), "old_logprobs": [-1.0] * L,
                     "ref_logprobs": [-1.25] * L, "values": [0.5] * L, "step_ends": [0, L - 1],
                     "step_rewards": [0.25, 0.75], "outcome_reward": float(i % 2)})
    fields = [schema.ROLLOUTS.field(c) for c in PRESENT]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))


def _replace(table: pa.Table, name: str, array) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, name, array if isinstance(array, (pa.Array, pa.ChunkedArray)) else pa.array(array))


def _with_row(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return _replace(table, name, pa.array(values, table.schema.field(name).type))


@st.composite
def corrupted_tables(draw):
    """(table, column, must_fail): a valid rollouts table with one corruption applied."""
    return _corrupt(draw, valid_table(), PRESENT, PER_TOKEN, FLOAT_COLUMNS, NUMERIC_LISTS, schema.REQUIRED)


def _corrupt(draw, t: pa.Table, present, per_token, float_columns, numeric_lists, required):
    rows = t.num_rows
    row = draw(st.integers(0, rows - 1))
    kind = draw(st.sampled_from(["drop", "extra", "retype", "ragged", "nonfinite", "null_required", "null_in_list",
                                 "step_end", "duplicate"]))
    if kind == "drop":
        col = draw(st.sampled_from(present))
        return t.drop_columns([col]), col, col in required
    if kind == "extra":
        col = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
                   .filter(lambda c: c not in schema.ADVANTAGES.names))
        return t.append_column(col, pa.array(range(rows))), col, True
    if kind == "retype":
        col = draw(st.sampled_from(present))
        values = draw(st.sampled_from([
            [draw(st.text(max_size=5)) for _ in range(rows)],
            [draw(st.floats(allow_nan=False, allow_infinity=False, width=32)) for _ in range(rows)],
            [draw(st.integers(-2**40, 2**40)) for _ in range(rows)],
            [draw(st.booleans()) for _ in range(rows)],
            [[draw(st.text(max_size=3))] for _ in range(rows)],
            [{"a": 1} for _ in range(rows)],
            [b"\xff\xfe" for _ in range(rows)],
        ]))
        return _replace(t, col, values), col, False
    if kind == "ragged":
        col = draw(st.sampled_from(per_token))
        values = t.column(col).to_pylist()[row]
        delta = draw(st.sampled_from([-1, 1, 5])) if values else 1
        new = values[:delta] if delta < 0 else values + [0.0] * delta
        return _with_row(t, col, row, new), col, True
    if kind == "nonfinite":
        col = draw(st.sampled_from(float_columns))
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        if col == "outcome_reward":
            return _with_row(t, col, row, bad), col, True
        values = list(t.column(col).to_pylist()[row])
        values[draw(st.integers(0, len(values) - 1))] = bad
        return _with_row(t, col, row, values), col, True
    if kind == "null_required":
        col = draw(st.sampled_from(required))
        return _with_row(t, col, row, None), col, True
    if kind == "null_in_list":
        col = draw(st.sampled_from(numeric_lists))
        values = list(t.column(col).to_pylist()[row])
        values[draw(st.integers(0, len(values) - 1))] = None
        return _with_row(t, col, row, values), col, True
    if kind == "step_end":
        n = len(t.column("response_ids").to_pylist()[row])
        end = draw(st.sampled_from([-1, n, n + 7, 2**31 - 1]))
        return _with_row(t, "step_ends", row, [0, end]), "step_ends", True
    col = draw(st.sampled_from(present))  # duplicate
    return t.append_column(col, t.column(col)), col, True


def write_handoff(directory: Path, table: pa.Table, manifest: dict | None = None) -> Path:
    """A hand-off directory as a buggy or hostile writer would leave it: any table, a matching manifest."""
    directory.mkdir(parents=True)
    shard = directory / "part-00000.parquet"
    pq.write_table(table, shard)
    m = {"kind": "rollouts", "schema_version": schema.SCHEMA_VERSION, "rows": table.num_rows,
         "files": {shard.name: io.sha256_file(shard)}, **(manifest or {})}
    (directory / io.MANIFEST).write_text(json.dumps(m))
    return shard


def assert_clear(e: BaseException, *names: str) -> None:
    msg = str(e)
    assert isinstance(e, PrmflowError), f"{type(e).__name__} is not a PrmflowError: {e!r}"
    for name in names:
        assert name in msg, f"{name!r} not named in: {msg}"
    assert "Traceback" not in msg


@SETTINGS
@given(corrupted_tables())
def test_rollout_readers_refuse_corrupted_tables_clearly(reliability, case):
    table, col, must_fail = case
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "rollouts"
        shard = write_handoff(d, table)
        try:
            read = schema.open_dataset(d, "rollouts").read()
        except Exception as e:  # noqa: BLE001 - the property is about which exceptions appear
            assert_clear(e, str(shard), col)
            tally(reliability, "hostile/parquet-reader", "clear_error")
        else:
            assert not must_fail, f"corrupted column {col!r} was read without an error"
            assert read.num_rows == table.num_rows
            tally(reliability, "hostile/parquet-reader", "accepted_harmless")
        # the whole stage on the same input: a result only if the input was fine, else a clear error and no output
        out = Path(tmp) / "advantages"
        cfg = advantage.Config(input=str(d), output=str(out), estimator="gae", kl_coef=0.05,
                               tracking=TrackingConfig(enabled=False))
        try:
            advantage.run(cfg)
        except Exception as e:  # noqa: BLE001
            assert_clear(e, str(d))
            assert not out.exists() and not list(Path(tmp).glob(".advantages*"))
            tally(reliability, "hostile/advantage-stage", "clear_error")
        else:
            assert not must_fail, f"advantage wrote an output from corrupted column {col!r}"
            tally(reliability, "hostile/advantage-stage", "accepted_harmless")


# --- the advantages hand-off, as the ppo stage reads it ----------------------------------------------

ADV_PER_TOKEN = (*PER_TOKEN, "token_rewards", "advantages", "returns", "kl")
ADV_PRESENT = (*PRESENT, "prompt_ids", "token_rewards", "advantages", "returns", "kl")
ADV_FLOATS = (*FLOAT_COLUMNS, "token_rewards", "advantages", "returns", "kl")
ADV_LISTS = (*NUMERIC_LISTS, "prompt_ids", "token_rewards", "advantages", "returns", "kl")
#: what ppo (critic off, no KL loss) cannot train without
PPO_NEEDS = (*schema.REQUIRED, "prompt_ids", "advantages", "old_logprobs")


@functools.cache
def valid_advantages() -> pa.Table:
    """The advantage stage's own output for valid_table() (+ prompt_ids): what ppo really reads."""
    t = valid_table()
    t = t.append_column(schema.ROLLOUTS.field("prompt_ids"), pa.array([[1, 2, 3]] * t.num_rows, pa.list_(pa.int32())))
    with tempfile.TemporaryDirectory() as tmp:
        write_handoff(Path(tmp) / "rollouts", t)
        advantage.run(advantage.Config(input=str(Path(tmp) / "rollouts"), output=str(Path(tmp) / "adv"), estimator="gae",
                                       kl_coef=0.05, tracking=TrackingConfig(enabled=False)))
        return schema.read_dataset(Path(tmp) / "adv", "advantages").select(list(ADV_PRESENT))


@SETTINGS
@given(st.data())
def test_ppo_refuses_corrupted_advantages_clearly(reliability, data):
    from prmflow.components.ppo import minibatches as batch, stage as ppo

    table, col, must_fail = data.draw(st.composite(lambda draw: _corrupt(
        draw, valid_advantages(), ADV_PRESENT, ADV_PER_TOKEN, ADV_FLOATS, ADV_LISTS, PPO_NEEDS))())
    with tempfile.TemporaryDirectory() as tmp:
        d, out = Path(tmp) / "advantages", Path(tmp) / "ppo"
        write_handoff(d, table, {"kind": "advantages"})
        cfg = ppo.Config(policy="tiny-llama", input=str(d), output=str(out), minibatch_size=2,
                         micro_batch_size=2, engine=EngineConfig(backend="torch"), tracking=TrackingConfig(enabled=False))
        try:
            rows = batch.load_batch(cfg)
        except Exception as e:  # noqa: BLE001
            assert_clear(e, str(d))
            assert col in str(e), f"{col!r} not named in: {e}"  # and the directory (or its shard), above
            with pytest.raises(PrmflowError) as stage_error:  # the whole stage: the same refusal, no output
                ppo.run(cfg)
            assert_clear(stage_error.value, str(d))
            assert not out.exists() and not list(Path(tmp).glob(".ppo*"))
            tally(reliability, "hostile/ppo-advantages-reader", "clear_error")
        else:
            assert not must_fail, f"ppo read corrupted column {col!r} without an error"
            assert len(rows) == table.num_rows
            tally(reliability, "hostile/ppo-advantages-reader", "accepted_harmless")


@SETTINGS
@given(how=st.sampled_from(["empty", "truncate", "flip", "truncate_unlisted"]), where=st.floats(0, 1), byte=st.integers(0, 255))
def test_damaged_shard_files_are_named(reliability, how, where, byte):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "rollouts"
        shard = write_handoff(d, valid_table())
        raw = shard.read_bytes()
        cut = int(where * (len(raw) - 1))
        damaged = {"empty": b"", "truncate": raw[:cut], "truncate_unlisted": raw[:cut],
                   "flip": raw[:cut] + bytes([raw[cut] ^ (byte or 1)]) + raw[cut + 1:]}[how]
        shard.write_bytes(damaged)
        if how != "truncate_unlisted":  # a writer that hashed the damaged file: only Parquet itself can tell
            m = json.loads((d / io.MANIFEST).read_text())
            m["files"][shard.name] = io.sha256_file(shard)
            (d / io.MANIFEST).write_text(json.dumps(m))
        try:
            schema.open_dataset(d, "rollouts").read()
        except Exception as e:  # noqa: BLE001
            assert_clear(e, str(shard))
            tally(reliability, "hostile/damaged-shard", "clear_error")
        else:
            assert how == "flip", f"a {how} shard was read without an error"
            tally(reliability, "hostile/damaged-shard", "accepted_harmless")  # a flipped value byte: no checksum in Parquet


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=6)


@SETTINGS
@given(field=st.sampled_from(["kind", "schema_version", "files", "rows", "(whole)"]), value=json_values)
def test_hostile_manifests_are_refused_with_the_directory_named(reliability, field, value):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "rollouts"
        write_handoff(d, valid_table())
        m = json.loads((d / io.MANIFEST).read_text())
        if field == "(whole)":
            m = value
        else:
            m[field] = value
        (d / io.MANIFEST).write_text(json.dumps(m))
        try:
            schema.open_dataset(d, "rollouts").read()
        except Exception as e:  # noqa: BLE001
            assert_clear(e, str(d))
            tally(reliability, "hostile/manifest", "clear_error")
        else:
            valid = {"kind": "rollouts", "schema_version": 1, "rows": 4}
            assert field in valid and value == valid[field] and type(value) is type(valid[field]), \
                f"manifest {field}={value!r} accepted"
            tally(reliability, "hostile/manifest", "accepted_valid")


@pytest.mark.parametrize("name", ["../x.parquet", "../../etc/passwd", "/etc/passwd", "a/../../x", "\x00"])
def test_manifest_cannot_point_outside_its_directory(tmp_path, name, reliability):
    d = tmp_path / "rollouts"
    write_handoff(d, valid_table())
    (tmp_path / "x.parquet").write_bytes((d / "part-00000.parquet").read_bytes())
    m = json.loads((d / io.MANIFEST).read_text())
    m["files"] = {name: io.sha256_file(tmp_path / "x.parquet")}
    (d / io.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="escape|not a valid file name"):
        schema.open_dataset(d, "rollouts")
    tally(reliability, "hostile/manifest-escape", "clear_error")


def test_input_that_is_a_file_not_a_directory(tmp_path):
    shard = write_handoff(tmp_path / "rollouts", valid_table())
    with pytest.raises(DataError, match="is a file"):
        schema.open_dataset(shard, "rollouts")


# --- config files ---------------------------------------------------------------------------------

def _stage_configs() -> dict:
    from prmflow import stages

    return {name: module.Config for name, module in stages.available().items()}  # every `prmflow <stage>`


STAGE_CONFIGS = _stage_configs()


def _keys(cls) -> list[str]:
    return list(config.flat_fields(cls))


EDGE_VALUES = [math.nan, math.inf, -math.inf, 1e308, -1, 0, "", "null", "{", [], {}]
config_values = st.one_of(st.sampled_from(EDGE_VALUES), st.none(), st.booleans(), st.integers(-10**6, 10**20), st.floats(),
                          st.text(max_size=12),
                          st.lists(st.integers() | st.text(max_size=4), max_size=3),
                          st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@st.composite
def config_mappings(draw, cls):
    keys = _keys(cls)
    chosen = draw(st.lists(st.sampled_from(keys) | st.text("abcdefghij_.", min_size=1, max_size=10), min_size=1, max_size=4,
                           unique=True))
    return {k: draw(config_values) for k in chosen}


def _load_or_refuse(cls, path: Path, written_keys, reliability, section: str):
    try:
        cfg = config.load(cls, path)
    except Exception as e:  # noqa: BLE001
        assert_clear(e, str(path))
        assert isinstance(e, ConfigError), repr(e)
        if written_keys:
            leaves = {k.split(".")[-1] for k in written_keys} | set(written_keys) | {k.split(".")[0] for k in written_keys}
            assert any(k in str(e) for k in leaves if k), f"no key named in: {e}"
        tally(reliability, section, "clear_error")
        return None
    tally(reliability, section, "accepted_valid")
    return cfg


@pytest.mark.parametrize("stage_name", sorted(STAGE_CONFIGS))
@SETTINGS
@given(data=st.data())
def test_random_config_files_load_or_name_file_and_key(reliability, stage_name, data):
    cls = STAGE_CONFIGS[stage_name]
    mapping = data.draw(config_mappings(cls))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        nested: dict = {}
        for k, v in mapping.items():  # dotted keys, or nested sections, as a user might write either
            head, _, tail = k.partition(".")
            if tail and isinstance(nested.get(head, {}), dict) and data.draw(st.booleans()):
                nested.setdefault(head, {})[tail] = v
            else:
                nested[k] = v
        path.write_text(yaml.safe_dump(nested, allow_unicode=True))
        cfg = _load_or_refuse(cls, path, list(config.flatten(nested)), reliability, f"hostile/config-{stage_name}")
        if cfg is not None:  # accepted: every value it took is of the declared type and finite
            for key, (typ, _, _) in config.flat_fields(cls).items():
                value = cfg
                for part in key.split("."):
                    value = getattr(value, part)
                if isinstance(value, float):
                    assert math.isfinite(value), (key, value)


@pytest.mark.parametrize("text,key", [
    ("max_steps: .inf\n", "max_steps"), ("optim:\n  lr: .nan\n", "optim.lr"), ("engine: 5\n", "engine"),
    ("tracking:\n  tags: '{'\n", "tracking.tags"), ("optim:\n  warmup_steps: 800\n", "optim.warmup_steps"),
    ("optim:\n  lr_schedule: [cosine]\n", "optim.lr_schedule"), ("engine:\n  zero_stage: 1e400\n", "engine.zero_stage"),
])
def test_known_bad_sft_configs_name_file_and_key(tmp_path, text, key, reliability):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(sft.Config, path)
    assert_clear(e.value, str(path), key)
    tally(reliability, "hostile/config-known", "clear_error")


@pytest.mark.parametrize("stage_name", sorted(STAGE_CONFIGS))
@SETTINGS
@given(content=st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=60))
def test_random_yaml_text_loads_or_names_the_file(reliability, stage_name, content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_bytes(content)
        _load_or_refuse(STAGE_CONFIGS[stage_name], path, [], reliability, f"hostile/yaml-{stage_name}")


# --- JSONL datasets --------------------------------------------------------------------------------

row_values = st.one_of(json_values, st.lists(st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values}),
                                             max_size=3))
rows = st.dictionaries(st.sampled_from(["prompt", "messages", "response", "answer", "id", "prompt_id", "source", "x"]),
                       row_values | st.text(min_size=1, max_size=10), max_size=5)
good_rows = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=12).filter(str.strip)},
    optional={"response": st.text(max_size=12), "answer": st.integers() | st.text(max_size=5), "id": st.text(max_size=6)})
chat_rows = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(min_size=1, max_size=8)}),
    min_size=1, max_size=3)})
lines = st.one_of(good_rows.map(lambda r: json.dumps(r).encode()), chat_rows.map(lambda r: json.dumps(r).encode()),
                  rows.map(lambda r: json.dumps(r).encode()), st.binary(max_size=30),
                  st.text(max_size=30).map(str.encode), json_values.map(lambda v: json.dumps(v).encode()))


@SETTINGS
@given(st.lists(lines, min_size=0, max_size=4))
def test_random_jsonl_loads_or_names_file_and_line(reliability, dataset_lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in dataset_lines))
        try:
            records = load_records(path)
        except Exception as e:  # noqa: BLE001
            assert_clear(e, str(path))
            assert isinstance(e, DataError) and ("line" in str(e) or "empty" in str(e)), str(e)
            tally(reliability, "hostile/jsonl", "clear_error")
            return
        for r in records:  # what the stages rely on
            assert isinstance(r.prompt, str) and r.prompt.strip()
            assert r.response is None or isinstance(r.response, str)
            assert r.answer is None or isinstance(r.answer, str)
            assert isinstance(r.prompt_id, str)
            assert r.messages is None or all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in r.messages)
        try:  # and SFT tokenizes whatever was accepted, or says which prompt is unusable
            sft_data.tokenize(records, TOKENIZER, 64, where=str(path))
        except DataError as e:
            assert str(path) in str(e)
        tally(reliability, "hostile/jsonl", "accepted_valid")


def test_deeply_nested_jsonl_line_is_a_clear_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match="line 1"):
        load_records(path)
