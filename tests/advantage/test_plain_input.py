"""Rollouts and advantages made by another tool: plain Parquet with the contract's columns, no prmflow
manifest. advantage and ppo read them after checking columns and types, and say that no checksum
was verified; the reference for what they compute is the same table written as a prmflow hand-off."""

from __future__ import annotations

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prmflow import cli
from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.components.data import schema
from prmflow.errors import DataError, OutputExistsError
from prmflow.tracking import TrackingConfig
from prmflow.components.ppo import stage as ppo

OFF = TrackingConfig(enabled=False)


def rollout_rows(n_prompts=3, group=4, length=5) -> list[dict]:
    """Rows as another tool writes them: Python ints and floats (int64, double in Parquet)."""
    rows = []
    for p in range(n_prompts):
        for k in range(group):
            n = length - (k % 2)
            rows.append({"prompt_id": f"q{p}", "sample_idx": k, "iteration": 0, "prompt": f"question {p}",
                         "response": "x" * n, "prompt_ids": [5, 6, 7 + p], "response_ids": [8 + (t + k) % 20 for t in range(n)],
                         "finish_reason": "stop", "old_logprobs": [-1.0 - 0.1 * t for t in range(n)],
                         "ref_logprobs": [-1.05 - 0.1 * t for t in range(n)], "step_ends": [1, n - 1],
                         "step_rewards": [0.2 * k, 0.9 - 0.1 * p], "outcome_reward": float((p + k) % 2)})
    return rows


def write_plain(directory, rows, files=2):
    directory.mkdir()
    half = len(rows) // files
    for i in range(files):
        part = rows[i * half:(i + 1) * half if i < files - 1 else None]
        pq.write_table(pa.Table.from_pylist(part), directory / f"rollouts-{i}.parquet")
    return directory


def advantages_of(path):
    return schema.read_dataset(path, "advantages").select(["prompt_id", "sample_idx", "advantages", "returns", "kl"])


def test_advantage_reads_a_plain_directory_as_it_reads_a_handoff(tmp_path, caplog):
    rows = rollout_rows()
    plain = write_plain(tmp_path / "plain", rows)
    schema.write_dataset(tmp_path / "handoff", pa.Table.from_pylist(rows), "rollouts")
    args = ["advantage", "--estimator", "reinforce_baseline", "--kl_coef", "0.05", "--tracking.enabled", "false"]
    with caplog.at_level(logging.WARNING, logger="prmflow.components.data.schema"):
        assert cli.main(args + ["--input", str(plain), "--output", str(tmp_path / "a_plain")]) == 0
    assert "has no manifest.json" in caplog.text and "no checksum was verified" in caplog.text
    assert cli.main(args + ["--input", str(tmp_path / "handoff"), "--output", str(tmp_path / "a_ref")]) == 0
    got, want = advantages_of(tmp_path / "a_plain"), advantages_of(tmp_path / "a_ref")
    assert got.num_rows == len(rows) and got.equals(want)
    # a re-run on the same plain input is recognised (its bytes are fingerprinted) and does nothing
    assert advantage.run(advantage.Config(input=str(plain), output=str(tmp_path / "a_plain"), estimator="reinforce_baseline",
                                          kl_coef=0.05, tracking=OFF))["advantage/rows_out"] == len(rows)
    # another tool rewrites a file with two rewards swapped (same size, same row count): a re-run must
    # not take the old result for the new data
    second = [dict(r) for r in rows[6:]]
    second[0]["outcome_reward"], second[1]["outcome_reward"] = second[1]["outcome_reward"], second[0]["outcome_reward"]
    size = (plain / "rollouts-1.parquet").stat().st_size
    pq.write_table(pa.Table.from_pylist(second), plain / "rollouts-1.parquet")
    assert (plain / "rollouts-1.parquet").stat().st_size == size and second[0] != rows[6]
    with pytest.raises(OutputExistsError, match="different inputs"):
        advantage.run(advantage.Config(input=str(plain), output=str(tmp_path / "a_plain"), estimator="reinforce_baseline",
                                       kl_coef=0.05, tracking=OFF))


def test_a_single_plain_parquet_file(tmp_path):
    rows = rollout_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    advantage.run(advantage.Config(input=str(tmp_path / "r.parquet"), output=str(tmp_path / "adv"), estimator="grpo",
                                   kl_coef=0.0, tracking=OFF))
    assert schema.read_dataset(tmp_path / "adv", "advantages").num_rows == len(rows)


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.drop_columns(["response_ids"]), r"rollouts-0.parquet': column 'response_ids' is missing"),
    (lambda t: t.set_column(t.schema.get_field_index("outcome_reward"), "outcome_reward",
                            pa.array(["high"] * t.num_rows)),
     r"rollouts-0.parquet'?: column 'outcome_reward' has type string, expected float"),
    (lambda t: t.append_column("reward", pa.array([1.0] * t.num_rows)),
     r"rollouts-0.parquet': unexpected column\(s\) \['reward'\]"),
    (lambda t: t.set_column(t.schema.get_field_index("step_rewards"), "step_rewards",
                            pa.array([[0.5]] * t.num_rows)),  # one reward for two step ends: a row-level check
     r"rollouts-0.parquet: column 'step_rewards' and 'step_ends' differ in length in row 0 \(prompt_id='q0'"),
])
def test_wrong_columns_or_types_name_the_file_and_column_and_write_nothing(tmp_path, edit, needle, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(edit(pa.Table.from_pylist(rollout_rows())), plain / "rollouts-0.parquet")
    code = cli.main(["advantage", "--input", str(plain), "--output", str(tmp_path / "adv"), "--estimator", "grpo",
                     "--tracking.enabled", "false"])
    assert code == 2
    assert re.search(needle, capsys.readouterr().err.replace("\n", " ")), needle
    assert not (tmp_path / "adv").exists() and not list(tmp_path.glob(".adv*"))


def test_a_directory_with_neither_manifest_nor_parquet_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="has no manifest.json and no .parquet files"):
        schema.open_dataset(tmp_path / "empty", "rollouts")


def test_ppo_trains_on_plain_advantages_exactly_as_on_a_handoff(tmp_path):
    """Another tool's advantages (plain Parquet) give the same update as the same rows in a hand-off."""
    rows = rollout_rows(n_prompts=2, group=4)
    for r in rows:
        n = len(r["response_ids"])
        r.update(advantages=[(-1.0) ** r["sample_idx"] * 0.5] * n, returns=[0.0] * n, kl=[0.0] * n,
                 token_rewards=[0.0] * n)
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), plain / "part-0.parquet")
    schema.write_dataset(tmp_path / "handoff", pa.Table.from_pylist(rows), "advantages")
    fast = {"tracking.enabled": False, "engine.backend": "torch", "optim.lr": 1e-3, "policy": "tiny-llama",
            "epochs": 1, "minibatch_size": 8, "micro_batch_size": 4}
    for name, src in (("from_plain", plain), ("from_handoff", tmp_path / "handoff")):
        ppo.run(config.load(ppo.Config, overrides={**fast, "input": str(src), "output": str(tmp_path / name)}))
    from safetensors.torch import load_file

    a = load_file(tmp_path / "from_plain" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "from_handoff" / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    updates = [(tmp_path / name / "updates.jsonl").read_text().splitlines() for name in ("from_plain", "from_handoff")]
    assert len(updates[0]) == 1 and [json.loads(u)["policy_loss"] for u in updates[0]] == \
        [json.loads(u)["policy_loss"] for u in updates[1]]
