"""prm-update: on-policy labels from the rollouts' own outcomes, the held-out split, replay, a PRM that
learns what the current policy's failures look like, re-runs and bad input."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from prmflow import cli
from prmflow.components import config
from prmflow.components.data import schema
from prmflow.errors import ConfigError, DataError
from prmflow.tasks import arithmetic
from prmflow.components.scoring.prm_scoring import load_scorer
from prmflow.components.scoring.prm_metrics import roc_auc
from prmflow.components.prm import stage, online_update as update

SHORT = {"backbone": "tiny-llama", "extra_layers": 0, "train_layers": 0, "optim.lr": 2e-3, "num_prompts": 40,
         "eval_size": 8, "negatives_per_problem": 1, "max_steps": 6, "micro_batch_size": 8, "optim.warmup_steps": 1,
         "eval_every": 0, "save_every": 0, "engine.backend": "torch", "tracking.enabled": False}


@pytest.fixture(scope="module")
def base_prm(tmp_path_factory):
    out = tmp_path_factory.mktemp("prm") / "prm"
    stage.run(config.load(stage.Config, overrides={**SHORT, "output": str(out)}))
    return out


def write_rollouts(path, n_prompts: int, iteration: int = 0, seed: int = 0, outcome=None) -> list[dict]:
    """Rollouts of a 'policy' that fails exactly when it writes a line ending in '=0': 4 responses a prompt,
    half of them that way. Right responses are the reference solution; failing ones end in a wrong step."""
    rng = random.Random(seed)
    rows = []
    for p in arithmetic.generate(n_prompts, seed=seed, split="train"):
        for i in range(4):
            fail = i % 2 == 1
            steps = arithmetic.split_steps(p.solution)
            if fail:
                steps = steps[:1] + ["1+1=0"] + steps[1:]
            rows.append({"prompt_id": p.prompt_id, "sample_idx": i, "iteration": iteration, "prompt": p.prompt,
                         "response": "\n".join(steps), "response_ids": [1, 2, 3],
                         "outcome_reward": (0.0 if fail else 1.0) if outcome is None else outcome(rng)})
    with schema.DatasetWriter(path, "rollouts") as w:
        w.write(pa.Table.from_pylist(rows))
    return rows


def scorer_auc(prm_dir, rollouts, held_out: float) -> float:
    """Step AUC against the outcome, by the rollout stage's scorer, on the responses the update held out
    (iteration 0, seed 0): what the update's eval/step_auc must equal."""
    held = {e.prompt_id.split(":", 1)[1] for e in update.split_by_prompt(
        update.rollout_examples(str(rollouts), "\n", 0.5), held_out, seed=0)[1]}
    table = [r for r in schema.read_dataset(rollouts, "rollouts").to_pylist() if r["prompt_id"] in held]
    scores = load_scorer(prm_dir, device="cpu").score([r["prompt"] for r in table], [r["response"] for r in table])
    labels = [r["outcome_reward"] for r, s in zip(table, scores) for _ in s]
    return roc_auc([x for s in scores for x in s], labels)


def make_cfg(tmp_path, base_prm, name="new", **over) -> update.Config:
    return config.load(update.Config, overrides={"prm": str(base_prm), "input": str(tmp_path / "rollouts"),
                                                 "output": str(tmp_path / name), "max_steps": 30, "micro_batch_size": 8,
                                                 "train_layers": 0, "optim.lr": 2e-3, "tracking.enabled": False, **over})


def test_every_step_prefix_is_labelled_with_its_responses_outcome(tmp_path):
    rows = write_rollouts(tmp_path / "rollouts", 3)
    examples = update.rollout_examples(str(tmp_path / "rollouts"), "\n", 0.5)
    assert len(examples) == len(rows)
    for ex, r in zip(examples, rows):
        assert ex.steps == r["response"].split("\n")
        assert ex.labels == [r["outcome_reward"]] * len(ex.steps)
    train, held = update.split_by_prompt(examples, 0.34, seed=1)
    assert {e.prompt_id for e in train}.isdisjoint({e.prompt_id for e in held})  # whole prompts are held out
    assert len({e.prompt_id for e in held}) == 1 and len(train) + len(held) == len(examples)


def test_the_update_learns_the_current_policys_failures_and_logs_its_held_out_auc(tmp_path, base_prm):
    write_rollouts(tmp_path / "rollouts", 24)
    metrics = update.run(make_cfg(tmp_path, base_prm, held_out=0.25))
    # the held-out AUC is against outcome labels on the held-out prompts, before and after
    assert metrics["eval/step_auc"] > metrics["eval/before_step_auc"] + 0.1
    assert metrics["eval/step_auc"] > 0.65  # a failing response's first step is its right twin's: the ceiling is below 1
    assert metrics["data/held_out_examples"] == 6 * 4 and metrics["data/train_examples"] == 18 * 4
    # the written PRM scores what the update evaluated: recompute the AUC with the rollout stage's scorer
    assert scorer_auc(tmp_path / "new", tmp_path / "rollouts", 0.25) == pytest.approx(metrics["eval/step_auc"], abs=1e-4)
    manifest = json.loads((tmp_path / "new" / "manifest.json").read_text())
    assert manifest["kind"] == "prm" and str(base_prm) in manifest["parents"]
    # a re-run of the same config on the same inputs does nothing and returns the same metrics
    assert update.run(make_cfg(tmp_path, base_prm, held_out=0.25)) == metrics


