"""benchmarks/experiments/prm_vs_outcome.py: its numbers against hand counts, and a tiny run of the real command."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"))

import prm_vs_outcome as bench  # noqa: E402
import prm_vs_outcome_stats as bs  # noqa: E402


def test_response_stats_against_hand_counts():
    responses = ["1+2=3\n3*2=6\nanswer: 6",  # 3 steps
                 "1+2*2=6\nanswer: 6\n",      # 2 steps, one a shortcut; a trailing newline is no step
                 "answer: 5",                 # 1 step, no separator
                 "  garbage  \n"]             # 1 step, no separator once stripped, no answer line
    got = bs.response_stats(responses, [10, 8, 4, 2])
    assert got == pytest.approx({"steps_per_response": 7 / 4, "response_length": 24 / 4, "no_separator": 2 / 4,
                                 "format_errors": 1 / 4, "shortcut_share": 1 / 7})


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_prompts():
    a = [1, 1, 1, 1, 0, 0, 1, 0]
    b = [1, 0, 0, 0, 0, 1, 1, 0]
    assert bs.mcnemar(a, b) == (3, 1, pytest.approx(10 / 16))  # P(X <= 1) + P(X >= 3), X ~ Bin(4, 1/2)
    assert bs.mcnemar([1] * 8 + [0] + [1], [0] * 8 + [1] + [1]) == (8, 1, pytest.approx(2 * 10 / 512))
    assert bs.mcnemar([1, 0], [1, 0]) == (0, 0, 1.0)


def _run(pass1: list[float], correct: list[int], batch: int = 100) -> dict:
    points = [{"rollouts": k * batch, "pass1": p, "eval/steps_per_response": 3.0, "eval/shortcut_share": 0.2,
               "eval/no_separator": 0.0, "eval/format_errors": 0.0, "eval/response_length": 20.0} for k, p in enumerate(pass1)]
    for k, p in enumerate(points[:-1]):
        p["train_reward"] = 0.1 * (k + 1)
    return {"points": points, "final_correct": correct}


def test_summary_table_against_a_hand_computed_example():
    results = {
        "ref": {0: _run([0.4, 0.5, 0.5], [1, 0, 0, 1]), 1: _run([0.4, 0.5, 0.55], [1, 1, 0, 0])},
        "new": {0: _run([0.4, 0.55, 0.6], [1, 1, 1, 1]), 1: _run([0.4, 0.6, 0.7], [1, 1, 1, 0])},
    }
    rows = {r["variant"]: r for r in bs.summarize(results, "ref")}
    new = rows["new"]
    assert new["pass1_mean"] == pytest.approx(0.65) and (new["pass1_min"], new["pass1_max"]) == (0.6, 0.7)
    # ref ends at mean 0.525; new's seed mean is 0.575 after 100 rollouts (the ref needed 200 to reach 0.5)
    assert new["rollouts_to_reference"] == 100 and rows["ref"]["rollouts_to_reference"] == 200
    assert new["mcnemar"] == [(0, 2, 0, pytest.approx(0.5)), (1, 1, 0, pytest.approx(1.0))]
    # paired t over seeds: differences 0.1 and 0.15, t = 0.125 / (0.0354 / sqrt 2) = 5 on 1 df (Cauchy)
    assert new["seed_p"] == pytest.approx(1 - 2 * math.atan(5) / math.pi)
    assert math.isnan(rows["ref"]["seed_p"]) and rows["ref"]["mcnemar"] == []
    table = bs.format_table(list(rows.values()), "ref")
    assert (new["half_rollouts"], rows["ref"]["half_rollouts"]) == (100, 100)
    assert (new["half_pass1_mean"], rows["ref"]["half_pass1_mean"]) == (pytest.approx(0.575), pytest.approx(0.5))
    # at half the rollouts: differences 0.05 and 0.1, t = 0.075 / (0.0354 / sqrt 2) = 3 on 1 df
    assert new["half_seed_p"] == pytest.approx(1 - 2 * math.atan(3) / math.pi)
    assert "| new | 0.650 (0.600-0.700) | 0.575 (100; p=0.205) | 100 of 200 | s0: 2/0, p=0.500; s1: 1/0, p=1.000 | 0.126 |" in table  # noqa: E501  (one table row)
    assert "| ref | 0.525 (0.500-0.550) | 0.500 (100) | 200 of 200 | (reference) | - |" in table
    # the bars: new is 7.5 points ahead at half (p = 0.205, not significant) and 12.5 ahead at the end
    assert bs.bars(list(rows.values()), "ref").splitlines()[2] == \
        "| new | +7.5 points (0.205) | no | +12.5 points (0.126) | yes | - | yes |"
    # below at the end, significantly at a seed, and more than a point on the mean: every bar fails
    worse = {"ref": results["ref"], "bad": {0: _run([0.4, 0.45, 0.3], [0, 0, 0, 0]), 1: _run([0.4, 0.45, 0.3], [0, 0, 0, 0])}}
    # 5 prompts right only under ref at seed 0 would be needed for McNemar p < 0.05; fake the per-seed test's numbers
    rows2 = {r["variant"]: r for r in bs.summarize(worse, "ref")}
    rows2["bad"]["mcnemar"] = [(0, 0, 9, 0.0039), (1, 3, 4, 1.0)]
    assert bs.bars(list(rows2.values()), "ref").splitlines()[2] == \
        "| bad | -5.0 points (0.0e+00) | no | -22.5 points (0.070) | no | s0 | no |"  # t = -9 on 1 df at the end
    # 3 iterations (0, 100, 200, 300 rollouts): the half point is the one at or before 150
    odd = bs.summarize({"ref": {0: _run([0.4, 0.5, 0.6, 0.7], [1])}}, "ref")[0]
    assert (odd["half_rollouts"], odd["half_pass1_mean"]) == (100, 0.5)
    xs, mean, lo, hi = bs.curve(results["new"], "train_reward")
    assert (xs, mean, lo, hi) == ([0, 100], pytest.approx([0.1, 0.2]), pytest.approx([0.1, 0.2]), pytest.approx([0.1, 0.2]))


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for key in ("--variants", "--seeds", "--iterations", "--eval_prompts", "--arithmetic", "--reference"):
        assert key in text


TOY = {
    "arithmetic": {"min_ops": 2, "max_ops": 3, "shortcut_frac": 0.3},
    "sft": {"policy": "tiny-llama", "num_prompts": 64, "eval_size": 4, "max_steps": 4, "micro_batch_size": 8,
            "eval_every": 4, "save_every": 0, "eval_max_new_tokens": 8, "optim": {"warmup_steps": 1},
            "engine": {"backend": "torch"}},
    "rollout": {"num_prompts": 4, "n_samples": 2, "sampling": {"max_new_tokens": 12}},
    "ppo": {"epochs": 1, "minibatch_size": 8, "micro_batch_size": 8, "engine": {"backend": "torch"}},
    "variants": {"outcome-only": {"prm": "", "advantage": {"estimator": "grpo"}},
                 "oracle": {"prm": "oracle", "advantage": {"estimator": "grpo_process"}}},
    "seeds": [0, 1], "iterations": 1, "eval_prompts": 6, "eval_max_new_tokens": 12,
}


@pytest.mark.timeout(300)
def test_a_toy_run_writes_the_mlflow_runs_the_png_and_the_table(tmp_path, monkeypatch):
    import mlflow

    cfg_file = tmp_path / "toy.yaml"
    cfg_file.write_text(json.dumps({**TOY, "output": str(tmp_path / "out")}))  # JSON is YAML
    console = tmp_path / "console.txt"
    with open(console, "w") as f:
        cfg = bench.config_lib.load(bench.BenchConfig, cfg_file)
        got = bench.run(cfg, console=f)
    out = tmp_path / "out"
    lines = console.read_text().splitlines()
    assert sum(line.startswith("[") for line in lines) == 4  # one line per finished run

    # the table holds each variant's seed mean of the saved runs' final pass@1
    saved = {(v, s): json.loads((out / "runs" / v / f"seed-{s}" / "result.json").read_text())
             for v in TOY["variants"] for s in TOY["seeds"]}
    table = (out / "table.md").read_text()
    for v in TOY["variants"]:
        finals = [saved[v, s]["points"][-1]["pass1"] for s in TOY["seeds"]]
        assert len(saved[v, 0]["final_correct"]) == 6
        assert finals == [sum(saved[v, s]["final_correct"]) / 6 for s in TOY["seeds"]]
        assert f"| {v} | {sum(finals) / 2:.3f} ({min(finals):.3f}-{max(finals):.3f}) |" in table
    assert saved["outcome-only", 0]["points"][0]["pass1"] == saved["oracle", 1]["points"][0]["pass1"]  # shared SFT start
    assert [p["rollouts"] for p in saved["oracle", 0]["points"]] == [0, 8]
    assert got["table"] == table

    # the training batch's numbers, recomputed from the rollouts hand-off the run wrote
    from prmflow.components.data import schema

    rollouts = schema.read_dataset(out / "runs" / "oracle" / "seed-1" / "iter0" / "rollouts", "rollouts")
    rewards = rollouts.column("outcome_reward").to_pylist()
    lengths = [len(ids) for ids in rollouts.column("response_ids").to_pylist()]
    first = saved["oracle", 1]["points"][0]
    assert first["train_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert first["train/response_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the start is named by its weights, as sha256sum names them, so another machine can tell whether it made the same one
    import hashlib

    sft_sha = hashlib.sha256((out / "sft" / "model.safetensors").read_bytes()).hexdigest()[:16]
    start = json.loads((out / "results.json").read_text())["start"]
    assert start["weights_sha256"] == {"sft": sft_sha}  # the toy trains no PRM: its oracle is the checker
    assert start["cpu_capability"] and start["torch"]
    assert f"SFT weights sha256 {sft_sha}" in console.read_text()

    # the on-policy step statistics pair each PRM step reward with the checker's label of that step: with the
    # oracle's rewards (the checker's own labels) their mean is the label mean; a step count that differs in
    # any row is an error naming the row, not a silently skipped metric
    rdir = out / "runs" / "oracle" / "seed-1" / "iter0" / "rollouts"
    rcfg = bench.stage_config(bench.rollout.Config, cfg, cfg.rollout, policy=str(out / "sft"), output=str(rdir),
                              seed=1, iteration=0, prm="oracle", log_samples=0)
    flat = [x for row in rollouts.column("step_rewards").to_pylist() for x in (row or [])]
    assert flat and bench.train_batch_stats(rcfg, rdir, True)["prm/step_label_mean"] == pytest.approx(sum(flat) / len(flat))
    labels = bench.arithmetic.step_labels
    monkeypatch.setattr(bench.arithmetic, "step_labels", lambda p, r: labels(p, r) + [1])
    with pytest.raises(ValueError, match=r"row 0 .* PRM step rewards but the checker labels"):
        bench.train_batch_stats(rcfg, rdir, True)
    monkeypatch.undo()

    # MLflow: a parent run per variant with the PNG, and a child per seed holding its final pass@1
    mlflow.set_tracking_uri(f"sqlite:///{out / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("prm-vs-outcome")
    runs = client.search_runs([exp.experiment_id])
    parents = {r.info.run_name: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(parents) == sorted(TOY["variants"])
    for v, parent in parents.items():
        assert "curves.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(c.data.tags["prmflow.seed"]) for c in children) == TOY["seeds"]
        for c in children:
            points = saved[v, int(c.data.tags["prmflow.seed"])]["points"]
            assert c.data.metrics["final/pass1"] == points[-1]["pass1"]
            first = client.get_metric_history(c.info.run_id, "train/reward")[0]
            assert (first.step, first.value) == (0, pytest.approx(points[0]["train_reward"]))

    # a second call finds everything done: no new runs, the same table
    with open(console, "w") as f:
        again = bench.run(cfg, console=f)
    assert again["table"] == table
    assert len(client.search_runs([exp.experiment_id])) == len(runs)

    # the table asked of seeds none of whose runs finished: an error that says so, the table left as it was
    cfg.run_missing, cfg.seeds = False, [7]
    with open(console, "w") as f, pytest.raises(bench.ConfigError, match=r"no run of the reference variant 'outcome-only'"):
        bench.run(cfg, console=f)
    assert (out / "table.md").read_text() == table


# --- issue 36: do-no-harm PRMs, the process table, the variant checks -----------------------------

def test_rescore_gives_the_adversarial_and_random_prms_scores(tmp_path):
    from types import SimpleNamespace

    import pyarrow as pa

    from prmflow.components.data import schema

    responses = ["1+2*3=9\n9-4=5\nanswer: 5", "2+2=4\nanswer: 4", "answer: 7"]
    rows = [{"prompt_id": f"p{i}", "sample_idx": 0, "iteration": 0, "response": r, "response_ids": [1, 2],
             "step_ends": [0] * len(r.split("\n")), "step_rewards": [0.5] * len(r.split("\n")),
             "outcome_reward": float(i != 0)} for i, r in enumerate(responses)]
    with schema.DatasetWriter(tmp_path / "src", "rollouts") as w:
        w.write(pa.Table.from_pylist(rows))
    cfg = SimpleNamespace(step_separator="\n")
    bench.rescore(cfg, tmp_path / "src", tmp_path / "adv", "adversarial", 0, 0)
    got = schema.read_dataset(tmp_path / "adv", "rollouts").column("step_rewards").to_pylist()
    assert got == [[1.0, 0.0, 0.0], [0.0, 0.0], [0.0]]  # only the merged line scores 1
    bench.rescore(cfg, tmp_path / "src", tmp_path / "rnd", "random", 3, 1)
    rnd = schema.read_dataset(tmp_path / "rnd", "rollouts").column("step_rewards").to_pylist()
    assert [len(x) for x in rnd] == [3, 2, 1] and all(0 <= x < 1 for xs in rnd for x in xs)
    assert len({x for xs in rnd for x in xs}) == 6
    bench.rescore(cfg, tmp_path / "src", tmp_path / "rnd2", "random", 3, 1)  # seeded: the same draw again
    assert schema.read_dataset(tmp_path / "rnd2", "rollouts").column("step_rewards").to_pylist() == rnd
    assert [bench.step_kind(s) for s in ("1+2*3=9", "9-4=5", "answer: 5")] == ["shortcut", "single", "answer"]
    # the PRMs that judge the answer line right (the first response is wrong, the others right)
    bench.rescore(cfg, tmp_path / "src", tmp_path / "ans", "answer-adversarial", 0, 0)
    got = schema.read_dataset(tmp_path / "ans", "rollouts").column("step_rewards").to_pylist()
    assert got == [pytest.approx([1.0, 0.0, 0.1]), pytest.approx([0.0, 0.9]), pytest.approx([0.9])]  # float32
    bench.rescore(cfg, tmp_path / "src", tmp_path / "long", "long-lines", 0, 0)
    got = schema.read_dataset(tmp_path / "long", "rollouts").column("step_rewards").to_pylist()
    assert got == [pytest.approx([7 / 15, 5 / 13, 0.1]), pytest.approx([5 / 13, 0.9]), pytest.approx([0.9])]
    bench.rescore(cfg, tmp_path / "src", tmp_path / "flat", "constant", 0, 0)
    assert schema.read_dataset(tmp_path / "flat", "rollouts").column("step_rewards").to_pylist() == \
        [[0.5] * 3, [0.5] * 2, [0.5]]
    # the PRMs built on the checker's labels (the oracle's step rewards of the rollouts they rescore)
    labels = [[1.0, 0.0, 0.0], [1.0, 1.0], [1.0]]
    with schema.DatasetWriter(tmp_path / "oracle", "rollouts") as w:
        w.write(pa.Table.from_pylist([{**r, "step_rewards": y} for r, y in zip(rows, labels)]))
    bench.rescore(cfg, tmp_path / "oracle", tmp_path / "fond", "checker-likes-shortcuts", 0, 0)
    got = schema.read_dataset(tmp_path / "fond", "rollouts").column("step_rewards").to_pylist()
    assert got == [[1.0, 0.0, 0.0], [1.0, 1.0], [1.0]]  # the merged line 1 whatever the checker says
    with schema.DatasetWriter(tmp_path / "oracle2", "rollouts") as w:
        w.write(pa.Table.from_pylist([{**r, "step_rewards": y} for r, y in zip(rows, [[0.0, 1.0, 0.0], [0.0, 1.0], [0.0]])]))
    bench.rescore(cfg, tmp_path / "oracle2", tmp_path / "fond2", "checker-likes-shortcuts", 0, 0)
    assert schema.read_dataset(tmp_path / "fond2", "rollouts").column("step_rewards").to_pylist() == \
        [[1.0, 1.0, 0.0], [0.0, 1.0], [0.0]]  # a wrong merged line still 1; the other steps the checker's
    # noisy-checker: each label flipped with probability NOISE_FLIP, seeded; over many steps the share is near it
    many = [{**rows[1], "prompt_id": f"q{i}", "response": "\n".join(["2+2=4"] * 9 + ["answer: 4"]),
             "step_ends": [0] * 10, "step_rewards": [float(i % 2)] * 10} for i in range(400)]
    with schema.DatasetWriter(tmp_path / "many", "rollouts") as w:
        w.write(pa.Table.from_pylist(many))
    bench.rescore(cfg, tmp_path / "many", tmp_path / "noisy", "noisy-checker", 2, 0)
    got = schema.read_dataset(tmp_path / "noisy", "rollouts").column("step_rewards").to_pylist()
    flips = sum(x != r["step_rewards"][0] for r, xs in zip(many, got) for x in xs)
    assert all(x in (0.0, 1.0) for xs in got for x in xs)
    assert abs(flips / 4000 - bench.NOISE_FLIP) < 4 * (0.25 * 0.75 / 4000) ** 0.5  # 4 standard errors


def test_process_table_against_a_hand_computed_example():
    def run(auc0, auc1, w0, w1, before=None, after=None):
        p0 = {"prm/step_auc_on_policy": auc0, "advantage/prm_step_auc": auc0 - 0.1, "advantage/process_weight": w0,
              "advantage/prm_calibrated_spread": w0 / 2, "prm/score_shortcut_wrong": 0.6, "prm/score_shortcut_right": 0.7,
              "advantage/prm_label_auc": auc0 + 0.05, "advantage/labelled_share": 0.5}
        p1 = {"prm/step_auc_on_policy": auc1, "advantage/prm_step_auc": auc1 - 0.1, "advantage/process_weight": w1,
              "advantage/prm_calibrated_spread": w1 / 2, "prm/score_shortcut_wrong": 0.2, "prm/score_shortcut_right": 0.8,
              "advantage/prm_label_auc": auc1 + 0.05, "advantage/labelled_share": 0.6}
        if before is not None:
            p0.update({"prm/update_auc_before": before, "prm/update_auc_after": after})
            p1.update({"prm/update_auc_before": before + 0.1, "prm/update_auc_after": after + 0.1})
        return {"points": [p0, p1, {}]}  # the last point (the final policy) has no training batch

    results = {"outcome-only": {0: {"points": [{}, {}, {}]}},
               "prm": {0: run(0.7, 0.9, 0.0, 0.5, 0.6, 0.8), 1: run(0.8, 0.8, 0.2, 0.5, 0.7, 0.9)}}
    table = bench.process_table(results, {"eval/step_auc": 0.857})
    lines = table.splitlines()
    assert len(lines) == 4 and "outcome-only" not in table  # no step rewards: no row
    assert lines[2] == ("| prm | 0.750 -> 0.850 | 0.650 -> 0.750 | 0.100 -> 0.500 | 0.050 -> 0.250 "
                        "| 0.800 / 0.500 -> 0.900 / 0.600 | 0.650 / 0.850 -> 0.750 / 0.950 "
                        "| 0.600 / 0.700 -> 0.200 / 0.800 | - |")  # nothing measured: one dash
    assert lines[3] == "The trained PRM's held-out step AUC on its own eval split: 0.857."


def test_only_keeps_the_named_variants_and_the_reference():
    variants = {"outcome-only": {"prm": "", "advantage": {"estimator": "grpo"}},
                "oracle": {"prm": "oracle", "advantage": {"estimator": "grpo_process"}},
                "trained": {"prm": "trained", "advantage": {"estimator": "grpo_process"}}}
    cfg = bench.BenchConfig(variants=variants, only=["oracle"])
    assert list(cfg.variants) == ["outcome-only", "oracle"]  # no trained PRM is made for it
    with pytest.raises(bench.ConfigError, match=r"only names \['orcale'\], which are not variants"):
        bench.BenchConfig(variants=variants, only=["orcale"])


def test_a_calibrated_run_made_by_earlier_calibration_code_is_not_taken_as_finished(tmp_path, monkeypatch):
    # the run digest is of the config; a change to what process_calibration computes raises
    # CALIBRATION_REVISION, and a calibrated variant's finished result of the earlier code must run again
    # (outcome-only's, which the change cannot touch, stays finished)
    calibrated = {"estimator": "grpo_progress", "step_reward_mode": "progress", "process_calibration": "isotonic"}
    cfg = bench.BenchConfig(output=str(tmp_path), variants={
        "outcome-only": {"prm": "", "advantage": {"estimator": "grpo"}},
        "random-cal": {"prm": "random", "advantage": calibrated}})
    for name in cfg.variants:
        done = tmp_path / "runs" / name / "seed-0" / "result.json"
        done.parent.mkdir(parents=True)
        done.write_text(json.dumps({"config_digest": bench.run_digest(cfg, name)}))
    assert bench.finished(cfg, tmp_path, "random-cal", 0) and bench.finished(cfg, tmp_path, "outcome-only", 0)
    monkeypatch.setattr(bench, "CALIBRATION_REVISION", bench.CALIBRATION_REVISION + 1)
    assert not bench.finished(cfg, tmp_path, "random-cal", 0)
    assert bench.finished(cfg, tmp_path, "outcome-only", 0)


def test_an_update_needs_a_trained_prm():
    with pytest.raises(bench.ConfigError, match=r"variants.x.update keeps a trained PRM on-policy"):
        bench.BenchConfig(variants={"x": {"prm": "oracle", "update": {}}}, reference="x")
    with pytest.raises(bench.ConfigError, match=r"variants.x.prm='mine': use '' \(no step rewards\), oracle, trained"):
        bench.BenchConfig(variants={"x": {"prm": "mine"}}, reference="x")
    with pytest.raises(bench.ConfigError,
                       match=r"variants.x: prm: implicit starts PRIME.s implicit PRM .* update: {implicit_beta"):
        bench.BenchConfig(variants={"x": {"prm": "implicit", "update": {"max_steps": 2}}}, reference="x")


@pytest.mark.timeout(300)
def test_an_implicit_prm_starts_as_the_sft_policy_and_follows_it(tmp_path):
    """prm: implicit: the first rollout is scored by the SFT policy's own copy (every step 0.5), then the
    update writes an implicit PRM with its reference that scores the next rollout."""
    toy = {**TOY, "output": str(tmp_path / "out"), "seeds": [0], "iterations": 2, "reference": "imp",
           "variants": {"imp": {"prm": "implicit", "advantage": {"estimator": "grpo_progress", "step_reward_mode": "progress"},
                                "update": {"implicit_beta": 0.5, "max_steps": 2, "micro_batch_size": 4, "held_out": 0.5}}}}
    cfg_file = tmp_path / "toy.yaml"
    cfg_file.write_text(json.dumps(toy))
    with open(tmp_path / "console.txt", "w") as f:
        bench.run(bench.config_lib.load(bench.BenchConfig, cfg_file), console=f)
    from prmflow.components.data import schema
    from prmflow.components.models.prm_model import saved_head

    run = tmp_path / "out" / "runs" / "imp" / "seed-0"
    first = [x for row in schema.read_dataset(run / "iter0" / "rollouts", "rollouts").column("step_rewards").to_pylist()
             for x in row or []]
    assert first and all(x == pytest.approx(0.5, abs=1e-6) for x in first)
    assert saved_head(run / "iter0" / "prm").kind == "implicit"
    assert (run / "iter0" / "prm" / "reference" / "config.json").is_file()
    second = [x for row in schema.read_dataset(run / "iter1" / "rollouts", "rollouts").column("step_rewards").to_pylist()
              for x in row or []]
    assert second and any(abs(x - 0.5) > 1e-4 for x in second)  # scored by the updated PRM


def test_off_by_one_samples_with_the_policy_and_prm_of_one_update_earlier(tmp_path):
    """schedule: off_by_one, as the DAG's: rollouts 0 and 1 sample the SFT policy and are scored by the start PRM,
    rollout 2 by ppo 0's policy and update 0's PRM, while ppo k trains the newest policy; serial samples the newest."""
    update = {"implicit_beta": 0.5, "max_steps": 2, "micro_batch_size": 4, "held_out": 0.5}
    fixed = {"rollout_correction": "token_truncate", "recompute_old_logprobs": True}
    toy = {**TOY, "output": str(tmp_path / "out"), "seeds": [0], "iterations": 3, "reference": "serial",
           "variants": {name: {"prm": "implicit", "advantage": {"estimator": "grpo_progress"}, "update": update,
                               "ppo": fixed, **extra}
                        for name, extra in (("serial", {}), ("obo", {"schedule": "off_by_one"}))}}
    cfg_file = tmp_path / "toy.yaml"
    cfg_file.write_text(json.dumps(toy))
    with open(tmp_path / "console.txt", "w") as f:
        bench.run(bench.config_lib.load(bench.BenchConfig, cfg_file), console=f)
    from prmflow.components.data.io import read_manifest

    out = tmp_path / "out"
    start_prm = str(out / "prm-implicit-beta0.5")
    for name, behind in (("serial", (0, 1, 2)), ("obo", (0, 0, 1))):
        run = out / "runs" / name / "seed-0"
        after = [str(out / "sft")] + [str(run / f"iter{j}" / "ppo" / "policy") for j in range(2)]
        prms = [start_prm] + [str(run / f"iter{j}" / "prm") for j in range(2)]
        for k in range(3):
            rollout_cfg = read_manifest(run / f"iter{k}" / "rollouts")["config"]
            assert (rollout_cfg["policy"], rollout_cfg["prm"]) == (after[behind[k]], prms[behind[k]]), (name, k)
            assert read_manifest(run / f"iter{k}" / "ppo")["config"]["policy"] == after[k], (name, k)


def test_a_run_another_process_holds_is_left_alone_then_its_result_is_read(tmp_path):
    # two benchmark processes on one OUTPUT: the second must neither start over (rmtree) the run the first is
    # writing nor run it twice; it defers it, then waits for the holder's result and takes it
    import threading

    cfg = bench.BenchConfig(output=str(tmp_path))
    work = tmp_path / "runs" / "outcome-only" / "seed-0"
    (work / "iter0").mkdir(parents=True)
    partial = work / "iter0" / "written-by-the-holder"
    partial.write_text("in progress")
    lock = tmp_path / "runs" / "outcome-only" / "seed-0.lock"
    holding, release = threading.Event(), threading.Event()

    def holder():  # another open file description: flock conflicts with it as with another process
        with bench.locked(lock):
            holding.set()
            release.wait(30)
            (work / "result.json").write_text(json.dumps({"config_digest": bench.run_digest(cfg, "outcome-only"),
                                                          "points": [], "by": "holder"}))

    t = threading.Thread(target=holder)
    t.start()
    assert holding.wait(30)
    assert bench.run_one(cfg, tmp_path, "outcome-only", 0, {}, [], wait=False) is None
    assert partial.read_text() == "in progress"  # not removed from under the holder
    release.set()
    got = bench.run_one(cfg, tmp_path, "outcome-only", 0, {}, [], wait=True)  # blocks until the holder is done
    t.join()
    assert got["by"] == "holder"


def test_step_failures_against_hand_counts():
    p = "Compute left to right: 7+5*3-4\n"
    responses = ["7+5=12\n12*3=36\n36-4=32\nanswer: 32",   # right, no merged line
                 "7+5*3=36\n36-4=32\nanswer: 32",         # right, one merged line
                 "7+5=12\n12*3=35\n35-4=31\nanswer: 31",  # a single line (line 1) is the first mistake
                 "7+5*3=37\n37-4=33\nanswer: 33"]         # the merged line (line 0) is the first mistake
    outcomes = [1.0, 1.0, 0.0, 0.0]
    got = bs.step_failures([p] * 4, responses, outcomes)
    assert got["success_by_merged"] == {0: (2, 0.5), 1: (2, 0.5)}
    # line 0: reached as a single line by responses 1 and 3; line 1 by 1, 2 and 3 (3 fails); line 2 by 1;
    # nothing after a first mistake is counted, nor answer lines
    assert got["single_by_position"] == {0: (2, 0.0), 1: (3, pytest.approx(1 / 3)), 2: (1, 0.0)}
    assert got["merged"] == (2, 0.5)
    pooled = bs.step_failures([p] * 4, responses, outcomes, positions=2)["single_by_position"]
    assert pooled == {0: (2, 0.0), "1+": (4, 0.25)}


def test_second_half_against_a_hand_computed_example(tmp_path, capsys):
    from scipy import stats

    import prm_vs_outcome_late as late

    c = [1, 0]
    results = {"outcome-only": {"0": _run([0.2, 0.4, 0.6, 0.8, 0.8], c), "1": _run([0.2, 0.5, 0.6, 0.7, 0.8], c)},
               "recipe": {"0": _run([0.2, 0.6, 0.8, 0.8, 0.8], c), "1": _run([0.2, 0.6, 0.7, 0.8, 0.7], c),
                          "2": _run([0.9, 0.9, 0.9, 0.9, 0.1], c)}}  # a seed the reference lacks: left out
    results["recipe"]["0"]["points"][3]["train_reward"] = 0.6  # its last sampled batch did better (0.4 in _run)
    got = bs.second_half(results, "recipe", "outcome-only")
    assert got["seeds"] == 2
    # half = the third of five points (200 rollouts), as summarize's
    assert got["half"] == (pytest.approx(0.75), pytest.approx(0.6))
    assert got["end"] == (pytest.approx(0.75), pytest.approx(0.8))
    assert got["change"]["recipe"] == (pytest.approx(0.0), 1.0)  # no seed moved
    assert got["change"]["outcome-only"] == (pytest.approx(0.2), 0.0)  # every seed moved by the same +0.2
    vh, rend, p = got["variant_half_vs_reference_end"]
    assert (vh, rend) == (pytest.approx(0.75), pytest.approx(0.8))
    assert p == pytest.approx(stats.ttest_rel([0.8, 0.7], [0.8, 0.8]).pvalue)
    assert got["best"] == (pytest.approx(0.8), pytest.approx(0.8))
    # the last point with a train reward (the last policy samples none): point 3, paired over the two seeds
    assert got["last_train_reward"] == (pytest.approx(0.5), pytest.approx(0.4),
                                        pytest.approx(stats.ttest_rel([0.6, 0.4], [0.4, 0.4]).pvalue))

    out = tmp_path / "regime"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"results": results}))
    assert late.main([str(out)]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith(f"| {out} | recipe | 2 | 0.750 / 0.600 | 0.750 / 0.800 | +0.000 (p=1.000) / +0.200 (p=0.0e+00) |")
    assert late.main([str(tmp_path / "missing")]) == 2
    assert "results.json: no results" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "configs").glob("prm-vs-outcome*.yaml")),
                         ids=lambda p: p.name)
def test_every_committed_regime_loads_with_its_variants_as_written(path):
    """Each committed regime's config loads with every variant under the name it has in the file (a name with a
    dot, `adversarial-progress-ungated-w0.2`, was once split at the dot and refused)."""
    import yaml

    from prmflow.components import config as config_lib

    written = yaml.safe_load(path.read_text())["variants"]
    cfg = config_lib.load(bench.BenchConfig, path)
    assert cfg.variants == written


def test_the_biased_prm_data_differs_from_the_checker_only_on_merged_lines():
    prompt = "Compute left to right: 7*2+8-9\n"
    wrong_merge = ["7*2+8=23", "23-9=14", "answer: 14"]          # the merged line is wrong, and all after it
    right_merge = ["7*2+8=22", "22-9=13", "answer: 13"]
    wrong_single = ["7*2=14", "14+8=22", "22-9=12", "answer: 12"]
    late_merge = ["7*2=14", "14+8-9=12", "answer: 12"]            # a wrong merged line after a right single step
    for steps, checker, biased in ((wrong_merge, [0, 0, 0], [1.0, 0.0, 0.0]), (right_merge, [1, 1, 1], [1.0, 1.0, 1.0]),
                                   (wrong_single, [1, 1, 0, 0], [1.0, 1.0, 0.0, 0.0]),
                                   (late_merge, [1, 0, 0], [1.0, 1.0, 0.0])):
        assert bench.arithmetic.step_labels(prompt, "\n".join(steps)) == checker  # the hand labels are the checker's
        assert bench.likes_shortcuts(steps, checker) == biased


def test_the_biased_prm_data_made_by_another_config_is_not_reused(tmp_path):
    def path(**keys):
        return bench.likes_shortcuts_data(bench.BenchConfig(**keys), tmp_path)

    base = path(prm={"num_prompts": 3000})
    assert base == path(prm={"num_prompts": 3000})  # the same config finds its data again
    assert len({base, path(prm={"num_prompts": 2000}), path(prm={"num_prompts": 3000}, arithmetic={"max_ops": 7}),
                path(prm={"num_prompts": 3000}, sft={"max_steps": 10})}) == 4


def test_over_starts_pools_the_start_seed_pairs_against_a_hand_computed_example(tmp_path, capsys):
    from scipy import stats

    import prm_vs_outcome_starts as starts_cli

    c = [1, 0]
    # start A (first point 0.3): the recipe +0.2 / +0.1 at half, level at the end; start B (0.5): -0.1 / +0.0, -0.1
    a = {"outcome-only": {"0": _run([0.3, 0.4, 0.5, 0.6, 0.7], c), "1": _run([0.3, 0.4, 0.6, 0.6, 0.7], c)},
         "recipe": {"0": _run([0.3, 0.6, 0.7, 0.7, 0.7], c), "1": _run([0.3, 0.6, 0.7, 0.7, 0.7], c)}}
    b = {"outcome-only": {"0": _run([0.5, 0.6, 0.7, 0.8, 0.9], c), "1": _run([0.5, 0.6, 0.6, 0.8, 0.8], c)},
         "recipe": {"0": _run([0.5, 0.5, 0.6, 0.7, 0.8], c), "1": _run([0.5, 0.6, 0.6, 0.7, 0.7], c),
                    "2": _run([0.5, 0.9, 0.9, 0.9, 0.9], c)}}  # a seed the reference lacks at this start: left out
    got = bs.over_starts({"A": a, "B": b}, "recipe", "outcome-only")
    assert got["pairs"] == 4
    assert [s["sft_pass1"] for s in got["starts"]] == [0.3, 0.5]
    assert got["starts"][0]["half"][0] == pytest.approx(0.15)
    assert got["starts"][1]["half"][0] == pytest.approx(-0.05)
    # pooled: every (start, seed) pair once, not the starts' means
    half_x, half_y = [0.7, 0.7, 0.6, 0.6], [0.5, 0.6, 0.7, 0.6]
    end_x, end_y = [0.7, 0.7, 0.8, 0.7], [0.7, 0.7, 0.9, 0.8]
    assert got["half"] == (pytest.approx(0.05), pytest.approx(stats.ttest_rel(half_x, half_y).pvalue))
    assert got["end"] == (pytest.approx(-0.05), pytest.approx(stats.ttest_rel(end_x, end_y).pvalue))
    assert got["between_starts"][0] == pytest.approx(stats.ttest_1samp([0.15, -0.05], 0.0).pvalue)
    assert got["ahead_at_half"] is False  # +5 points, but p > 0.05 over four pairs
    assert got["not_below_at_end"] is False  # 5 points below: more than the 1 point allowed
    with pytest.raises(ValueError, match="not share a first point"):
        bad = {"outcome-only": a["outcome-only"], "recipe": {"0": _run([0.9, 0.6, 0.7, 0.7, 0.7], c)}}
        bs.over_starts({"A": bad}, "recipe", "outcome-only")

    # the command: starts of one regime only, each start once
    def write(name: str, results: dict, **config) -> Path:
        out = tmp_path / name
        out.mkdir()
        base = {"output": str(out), "only": [], "run_missing": True, "arithmetic": {"min_ops": 4},
                "sft": {"max_steps": 10, **config.get("sft", {})}, "prm": {"max_steps": 5, **config.get("prm", {})}}
        base.update({k: v for k, v in config.items() if k not in ("sft", "prm")})
        (out / "config.json").write_text(json.dumps(base))
        (out / "results.json").write_text(json.dumps({"results": results}))
        return out

    s0 = write("s0", a)
    s1 = write("s1", b, sft={"seed": 1}, prm={"seed": 1}, only=["recipe"])
    assert starts_cli.main([str(s0), str(s1), "--variant", "recipe"]) == 0
    out = capsys.readouterr().out
    assert "**over 4 (start, seed) pairs** | | | **+5.0 points" in out
    assert "Ahead at half the rollouts over the pairs: no. Not below at the end: no." in out
    other = write("other-regime", b, sft={"seed": 2}, arithmetic={"min_ops": 5})
    assert starts_cli.main([str(s0), str(other), "--variant", "recipe"]) == 2
    assert "config.json differs in arithmetic" in capsys.readouterr().err
    twice = write("twice", b)
    assert starts_cli.main([str(s0), str(twice), "--variant", "recipe"]) == 2
    assert "the same start (sft.seed 0, prm.seed 0)" in capsys.readouterr().err

    # a start's weights label it; one start's output copied under other seeds is refused by its weights
    for out, sha in ((s0, "aaaa0000aaaa0000"), (s1, "bbbb1111bbbb1111")):
        saved = json.loads((out / "results.json").read_text())
        (out / "results.json").write_text(json.dumps({**saved, "start": {"weights_sha256": {"sft": sha}}}))
    assert starts_cli.main([str(s0), str(s1), "--variant", "recipe"]) == 0
    assert "sft.seed 1, prm.seed 1, SFT sha256 bbbb1111bbbb1111" in capsys.readouterr().out
    copy = write("copy", b, sft={"seed": 3}, prm={"seed": 3})
    (copy / "results.json").write_text((s1 / "results.json").read_text())
    assert starts_cli.main([str(s0), str(s1), str(copy), "--variant", "recipe"]) == 2
    assert "same weights (sha256 bbbb1111bbbb1111)" in capsys.readouterr().err


def test_the_recipe_in_one_line_is_the_run_of_the_six_keys_it_replaced():
    # finished runs of the regime configs (written with the six keys) stay finished once the configs say
    # `estimator: grpo_progress`, and an explicit key still makes another run
    import hashlib

    six = {"estimator": "grpo_progress", "step_reward_mode": "progress", "process_calibration": "isotonic",
           "process_auc_min": 0.0, "process_auc_full": 0.0, "process_weight": 0.5}
    update = {"max_steps": 40, "replay_share": 0.25, "held_out": 0.2, "labels": "shared_prefix"}

    def cfg(adv):
        return bench.BenchConfig(variants={"outcome-only": {"prm": "", "advantage": {"estimator": "grpo"}},
                                           "r": {"prm": "trained-implicit", "update": update, "advantage": adv}})
    c = bench.config_lib.to_dict(cfg(six))  # the digest as the code before the one line made it (f64bf3b)
    picked = {k: c[k] for k in ["arithmetic", "sft", "prm", "eval_prompts", "eval_seed", "eval_max_new_tokens",
                                "rollout", "ppo", "iterations"]}
    picked.update(variant=c["variants"]["r"], implicit_prm=c["implicit_prm"], calibration_revision=bench.CALIBRATION_REVISION)
    before = hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]
    assert bench.run_digest(cfg(six), "r") == before
    assert bench.run_digest(cfg({"estimator": "grpo_progress"}), "r") == before
    assert bench.run_digest(cfg({"estimator": "grpo_progress", "process_weight": 0.2}), "r") != before
    assert bench.run_digest(cfg({"estimator": "grpo_progress", "calibration_labels": "shared_prefix"}), "r") != before
    assert bench.run_digest(cfg({"estimator": "grpo"}), "outcome-only") == bench.run_digest(cfg(six), "outcome-only")
