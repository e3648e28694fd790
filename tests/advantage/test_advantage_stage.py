"""The advantage stage end to end: values checked by hand, bad input, config errors, tracking."""

import json
import math
import os
import re
from pathlib import Path

import advantage_reference as ref
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prmflow.components.advantage import stage
from prmflow.components.advantage.estimators import ESTIMATORS
from prmflow.components import config
from prmflow.components.data import schema
from prmflow.errors import ConfigError, DataError, OutputExistsError
from prmflow.tracking import TrackingConfig

OFF = TrackingConfig(enabled=False)


def make_cfg(tmp_path, **options) -> stage.Config:
    if options.get("estimator") == "grpo_progress":  # these tests were written for the uncalibrated credit (the default
        options.setdefault("process_calibration", "none")  # before grpo_progress alone meant the recipe); others name it
    return stage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "advantages"), tracking=OFF,
                        **options)


def write_rows(tmp_path, rows: list[dict], validated=False) -> None:
    """Write rollouts; validated=True skips the writer's checks, to plant bad data for the reader."""
    with schema.DatasetWriter(tmp_path / "rollouts", "rollouts") as w:
        w.write(pa.Table.from_pylist(rows), validated=validated)


def row(pid="p0", idx=0, n=3, **override) -> dict:
    base = {"prompt_id": pid, "sample_idx": idx, "iteration": 0, "response_ids": list(range(n)),
            "old_logprobs": [-1.0] * n, "ref_logprobs": [-1.0] * n, "values": [0.0] * n,
            "step_ends": [n - 1], "step_rewards": [0.5], "outcome_reward": 1.0}
    return {**base, **override}


def read_out(tmp_path) -> list[dict]:
    return schema.read_dataset(tmp_path / "advantages", "advantages").to_pylist()


def assert_nothing_written(tmp_path):
    assert not (tmp_path / "advantages").exists()
    assert not list(tmp_path.glob(".advantages*"))  # no temporary sibling left behind


# --- values checked by hand -------------------------------------------------------------------------

def test_gae_by_hand(tmp_path):
    # x = old - ref = [0, 1, 0] -> k1 = [0, 1, 0]; r = -0.1*kl + 0.8 at step end 1 + outcome 1 at t=2
    write_rows(tmp_path, [row(old_logprobs=[-1.0, -1.0, -1.0], ref_logprobs=[-1.0, -2.0, -1.0],
                              values=[0.5, 0.2, 0.1], step_ends=[1], step_rewards=[0.8], outcome_reward=1.0)])
    summary = stage.run(make_cfg(tmp_path, estimator="gae", gamma=0.9, lam=0.8, kl_coef=0.1))
    out, = read_out(tmp_path)
    # delta_t = r_t + 0.9*V_{t+1} - V_t: d2 = 1 - 0.1 = 0.9; d1 = 0.7 + 0.09 - 0.2 = 0.59; d0 = 0.18 - 0.5 = -0.32
    # A_t = d_t + 0.72*A_{t+1}: A2 = 0.9; A1 = 0.59 + 0.648 = 1.238; A0 = -0.32 + 0.72*1.238 = 0.57136
    assert out["token_rewards"] == pytest.approx([0.0, 0.7, 1.0])
    assert out["kl"] == pytest.approx([0.0, 1.0, 0.0])
    assert out["advantages"] == pytest.approx([0.57136, 1.238, 0.9], abs=1e-6)
    assert out["returns"] == pytest.approx([1.07136, 1.438, 1.0], abs=1e-6)
    manifest = json.loads((tmp_path / "advantages" / "manifest.json").read_text())
    assert manifest["kind"] == "advantages" and manifest["rows"] == 1 and manifest["config"]["estimator"] == "gae"
    assert summary["advantage/tokens_out"] == 3 and summary["advantage/kl_mean"] == pytest.approx(1 / 3)