def test_replay_draws_its_share_from_older_rollouts(tmp_path, base_prm):
    write_rollouts(tmp_path / "rollouts", 10, iteration=1, seed=1)
    write_rollouts(tmp_path / "old", 20, iteration=0, seed=2)
    cfg = make_cfg(tmp_path, base_prm, replay=[str(tmp_path / "old")], replay_share=0.2, held_out=0.2, max_steps=2)
    replayed = update.draw_replay(cfg, "\n", 32)
    assert len(replayed) == 8  # 0.2 of the 40 training examples
    assert {e.prompt_id.split(":")[0] for e in replayed} == {"0"}
    metrics = update.run(cfg)
    assert (metrics["data/train_examples"], metrics["data/replay_examples"]) == (40, 8)


def test_sharded_rollouts_train_and_replay_like_one_directory(tmp_path, base_prm):
    """The pipeline hands the update a directory of rollout shards (pipelines/kfp_shim.gather_shards): read
    as one dataset, and each shard is in the result's identity."""
    for i in range(2):
        write_rollouts(tmp_path / "rollouts" / f"shard-{i}", 5, iteration=1, seed=10 + i)
        write_rollouts(tmp_path / "old" / f"shard-{i}", 5, iteration=0, seed=20 + i)
    cfg = make_cfg(tmp_path, base_prm, replay=[str(tmp_path / "old")], held_out=0.2, max_steps=2)
    metrics = update.run(cfg)
    current = metrics["data/train_examples"] - metrics["data/replay_examples"] + metrics["data/held_out_examples"]
    assert current == 2 * 5 * 4 and metrics["data/replay_examples"] == round(0.25 / 0.75 * 32)  # 2 prompts held out
    inputs = json.loads((tmp_path / "new" / "manifest.json").read_text())["inputs"]
    assert {str(tmp_path / d / f"shard-{i}") for d in ("rollouts", "old") for i in range(2)} < set(inputs)


def test_a_missing_outcome_is_an_error_naming_the_row(tmp_path, base_prm):
    write_rollouts(tmp_path / "rollouts", 2, outcome=lambda rng: None)
    with pytest.raises(DataError, match=r"row 0 \(prompt_id=.*sample_idx=0\): outcome_reward is None"):
        update.run(make_cfg(tmp_path, base_prm))
    assert not (tmp_path / "new").exists()


def test_config_errors_and_the_cli(tmp_path, base_prm, capsys):
    with pytest.raises(ConfigError, match=r"held_out=0.0 must be in \(0, 1\)"):
        make_cfg(tmp_path, base_prm, held_out=0.0)
    with pytest.raises(ConfigError, match=r"not a PRM written by the prm stage"):
        update.run(make_cfg(tmp_path, base_prm, prm=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"prm='.*/prm-typo' does not exist"):  # was "not a PRM ... (no prmflow.json)"
        update.run(make_cfg(tmp_path, base_prm, prm=str(tmp_path / "prm-typo")))
    write_rollouts(tmp_path / "rollouts", 6)
    assert cli.main(["prm-update", "--prm", str(base_prm), "--input", str(tmp_path / "rollouts"), "--output",
                     str(tmp_path / "cli"), "--max_steps", "2", "--micro_batch_size", "4", "--tracking.enabled", "false"]) == 0
    assert "prm-update: iteration 0: held-out step AUC" in capsys.readouterr().out


def test_a_killed_update_resumes_to_the_uninterrupted_result(tmp_path, base_prm, monkeypatch):
    from safetensors.torch import load_file

    from prmflow.components.training import checkpoint

    write_rollouts(tmp_path / "rollouts", 8)
    update.run(make_cfg(tmp_path, base_prm, "full", max_steps=6, save_every=3))
    real_save = checkpoint.save

    def preempted(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("preempted")  # the pod dies right after its first checkpoint

    monkeypatch.setattr(update.checkpoint, "save", preempted)
    with pytest.raises(KeyboardInterrupt):
        update.run(make_cfg(tmp_path, base_prm, "cut", max_steps=6, save_every=3))
    assert not (tmp_path / "cut").exists()  # no partial output
    monkeypatch.setattr(update.checkpoint, "save", real_save)
    steps = []
    monkeypatch.setattr(update.TrainEngine, "step", lambda self, _orig=update.TrainEngine.step: (steps.append(1), _orig(self))[1])
    resumed = update.run(make_cfg(tmp_path, base_prm, "cut", max_steps=6, save_every=3))
    assert len(steps) == 3  # steps 4..6 only
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[n] == b[n]).all() for n in a)
    # the "before" AUC is the incoming PRM's, not the resumed checkpoint's
    full = json.loads((tmp_path / "full" / "manifest.json").read_text())["metrics"]
    assert resumed["eval/before_step_auc"] == full["eval/before_step_auc"]


