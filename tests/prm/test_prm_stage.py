"""PRM training stage: resume is exact, both engines agree, soft labels are fitted, lm_tokens trains,
the saved PRM scores exactly what training evaluated, a finished output is not redone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from prmflow import cli
from prmflow.components.training import checkpoint
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.scoring.prm_metrics import step_metrics
from prmflow.components.models.prm_model import PRM, HeadConfig
from prmflow.components.scoring.prm_scoring import load_scorer
from prmflow.components.prm import step_examples as data, stage
from prmflow.errors import ConfigError

SHORT = {"backbone": "tiny-llama", "extra_layers": 0, "train_layers": 0, "optim.lr": 2e-3, "num_prompts": 40,
         "eval_size": 8, "negatives_per_problem": 1, "max_steps": 6, "micro_batch_size": 8, "optim.warmup_steps": 1,
         "eval_every": 0, "save_every": 0, "engine.backend": "torch", "tracking.enabled": False}


def make_cfg(tmp_path, name="out", **over):
    return config.load(stage.Config, overrides={**SHORT, "output": str(tmp_path / name), **over})


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_resume_after_a_checkpoint_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    full = make_cfg(tmp_path, "full", save_every=3)
    stage.run(full)

    cut = make_cfg(tmp_path, "cut", save_every=3)
    real_save = checkpoint.save
    saves = []

    def preempted(*args, **kwargs):
        path = real_save(*args, **kwargs)
        saves.append(json.loads((path / "state" / "trainer_state.json").read_text()))
        raise KeyboardInterrupt("preempted")  # the pod dies right after its first checkpoint

    monkeypatch.setattr(stage.checkpoint, "save", preempted)
    with pytest.raises(KeyboardInterrupt):
        stage.run(cut)
    assert saves == [{"step": 3, "consumed": 24}]
    assert not (tmp_path / "cut").exists()  # no partial output

    monkeypatch.setattr(stage.checkpoint, "save", real_save)
    steps = []
    monkeypatch.setattr(stage.TrainEngine, "step", lambda self, _orig=stage.TrainEngine.step: (steps.append(1), _orig(self))[1])
    stage.run(cut)
    assert len(steps) == 3  # steps 4..6 only
    a, b = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert not checkpoint.work_dir_for(cut.output).exists()


def test_a_checkpoint_from_another_config_is_not_resumed(tmp_path, monkeypatch):
    """Preempted with one learning rate, restarted with another: the restart trains from step 0 and
    gives what an uninterrupted run with the new rate gives (not a blend of the two)."""
    real_save = checkpoint.save

    def preempted(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(stage.checkpoint, "save", preempted)
    with pytest.raises(KeyboardInterrupt):
        stage.run(make_cfg(tmp_path, "cut", save_every=3, **{"optim.lr": 2e-3}))
    assert checkpoint.work_dir_for(str(tmp_path / "cut")).exists()
    monkeypatch.setattr(stage.checkpoint, "save", real_save)

    steps = []
    monkeypatch.setattr(stage.TrainEngine, "step", lambda self, _orig=stage.TrainEngine.step: (steps.append(1), _orig(self))[1])
    stage.run(make_cfg(tmp_path, "cut", save_every=3, **{"optim.lr": 5e-3}))
    assert len(steps) == 6  # from scratch
    stage.run(make_cfg(tmp_path, "fresh", save_every=3, **{"optim.lr": 5e-3}))
    a, b = weights(tmp_path / "cut"), weights(tmp_path / "fresh")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_deepspeed_and_plain_engines_agree(tmp_path):
    stage.run(make_cfg(tmp_path, "plain", max_steps=3, grad_accum=2, micro_batch_size=4))
    stage.run(make_cfg(tmp_path, "ds", max_steps=3, grad_accum=2, micro_batch_size=4, **{"engine.backend": "deepspeed"}))
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "ds")
    start = PRM.load("tiny-llama").model.state_dict()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-5), name
    assert float((a["score.weight"] - start["score.weight"]).abs().max()) > 1e-4  # the head really trained


def test_saved_prm_scores_what_training_evaluated(tmp_path):
    """The scoring API on the written directory reproduces the stage's own held-out metrics."""
    cfg = make_cfg(tmp_path, max_steps=4)
    metrics = stage.run(cfg)
    _, held_out = data.load_data(cfg)
    scorer = load_scorer(cfg.output, batch_size=5)
    scores = scorer.score([e.prompt for e in held_out], [e.response() for e in held_out])
    again = step_metrics([e.labels for e in held_out], scores)
    for key in ("eval/step_auc", "eval/step_accuracy", "eval/loss"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-5), key
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["kind"] == "prm" and manifest["metrics"]["eval/step_auc"] == metrics["eval/step_auc"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForTokenClassification"]


def test_soft_labels_are_fitted(tmp_path):
    """With a soft label of 0.25 on every step, BCE's minimizer is 0.25: the trained PRM says so."""
    rows = [{"prompt": f"Compute left to right: {a}+{b}\n", "steps": [f"{a}+{b}={a + b}", f"answer: {a + b}"],
             "labels": [0.25, 0.25]} for a in range(1, 9) for b in range(1, 9)]
    path = tmp_path / "soft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tmp_path, task=str(path), eval_size=8, max_steps=25, **{"optim.lr": 1e-2}, micro_batch_size=16)
    metrics = stage.run(cfg)
    scores = load_scorer(cfg.output).score([r["prompt"] for r in rows[-8:]], ["\n".join(r["steps"]) for r in rows[-8:]])
    flat = [s for ss in scores for s in ss]
    assert sum(flat) / len(flat) == pytest.approx(0.25, abs=0.05)
    # and the soft BCE at the optimum is the entropy of the label, H(0.25) = 0.562
    assert metrics["eval/loss"] == pytest.approx(0.5623, abs=0.01)


def test_lm_tokens_head_trains_and_reloads(tmp_path):
    cfg = make_cfg(tmp_path, max_steps=3, **{"head.kind": "lm_tokens", "head.step_tag": "?"})
    stage.run(cfg)
    saved = json.loads((tmp_path / "out" / "prmflow.json").read_text())
    assert saved["prm_head"] == {"kind": "lm_tokens", "good_token": "+", "bad_token": "-", "step_tag": "?"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    scorer = load_scorer(cfg.output)
    assert scorer.prm.head.kind == "lm_tokens"
    (s,) = scorer.score(["Compute left to right: 1+2\n"], ["1+2=3\nanswer: 3"])
    assert len(s) == 2 and all(0 < x < 1 for x in s)
    with pytest.raises(ConfigError, match="is a PRM with head.kind=lm_tokens, but head.kind=token_classification was asked"):
        PRM.load(cfg.output, HeadConfig("token_classification"))


def test_cli_runs_the_stage_and_refuses_bad_config(tmp_path, capsys):
    assert cli.main(["prm", "--output", str(tmp_path / "cli"), "--backbone", "tiny-llama", "--max_steps", "1",
                     "--optim.warmup_steps", "0", "--num_prompts", "8", "--eval_size", "4", "--micro_batch_size", "8",
                     "--engine.backend", "torch", "--tracking.enabled", "false"]) == 0
    assert (tmp_path / "cli" / "manifest.json").is_file()
    assert cli.main(["prm", "--output", str(tmp_path / "x"), "--head.kind", "regression"]) == 2
    assert "head.kind" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_extra_layers_start_as_the_identity_and_only_the_top_trains(tmp_path):
    from prmflow.components.models import modeling
    from prmflow.components.models.prm_model import append_identity_layers

    lm, tok = modeling.build_tiny_model("tiny-llama", seed=0)
    lm.eval()
    ids = torch.tensor([list(range(4, 40))])
    with torch.no_grad():
        before = lm(ids).logits
        append_identity_layers(lm, 2)
        after = lm(ids).logits
    assert torch.equal(before, after) and lm.config.num_hidden_layers == 6
    modeling.save_pretrained(lm, tok, tmp_path / "lm")  # a plain HF directory with 6 layers
    cfg = make_cfg(tmp_path, backbone=str(tmp_path / "lm"), max_steps=3, train_layers=2)
    stage.run(cfg)
    trained, start = weights(tmp_path / "out"), PRM.load(tmp_path / "lm").model.state_dict()
    changed = {n for n in trained if not torch.equal(trained[n], start[n])}
    assert changed and all(n.startswith(("model.layers.4.", "model.layers.5.", "model.norm", "score")) for n in changed)
    assert any(n.startswith("model.layers.5.") for n in changed)


def test_tracking_records_the_prm_metrics(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient

    cfg = make_cfg(tmp_path, max_steps=4, log_every=2, eval_every=2,
                   **{"tracking.enabled": True, "tracking.uri": sqlite_store})
    stage.run(cfg)
    client = MlflowClient(sqlite_store)
    (run,) = client.search_runs([client.get_experiment_by_name("prmflow").experiment_id])
    assert {"train/loss", "train/lr", "train/grad_norm", "prm/eval_step_auc", "prm/eval_step_accuracy",
            "prm/eval_first_error_recall", "prm/eval_loss", "perf/tokens_per_s"} <= set(run.data.metrics)
    assert run.data.tags["prmflow.stage"] == "prm" and run.data.params["head.kind"] == "token_classification"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "prm/eval_step_auc")} == {2, 4}


def test_a_labelled_file_can_be_judged_on_the_exact_arithmetic_split(tmp_path):
    """eval_task=arithmetic: a PRM trained on a file (e.g. prm-label output) is evaluated against the
    exact checker's held-out split, and every file row trains."""
    from prmflow.tasks import arithmetic

    rows = [{"prompt": f"Compute left to right: {a}+2\n", "steps": [f"{a}+2={a + 2}", f"answer: {a + 2}"], "labels": [1, 0.5]}
            for a in range(1, 7)]
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tmp_path, task=str(path), eval_task="arithmetic", eval_size=5)
    train, held_out = data.load_data(cfg)
    assert [e.steps for e in train] == [r["steps"] for r in rows]
    want = data.arithmetic_examples(5, 0, "eval", arithmetic.ArithmeticConfig(), SHORT["negatives_per_problem"])
    assert [(e.prompt, e.steps, e.labels) for e in held_out] == [(e.prompt, e.steps, e.labels) for e in want]
    assert any(min(e.labels) == 0 for e in held_out)