def test_step_estimators_credit_the_end_of_a_response(tmp_path):
    # grpo_process, one group: row 0 has steps ending at 1 and 3 of 6 tokens (tokens 4-5: EOS and what
    # follows the last step end), row 1 is whitespace with no step, row 2 one step. Step scores
    # [0.9, 0.6], [] (scored 0), [0.3]: mean 0.45, std (ddof=1) of [0.9, 0.6, 0, 0.3] = sqrt(0.15)
    write_rows(tmp_path, [row(idx=0, n=6, step_ends=[1, 3], step_rewards=[0.9, 0.6], outcome_reward=1.0),
                          row(idx=1, n=2, step_ends=[], step_rewards=[], outcome_reward=0.0),
                          row(idx=2, n=3, step_ends=[2], step_rewards=[0.3], outcome_reward=0.0)])
    stage.run(make_cfg(tmp_path, estimator="grpo_process"))
    out = {r["sample_idx"]: r["advantages"] for r in read_out(tmp_path)}
    z = {x: (x - 0.45) / math.sqrt(0.15) for x in (0.9, 0.6, 0.0, 0.3)}
    # the last step runs to the last token: tokens 4 and 5 carry step 1's credit, not 0
    assert out[0] == pytest.approx([z[0.9] + z[0.6]] * 2 + [z[0.6]] * 4, abs=1e-5)
    assert out[1] == pytest.approx([z[0.0]] * 2, abs=1e-5) and z[0.0] < 0  # pushed down, not left at 0
    # grpo_progress: the tokens after the last step end get the last step's process credit too
    rows = [row(idx=0, n=6, step_ends=[1, 3], step_rewards=[0.2, 0.9], outcome_reward=1.0),
            row(idx=1, n=6, step_ends=[1, 3], step_rewards=[0.8, 0.9], outcome_reward=1.0),
            row(idx=2, n=6, step_ends=[1, 3], step_rewards=[0.5, 0.1], outcome_reward=0.0),
            row(idx=3, n=4, step_ends=[], step_rewards=[], outcome_reward=0.0)]
    d = tmp_path / "progress"
    d.mkdir()
    write_rows(d, rows)
    stage.run(make_cfg(d, estimator="grpo_progress", step_reward_mode="progress", process_weight=0.5,
                       process_auc_min=0.0, process_auc_full=0.0))
    adv = {r["sample_idx"]: r["advantages"] for r in read_out(d)}
    for i in (0, 1, 2):
        assert adv[i][4] == adv[i][5] == adv[i][2]  # EOS is credited as the last step's tokens are
    assert adv[0][2] != adv[0][0]  # and that credit is not the outcome advantage alone
    assert len(set(adv[3])) == 1 and adv[3][0] < 0  # no step end: its outcome advantage on every token


def test_grpo_and_rloo_by_hand(tmp_path):
    write_rows(tmp_path, [row(idx=i, n=2 + i, outcome_reward=r) for i, r in enumerate([1.0, 0.0, 0.0])])
    stage.run(make_cfg(tmp_path, estimator="grpo"))
    grpo = {r["sample_idx"]: r["advantages"] for r in read_out(tmp_path)}
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # sample std (ddof=1) of [1, 0, 0]
    assert grpo[0] == pytest.approx([(2 / 3) / std] * 2, rel=1e-5)  # one value on every token
    assert grpo[2] == pytest.approx([(-1 / 3) / std] * 4, rel=1e-5)
    stage.run(make_cfg(tmp_path, estimator="rloo", overwrite=True))
    rloo = {r["sample_idx"]: r["advantages"][0] for r in read_out(tmp_path)}
    assert rloo == pytest.approx({0: 1.0, 1: -0.5, 2: -0.5})  # R_i - mean of the other two


def test_grpo_process_by_hand(tmp_path):
    # group step rewards [0.2, 0.8, 0.5]: mean 0.5, std (ddof=1) 0.3
    write_rows(tmp_path, [row(idx=0, n=4, step_ends=[1, 3], step_rewards=[0.2, 0.8]),
                          row(idx=1, n=2, step_ends=[0], step_rewards=[0.5])])
    stage.run(make_cfg(tmp_path, estimator="grpo_process"))
    out = {r["sample_idx"]: r for r in read_out(tmp_path)}
    lo, hi = (0.2 - 0.5) / 0.3, (0.8 - 0.5) / 0.3
    assert out[0]["advantages"] == pytest.approx([lo + hi, lo + hi, hi, hi], abs=1e-5)
    assert out[1]["advantages"] == pytest.approx([0.0, 0.0], abs=1e-5)  # its step is the group mean; none after t=0
    assert out[0]["token_rewards"] == pytest.approx([0.0, 0.2, 0.0, 0.8])  # raw scores, no outcome


