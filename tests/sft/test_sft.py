"""SFT stage: it learns, both engines agree, checkpoints reload, resume is exact, bad input is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from prmflow import cli
from prmflow.components.training import checkpoint
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow import tasks
from prmflow.components.training import supervised_data as data
from prmflow.components.sft import stage

SHORT = {"num_prompts": 256, "eval_size": 16, "max_steps": 12, "micro_batch_size": 16, "optim.warmup_steps": 2,
         "eval_every": 0, "save_every": 0, "eval_max_new_tokens": 24, "engine.backend": "torch",
         "tracking.enabled": False}


def make_cfg(tmp_path, name="out", **over):
    return config.load(stage.Config, overrides={**SHORT, "output": str(tmp_path / name), **over})


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_policy_learns_the_task(sft_policy):
    """The shared SFT policy beats the untrained model on held-out problems, by the task's verifier."""
    manifest = json.loads((sft_policy / "manifest.json").read_text())
    trained = manifest["metrics"]
    cfg = config.load(stage.Config, overrides={"eval_size": 100, "engine.backend": "torch"})
    _, held_out = stage.load_data(cfg)
    model, tok = modeling.build_tiny_model("tiny-llama", seed=0)  # what SFT started from
    examples, _ = data.tokenize(held_out, tok, cfg.max_seq_len, where="eval")
    untrained = stage.evaluate(model, tok, examples, held_out, cfg)
    assert untrained["eval/accuracy"] == 0.0
    assert trained["eval/loss"] < 0.3 * untrained["eval/loss"]
    assert trained["eval/accuracy"] >= 0.2  # well above the untrained model's 0
    # and the saved policy really is that good: re-score it here, independently of the stage's own number
    policy, ptok = modeling.load_causal_lm(sft_policy)
    again = stage.evaluate(policy, ptok, examples, held_out, cfg)
    assert again["eval/accuracy"] == pytest.approx(trained["eval/accuracy"], abs=1e-9)


def test_checkpoint_reloads_with_the_same_logits(tmp_path, monkeypatch):
    captured = {}
    original = stage.modeling.save_pretrained

    def spy(model, tokenizer, directory, extra=None):
        captured["model"] = copy.deepcopy(modeling.unwrap(model)).cpu().eval()  # off the GPU, where there is one
        return original(model, tokenizer, directory, extra)

    monkeypatch.setattr(stage.modeling, "save_pretrained", spy)
    cfg = make_cfg(tmp_path)
    stage.run(cfg)
    reloaded = AutoModelForCausalLM.from_pretrained(cfg.output).eval()
    ids = torch.tensor([list(range(4, 40))])
    with torch.no_grad():
        assert torch.equal(captured["model"](ids).logits, reloaded(ids).logits)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["kind"] == "policy" and "model.safetensors" in manifest["files"]
    assert not checkpoint.work_dir_for(cfg.output).exists()  # the resume state is gone once committed


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_and_plain_engines_agree(tmp_path, zero_stage):
    plain = make_cfg(tmp_path, "plain", max_steps=6, grad_accum=2, micro_batch_size=8)
    ds = make_cfg(tmp_path, "ds", max_steps=6, grad_accum=2, micro_batch_size=8,
                  **{"engine.backend": "deepspeed", "engine.zero_stage": zero_stage})
    stage.run(plain)
    stage.run(ds)
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "ds")
    start, _ = modeling.build_tiny_model("tiny-llama", seed=0)
    s = dict(start.named_parameters())
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-5), name
    moved = max(float((a[n] - s[n].detach()).abs().max()) for n in a)
    assert moved > 1e-3  # training really changed the weights