def test_policy_samples_join_the_training_data_labelled_by_the_checker(sft_policy, tmp_path):
    """policy_from_backbone samples the backbone (the pipeline's SFT policy) exactly as
    policy naming it does; every sample carries the exact checker's step labels."""
    from prmflow.errors import ConfigError
    from prmflow.tasks import arithmetic

    base = dict(backbone=str(sft_policy), num_prompts=12, n_samples=2)
    plain, _ = data.load_data(make_cfg(tmp_path, **base))
    by_path, _ = data.load_data(make_cfg(tmp_path, **base, policy=str(sft_policy)))
    by_switch, _ = data.load_data(make_cfg(tmp_path, **base, policy_from_backbone=True))
    key = lambda es: [(e.prompt, e.steps, e.labels) for e in es]  # noqa: E731
    assert key(by_switch) == key(by_path)
    samples = by_switch[len(plain):]
    assert key(by_switch[:len(plain)]) == key(plain) and len(samples) == 12 * 2
    for e in samples:  # the checker's labels, recomputed here: 1 up to the first wrong step, 0 after
        first = arithmetic.first_error(e.prompt, "\n".join(e.steps))
        assert e.labels == [1.0 if first is None or k < first else 0.0 for k in range(len(e.steps))]
    with pytest.raises(ConfigError, match="set one of them"):
        make_cfg(tmp_path, **base, policy_from_backbone=True, policy=str(sft_policy))
    with pytest.raises(ConfigError, match="need a built-in task"):
        make_cfg(tmp_path, **base, policy_from_backbone=True, task=str(tmp_path / "labels.jsonl"))
    with pytest.raises(ConfigError, match="untrained preset"):
        make_cfg(tmp_path, **{**base, "backbone": "tiny-llama"}, policy_from_backbone=True)
    # the sampling keys reach the generation: each solution at most max_new_tokens tokens (the final
    # end-of-sequence one included), in batches of 5 sequences; temperature 0 would repeat one solution
    tok = modeling.load_tokenizer(sft_policy)
    short, _ = data.load_data(make_cfg(tmp_path, **base, policy_from_backbone=True, batch_sequences=5,
                                       **{"sampling.max_new_tokens": 3}))
    lengths = [len(tok("\n".join(e.steps), add_special_tokens=False)["input_ids"]) for e in short[len(plain):]]
    assert len(lengths) == 12 * 2 and max(lengths) <= 3
    assert max(len(tok("\n".join(e.steps), add_special_tokens=False)["input_ids"]) for e in samples) > 3
    with pytest.raises(ConfigError, match="temperature is 0"):
        make_cfg(tmp_path, **base, policy_from_backbone=True, **{"sampling.temperature": 0})