def test_min_form_keeps_only_the_worst_step(tmp_path):
    write_rows(tmp_path, [row(n=5, step_ends=[0, 2, 4], step_rewards=[0.9, 0.1, 0.7], outcome_reward=0.0)])
    stage.run(make_cfg(tmp_path, estimator="reinforce", step_reward_mode="min"))
    out, = read_out(tmp_path)
    assert out["token_rewards"] == pytest.approx([0, 0, 0.1, 0, 0])
    assert out["advantages"] == pytest.approx([0.1, 0.1, 0.1, 0, 0])


# --- zero-variance groups -------------------------------------------------------------------------

def equal_and_mixed_groups() -> list[dict]:
    return [row("same", 0, outcome_reward=1.0), row("same", 1, outcome_reward=1.0),
            row("mixed", 0, outcome_reward=1.0), row("mixed", 1, outcome_reward=0.0), row("single", 0)]


@pytest.mark.parametrize("mode", ["keep", "drop", "downweight"])
def test_zero_variance_groups(tmp_path, mode):
    write_rows(tmp_path, equal_and_mixed_groups())
    summary = stage.run(make_cfg(tmp_path, estimator="reinforce", step_rewards=False, zero_variance=mode,
                                 zero_variance_weight=0.25))
    out = {(r["prompt_id"], r["sample_idx"]): r["advantages"] for r in read_out(tmp_path)}
    # one of three groups: a single sample is not a zero-variance group
    assert summary["advantage/zero_variance_groups"] == pytest.approx(1 / 3)
    assert summary["advantage/zero_variance_group_count"] == 1
    if mode == "drop":
        assert sorted(out) == [("mixed", 0), ("mixed", 1), ("single", 0)] and summary["advantage/rows_out"] == 3
    else:
        assert out[("same", 0)] == pytest.approx([0.25 if mode == "downweight" else 1.0] * 3)
        assert out[("mixed", 0)] == pytest.approx([1.0] * 3)


def test_dropping_every_group_is_an_error(tmp_path):
    write_rows(tmp_path, [row("a", 0), row("a", 1)])
    with pytest.raises(DataError, match="zero_variance=drop"):
        stage.run(make_cfg(tmp_path, estimator="grpo", zero_variance="drop"))
    assert_nothing_written(tmp_path)


# --- bad input: a DataError naming prompt_id and column, nothing written ------------------------------