def test_micro_batches_of_a_step_are_cut_from_its_examples_sorted_by_length(tmp_path, monkeypatch):
    """With grad_accum > 1 a step's examples are sorted by length before they are cut into micro-batches
    (less padding); the step's loss is the same mean as with the step in one micro-batch."""
    seen = []
    collate = stage.SFTObjective.collate

    def recording(self, examples):
        seen.append([len(e.input_ids) for e in examples])
        return collate(self, examples)

    monkeypatch.setattr(stage.SFTObjective, "collate", recording)
    # half bare answers: lengths in a step vary widely, so an unsorted cut is all but never in order
    mixed = {"max_steps": 1, "optim.warmup_steps": 0, "arithmetic.direct_answer_frac": 0.5}
    split = stage.run(make_cfg(tmp_path, "split", micro_batch_size=4, grad_accum=4, **mixed))
    assert len(seen) == 4 and all(len(b) == 4 for b in seen)
    lengths = [n for b in seen for n in b]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], seen
    padded = sum(max(b) * len(b) for b in seen)
    assert padded < max(lengths) * len(lengths)  # fewer padded tokens than one 16-example batch
    seen.clear()
    whole = stage.run(make_cfg(tmp_path, "whole", micro_batch_size=16, grad_accum=1, **mixed))
    assert sorted(seen[0]) == lengths  # the same 16 examples
    assert split["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-6)


def test_resume_continues_steps_schedule_and_data_order(tmp_path, monkeypatch):
    full = make_cfg(tmp_path, "full", max_steps=12, save_every=5)
    stage.run(full)

    cut = make_cfg(tmp_path, "cut", max_steps=12, save_every=5)
    real_save = checkpoint.save
    saves = []

    def preempted(*args, **kwargs):
        path = real_save(*args, **kwargs)
        saves.append(json.loads((path / "state" / "trainer_state.json").read_text()))
        raise KeyboardInterrupt("preempted")  # the pod dies right after its first checkpoint

    monkeypatch.setattr(stage.checkpoint, "save", preempted)
    with pytest.raises(KeyboardInterrupt):
        stage.run(cut)
    assert saves == [{"step": 5, "consumed": 80}]
    assert not (tmp_path / "cut").exists()  # no partial output

    monkeypatch.setattr(stage.checkpoint, "save", real_save)
    lrs = []
    monkeypatch.setattr(stage.TrainEngine, "step",
                        lambda self, _orig=stage.TrainEngine.step: (lrs.append(self.lr), _orig(self))[1])
    stage.run(cut)
    assert len(lrs) == 7  # steps 6..12 only
    a, b = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert all(torch.equal(a[n], b[n]) for n in a)  # bit-for-bit the uninterrupted result


def test_lora_trains_adapters_and_saves_a_plain_model(tmp_path):
    cfg = make_cfg(tmp_path, max_steps=5, lora_r=4, **{"optim.lr": 1e-2})
    stage.run(cfg)
    out = weights(tmp_path / "out")
    assert not any("lora" in k for k in out)  # merged: later stages load a plain model
    start, _ = modeling.build_tiny_model("tiny-llama", seed=0)
    s = {k: v.detach() for k, v in start.state_dict().items()}
    changed = {k for k in out if not torch.equal(out[k], s[k])}
    assert changed and all(any(m in k for m in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)


def test_tracking_records_metrics_and_params(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient

    cfg = make_cfg(tmp_path, max_steps=10, log_every=2, **{"tracking.enabled": True, "tracking.uri": sqlite_store})
    stage.run(cfg)
    client = MlflowClient(sqlite_store)
    (run,) = client.search_runs([client.get_experiment_by_name("prmflow").experiment_id])
    assert {"train/loss", "train/lr", "sft/eval_accuracy", "sft/eval_loss", "perf/tokens_per_s"} <= set(run.data.metrics)
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["engine.backend"] == "torch"
    assert run.data.tags["prmflow.stage"] == "sft" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6, 8, 10]
    assert history[-1].value < history[0].value


# --- bad input: one clear paragraph, exit 2, nothing written -------------------------------------

def run_cli(args, capsys):
    code = cli.main(["sft", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("make,needle", [
    (lambda d: ["--set", "max_stepz=3"], "'max_stepz' is not a config key. Did you mean 'max_steps'?"),
    (lambda d: ["--optim.lr", "fast"], "key 'optim.lr' must be float"),
    (lambda d: ["--task", str(d / "missing.jsonl")], "missing.jsonl' does not exist"),
    (lambda d: ["--task", str(_write(d / "empty.jsonl", ""))], "empty.jsonl' is empty"),
    (lambda d: ["--task", str(_write(d / "bad.jsonl", '{"prompt": "a", "response": "b"}\n{oops\n'))],
     "bad.jsonl, line 2: not valid JSON"),
    (lambda d: ["--task", str(_write(d / "nocol.jsonl", '{"question": "a", "response": "b"}\n'))],
     "nocol.jsonl, line 1: cannot tell the dataset's format from its columns ['question', 'response']"),
    (lambda d: ["--policy", str(_mkdir(d / "notamodel"))], "is not a model directory: it has no config.json"),
    (lambda d: ["--optim.warmup_steps", "50", "--max_steps", "10"], "warmup_steps (50) must be smaller than max_steps (10)"),
])
def test_bad_input_is_a_clear_error_with_nothing_written(tmp_path, capsys, make, needle):
    out = tmp_path / "out"
    code, err = run_cli(["--max_steps", "40", *make(tmp_path), "--output", str(out), "--tracking.enabled", "false"], capsys)
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert not out.exists() and not checkpoint.work_dir_for(out).exists()


def _write(path, text):
    path.write_text(text)
    return path


def _mkdir(path):
    path.mkdir()
    return path


def test_user_dataset_with_chat_messages_trains(tmp_path):
    rows = [{"messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.response}],
             "answer": p.answer} for p in tasks.load("arithmetic", "train", 80, 0)]
    f = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    metrics = stage.run(make_cfg(tmp_path, task=str(f), eval_size=8, max_steps=3, micro_batch_size=8))
    assert metrics["eval/loss"] > 0  # the held-out rows have assistant tokens to score
    start, _ = modeling.build_tiny_model("tiny-llama", seed=0)
    s, out = start.state_dict(), weights(tmp_path / "out")
    assert any(not torch.equal(out[k], s[k]) for k in out)  # and it trained on them