def _many_solutions_per_problem(path, problems: range, solutions: int = 6) -> list[dict]:
    """A Math-Shepherd-like file: `solutions` rows per problem (right and wrong ones alternating), the
    problems interleaved the way a shuffled dump has them."""
    rows = []
    for k in range(solutions):
        for a in problems:
            c = a + 2 if k % 2 == 0 else a + 3
            rows.append({"prompt": f"Compute left to right: {a}+2\n", "steps": [f"{a}+2={c}", f"answer: {c}"],
                         "labels": [float(k % 2 == 0)] * 2})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_a_file_with_many_solutions_per_problem_is_held_out_by_whole_problems(tmp_path):
    """eval_size=10 on 8 problems x 6 solutions: the last rows' problems are held out whole (2 problems,
    12 rows), none of their solutions trains, and the stage's held-out metrics are the scorer's on them."""
    path = tmp_path / "steps.jsonl"
    _many_solutions_per_problem(path, range(1, 9))
    cfg = make_cfg(tmp_path, task=str(path), eval_size=10, max_steps=2)
    train, held_out = data.load_data(cfg)
    assert {e.prompt for e in held_out} == {"Compute left to right: 7+2\n", "Compute left to right: 8+2\n"}
    assert {e.prompt for e in held_out}.isdisjoint({e.prompt for e in train})
    assert (len(train), len(held_out)) == (36, 12)
    metrics = stage.run(cfg)
    scores = load_scorer(cfg.output).score([e.prompt for e in held_out], [e.response() for e in held_out])
    again = step_metrics([e.labels for e in held_out], scores)
    for key in ("eval/step_auc", "eval/step_accuracy", "eval/loss"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-5), key


def test_an_eval_file_sharing_problems_with_the_task_keeps_them_out_of_training(tmp_path):
    """eval_task names a file whose problems 5 and 6 are also in the task file: their training rows are
    dropped (the held-out figures judge unseen problems); every other row trains."""
    _many_solutions_per_problem(tmp_path / "train.jsonl", range(1, 7), solutions=2)
    _many_solutions_per_problem(tmp_path / "eval.jsonl", range(5, 9), solutions=2)
    cfg = make_cfg(tmp_path, task=str(tmp_path / "train.jsonl"), eval_task=str(tmp_path / "eval.jsonl"), eval_size=8)
    train, held_out = data.load_data(cfg)
    problem = lambda e: e.steps[0].split("+")[0]  # noqa: E731
    assert len(held_out) == 8 and sorted({problem(e) for e in train}) == ["1", "2", "3", "4"] and len(train) == 8