BAD_ROWS = {
    "lengths disagree": ([row("p1", values=[0.0, 0.0])], "values", {"estimator": "gae"}),
    "logprobs too long": ([row("p1", old_logprobs=[-1.0] * 4)], "old_logprobs", {"estimator": "gae"}),
    "step end outside": ([row("p1", step_ends=[3])], "step_ends", {"estimator": "gae"}),
    "NaN logprob": ([row("p1", ref_logprobs=[-1.0, float("nan"), -1.0])], "ref_logprobs",
                    {"estimator": "reinforce", "kl_coef": 0.1}),
    "inf outcome": ([row("p1", outcome_reward=float("inf"))], "outcome_reward", {"estimator": "gae"}),
    "NaN value": ([row("p1", values=[0.0, float("-inf"), 0.0])], "values", {"estimator": "gae"}),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_fail_with_prompt_and_column_and_write_nothing(tmp_path, case):
    bad, column, options = BAD_ROWS[case]
    good = [row("p0", i) for i in range(2)] + [row("p1", 1), row("p2", 0), row("p2", 1)]
    write_rows(tmp_path, good + bad, validated=True)  # the bad row comes in the last batch
    with pytest.raises(DataError) as e:
        stage.run(make_cfg(tmp_path, batch_rows=2, **options))
    assert f"'{column}'" in str(e.value) and "p1" in str(e.value)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("estimator", [n for n, e in sorted(ESTIMATORS.items()) if e.min_group_size > 1])
def test_single_sample_group_fails_for_group_estimators(tmp_path, estimator):
    write_rows(tmp_path, [row("ok", 0, outcome_reward=1.0), row("ok", 1, outcome_reward=0.0), row("lonely", 0)])
    with pytest.raises(DataError, match=r"prompt_id='lonely'.*column 'prompt_id'.*at least 2"):
        stage.run(make_cfg(tmp_path, estimator=estimator,
                           **({"step_reward_mode": "progress"} if ESTIMATORS[estimator].process else {})))
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("missing,options,key", [
    ("values", {"estimator": "gae"}, "estimator"),
    ("ref_logprobs", {"estimator": "reinforce", "kl_coef": 0.05}, "kl_coef=0"),
    ("step_rewards", {"estimator": "gae"}, "step_rewards=false"),
    ("step_rewards", {"estimator": "grpo_process"}, "grpo"),
    ("outcome_reward", {"estimator": "reinforce"}, "outcome_reward=false"),
])
def test_missing_column_names_it_and_the_config_key(tmp_path, missing, options, key):
    rows = [row("p", i) for i in range(2)]
    for r in rows:
        del r[missing]
    if missing == "step_rewards":
        for r in rows:
            del r["step_ends"]
    write_rows(tmp_path, rows)
    with pytest.raises(DataError) as e:
        stage.run(make_cfg(tmp_path, **options))
    assert f"'{missing}'" in str(e.value) and key in str(e.value)
    assert_nothing_written(tmp_path)


def test_null_in_one_row_names_that_row(tmp_path):
    rows = [row("p0", 0), row("p0", 1), row("p7", 0), row("p7", 1, values=None)]
    write_rows(tmp_path, rows)
    with pytest.raises(DataError, match=r"'values' is null for prompt_id='p7', sample_idx=1"):
        stage.run(make_cfg(tmp_path, estimator="gae", batch_rows=2))
    assert_nothing_written(tmp_path)


def test_kl_is_null_where_logprobs_are_missing_and_kl_is_off(tmp_path):
    write_rows(tmp_path, [row("p", 0, ref_logprobs=None), row("p", 1, outcome_reward=0.0)])
    stage.run(make_cfg(tmp_path, estimator="grpo"))
    out = {r["sample_idx"]: r["kl"] for r in read_out(tmp_path)}
    assert out == {0: None, 1: [0.0, 0.0, 0.0]}


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    write_rows(tmp_path, [row("p", 0), row("p", 1, outcome_reward=0.0)])
    stage.run(make_cfg(tmp_path, estimator="grpo"))
    with pytest.raises(OutputExistsError):
        stage.run(make_cfg(tmp_path, estimator="rloo"))
    stage.run(make_cfg(tmp_path, estimator="rloo", overwrite=True))
    assert json.loads((tmp_path / "advantages" / "manifest.json").read_text())["config"]["estimator"] == "rloo"


def test_shards_dictionary_encode_only_repeating_columns(tmp_path):
    write_rows(tmp_path, [row("p", 0, prompt="same prompt"), row("p", 1, prompt="same prompt", outcome_reward=0.0)])
    stage.run(make_cfg(tmp_path, estimator="grpo"))
    meta = pq.ParquetFile(next((tmp_path / "advantages").glob("part-*.parquet"))).metadata
    dictionary = {meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)
                  if any("DICTIONARY" in e for e in meta.row_group(0).column(i).encodings)}
    assert {"prompt_id", "prompt"} <= dictionary and not dictionary & {"advantages", "old_logprobs", "response_ids"}


# --- KL controller state ----------------------------------------------------------------------------

def test_kl_state_overrides_kl_coef(tmp_path):
    write_rows(tmp_path, [row(ref_logprobs=[-1.0, -3.0, -1.0], step_rewards=[0.0], outcome_reward=0.0)])
    state = tmp_path / "kl.json"
    state.write_text(json.dumps({"kl_coef": 0.25}))
    summary = stage.run(make_cfg(tmp_path, estimator="reinforce", kl_coef=0.01, kl_state=str(state)))
    assert read_out(tmp_path)[0]["token_rewards"] == pytest.approx([0.0, -0.5, 0.0])  # -0.25 * (-1 - -3)
    assert summary["advantage/kl_coef"] == 0.25
    assert json.loads((tmp_path / "advantages" / "manifest.json").read_text())["kl_coef_used"] == 0.25
    # a ppo output directory holding kl_state.json works too (what the pipeline passes along)
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / "kl_state.json").write_text(json.dumps({"kl_coef": 0.5, "mode": "adaptive"}))
    stage.run(make_cfg(tmp_path, estimator="reinforce", kl_state=str(tmp_path / "ppo"), overwrite=True))
    assert read_out(tmp_path)[0]["token_rewards"] == pytest.approx([0.0, -1.0, 0.0])