# --- labels=shared_prefix: a group's other samples as a prefix's completions --------------------------

def test_shared_prefix_labels_by_hand():
    from prmflow.components.prm import step_examples as data

    win = data.StepExample("p", ["a", "b", "c"], [1.0] * 3, prompt_id="0:p")
    lost_late = data.StepExample("p", ["a", "b", "x"], [0.0] * 3, prompt_id="0:p")  # shares a, b with the win
    lost_early = data.StepExample("p", ["y", "b", "c"], [0.0] * 3, prompt_id="0:p")  # shares nothing (prefixes)
    other_prompt = data.StepExample("q", ["a", "b", "c"], [0.0] * 3, prompt_id="0:q")  # same text, other prompt
    other_iter = data.StepExample("p", ["a", "b", "c"], [0.0] * 3, prompt_id="1:p")  # same prompt, other rollouts
    out = update.shared_prefix_labels([win, lost_late, lost_early, other_prompt, other_iter])
    assert [e.labels for e in out] == [[1, 1, 1], [1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert lost_late.labels == [0.0] * 3  # the inputs are not changed


def test_shared_prefix_labels_score_a_failures_right_steps_as_right(tmp_path, base_prm):
    # the synthetic policy's failures are a right first step (shared with the successes), then the wrong
    # line '1+1=0', then right lines; labelled by the outcome the shared first step is 0 half the time
    write_rollouts(tmp_path / "rollouts", 24)
    held = {e.prompt_id.split(":", 1)[1] for e in update.split_by_prompt(
        update.rollout_examples(str(tmp_path / "rollouts"), "\n", 0.5), 0.25, seed=0)[1]}
    table = [r for r in schema.read_dataset(tmp_path / "rollouts", "rollouts").to_pylist() if r["prompt_id"] in held]
    scores, metrics = {}, {}
    for labels in ("outcome", "shared_prefix"):
        metrics[labels] = update.run(make_cfg(tmp_path, base_prm, name=labels, held_out=0.25, labels=labels))
        s = load_scorer(tmp_path / labels, device="cpu").score([r["prompt"] for r in table], [r["response"] for r in table])
        fails = [x for r, x in zip(table, s) if r["outcome_reward"] == 0.0]
        scores[labels] = {"first": sum(x[0] for x in fails) / len(fails), "wrong": sum(x[1] for x in fails) / len(fails)}
    print(scores)
    assert scores["shared_prefix"]["first"] > scores["outcome"]["first"] + 0.1
    assert scores["shared_prefix"]["wrong"] < scores["shared_prefix"]["first"] - 0.4  # the wrong line is still caught
    assert metrics["shared_prefix"]["data/positive_fraction"] > metrics["outcome"]["data/positive_fraction"]


def test_labels_is_checked(tmp_path, base_prm):
    with pytest.raises(ConfigError, match=r"'labels' is 'some', which is not one of \['outcome', 'shared_prefix'\]"):
        make_cfg(tmp_path, base_prm, labels="some")


def test_older_responses_of_a_held_out_prompt_are_not_replayed(tmp_path, base_prm):
    """The RL loop samples a prompt again in later iterations: the update holds it out in this
    iteration's rollouts and in the replay alike, and still fills its replay share from the rest."""
    write_rollouts(tmp_path / "rollouts", 10, iteration=1, seed=0)
    write_rollouts(tmp_path / "old", 10, iteration=0, seed=0)  # the same 10 prompts, one iteration before
    cfg = make_cfg(tmp_path, base_prm, replay=[str(tmp_path / "old")], replay_share=0.5, held_out=0.2, iteration=1,
                   max_steps=2)
    train, replay, held = update.training_data(cfg, "\n")
    held_prompts = {e.prompt for e in held}
    assert len(held_prompts) == 2 and held_prompts.isdisjoint({e.prompt for e in train + replay})
    assert len(replay) == 32 and {e.where.split("'")[1] for e in replay} == {str(tmp_path / "old")}
    metrics = update.run(cfg)
    assert (metrics["data/held_out_examples"], metrics["data/replay_examples"]) == (8, 32)
    assert 0 <= metrics["eval/step_auc"] <= 1 and 0 <= metrics["eval/before_step_auc"] <= 1