@pytest.mark.parametrize("content", [None, "not json", '{"beta": 1}', '{"kl_coef": -1}'])
def test_bad_kl_state_is_a_config_error(tmp_path, content):
    write_rows(tmp_path, [row()])
    state = tmp_path / "kl.json"
    if content is not None:
        state.write_text(content)
    with pytest.raises(ConfigError, match="kl_state"):
        stage.run(make_cfg(tmp_path, estimator="reinforce", kl_state=str(state)))
    assert_nothing_written(tmp_path)


# --- config ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,key", [
    ({"estimator": "ppo"}, "estimator"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"gamma": 1.5}, "gamma"),
    ({"lam": -0.1}, "lam"),
    ({"estimator": "grpo", "step_rewards": True}, "step_rewards=false"),
    ({"estimator": "grpo", "kl_coef": 0.1}, "kl_coef=0"),
    ({"estimator": "grpo", "outcome_reward": False}, "outcome_reward=true"),
    ({"estimator": "grpo_process", "outcome_reward": True}, "outcome_reward=false"),
    ({"estimator": "grpo_process", "step_reward_mode": "min"}, "step_reward_mode=raw"),
    ({"estimator": "gae", "outcome_reward": False, "step_rewards": False}, "at least one"),
    ({"zero_variance": "ignore"}, "zero_variance"),
    ({"norm_eps": 0.0}, "norm_eps"),
])
def test_bad_config_names_the_key(options, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        stage.Config(input="in", output="out", tracking=OFF, **options)


def test_empty_switches_follow_the_estimator_through_overrides():
    # config.load builds once from defaults and again with the overrides: resolved values must not stick
    cfg = config.load(stage.Config, None, {"estimator": "grpo", "input": "in", "output": "out"})
    assert cfg.switches() == (True, False, False)
    cfg = config.load(stage.Config, None, {"estimator": "reinforce_baseline"})
    assert cfg.switches() == (True, True, True)
    assert stage.Config().switches() == (False, True, False)  # grpo_process


def test_docs_cover_every_estimator():
    # every key's README row is generated and checked for every stage in tests/test_docs.py
    docs = config.field_docs(stage.Config)
    readme = (Path(stage.__file__).parent / "README.md").read_text()
    for name in ESTIMATORS:
        assert f"`{name}`" in readme and name in docs["estimator"]
    title, command = stage.__doc__.strip().split("\n\n")[:2]  # the house layout: a title line, then the command
    assert command.strip().startswith("prmflow advantage --input ROLLOUTS_DIR --output ADV_DIR")


def test_the_pipeline_step_runs_where_torch_cannot_be_imported(tmp_path):
    """The advantage step (the CPU pool's, started once per iteration) needs numpy and pyarrow only;
    importing torch cost ~1.5 s of every start. Its KFP component function, called as kfp calls it,
    in a process where torch is made unimportable."""
    import subprocess
    import sys

    write_rows(tmp_path, [row(pid="p0", idx=0, outcome_reward=1.0), row(pid="p0", idx=1, outcome_reward=0.0)])
    code = f"""
import sys
sys.modules["torch"] = None
from types import SimpleNamespace as A
from prmflow.pipelines.kfp_components import advantage
out = A(path={str(tmp_path / "advantages")!r}, metadata={{}})
advantage({{"estimator": "grpo", "tracking": {{"enabled": False}}}}, "", "prmflow", 0,
          [A(path={str(tmp_path / "rollouts")!r})], out)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["advantages"][0] > 0 for r in read_out(tmp_path)] == [True, False]


def test_the_command_runs_where_torch_cannot_be_imported(tmp_path):
    """`prmflow advantage` (what a local re-run of the CPU pool's step runs in the image) imports only its
    own stage: the other stages' modules pull in torch and transformers. `--help` too."""
    import subprocess
    import sys

    write_rows(tmp_path, [row(pid="p0", idx=0, outcome_reward=1.0), row(pid="p0", idx=1, outcome_reward=0.0)])
    code = f"""
import sys
sys.modules["torch"] = None
from prmflow import cli
sys.exit(cli.main(["advantage", "--input", {str(tmp_path / "rollouts")!r}, "--output", {str(tmp_path / "advantages")!r},
                   "--estimator", "grpo", "--tracking.enabled", "false"]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["advantages"][0] > 0 for r in read_out(tmp_path)] == [True, False]
    code = "import sys; sys.modules['torch'] = None; from prmflow import cli; cli.main(['advantage', '--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--estimator" in result.stdout and "--kl_coef" in result.stdout


# --- tracking ---------------------------------------------------------------------------------------------

def test_metrics_are_logged_under_their_names(tmp_path, monkeypatch):
    calls = {}

    class Recorder:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls["finished"] = exc[0] is None

        def log_metrics(self, metrics, step=None):
            calls["metrics"], calls["step"] = metrics, step

    def start(cfg, stage, params, iteration):
        calls["start"] = (stage, iteration, params["estimator"])
        return Recorder()

    monkeypatch.setattr(stage, "start_stage_run", start)
    write_rows(tmp_path, ref.random_rollouts(np.random.default_rng(0)).to_pylist())
    summary = stage.run(make_cfg(tmp_path, estimator="gae", kl_coef=0.1, iteration=4))
    assert calls["start"] == ("advantage", 4, "gae") and calls["step"] == 4 and calls["finished"]
    for name in ("advantage/advantage_mean", "advantage/advantage_std", "advantage/return_mean", "advantage/kl_mean",
                 "advantage/zero_variance_groups", "perf/tokens_per_s"):
        assert math.isfinite(calls["metrics"][name]), name
    written = read_out(tmp_path)
    advantages = np.concatenate([r["advantages"] for r in written])
    assert summary["advantage/advantage_mean"] == pytest.approx(advantages.mean(), abs=1e-6)
    assert summary["advantage/advantage_std"] == pytest.approx(advantages.std(), abs=1e-6)
    assert summary["advantage/return_mean"] == pytest.approx(np.concatenate([r["returns"] for r in written]).mean(),
                                                         abs=1e-6)


def test_the_one_line_recipe_is_logged_as_it_ran(tmp_path, monkeypatch):
    """`estimator: grpo_progress` alone: the stage run's MLflow params are the recipe's six keys as they ran, not
    the empty values of the file, so runs compare by what they computed."""
    from prmflow.components.advantage.config import RECIPE

    logged = {}

    class Recorder:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def log_metrics(self, metrics, step=None):
            pass

    def start(cfg, stage, params, iteration):
        logged.update(params)
        return Recorder()

    monkeypatch.setattr(stage, "start_stage_run", start)
    write_rows(tmp_path, ref.random_rollouts(np.random.default_rng(0)).to_pylist())
    stage.run(stage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "advantages"), tracking=OFF,
                           estimator="grpo_progress"))
    assert {k: logged[k] for k in RECIPE} == RECIPE


def test_a_stage_run_prints_mlflows_info_lines_only_when_verbose(tmp_path):
    """A tracked `prmflow <stage>` run: MLflow's INFO lines (store set-up, system metrics started and
    stopped) are noise on a user's console; `-v` brings them back. The run is tracked either way."""
    import subprocess
    import sys

    write_rows(tmp_path, [row(pid="p0", idx=0, outcome_reward=1.0), row(pid="p0", idx=1, outcome_reward=0.0)])
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_LOGGING_LEVEL"}
    for verbose in (False, True):
        store = tmp_path / f"mlflow-{verbose}.db"
        out = tmp_path / f"advantages-{verbose}"
        argv = ["advantage", "--input", str(tmp_path / "rollouts"), "--output", str(out), "--estimator", "grpo",
                "--tracking.uri", f"sqlite:///{store}", "--tracking.system_metrics_interval_s", "1"]
        result = subprocess.run([sys.executable, "-m", "prmflow.cli", *(["-v"] if verbose else []), *argv],
                                capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        mlflow_info = [line for line in result.stderr.splitlines() if "INFO mlflow" in line]
        assert bool(mlflow_info) is verbose, result.stderr[-3000:]
        assert (out / "manifest.json").is_file() and store.is_file()
