"""prm-label (Math-Shepherd): hard = any continuation reaches the answer, soft = the fraction; the
agreement with the exact checker is reported; the output is the stepwise format the prm stage reads."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest
import torch

from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.sampling import text_sampling
from prmflow import tasks
from prmflow.errors import ModelLoadError
from prmflow.tasks import arithmetic
from prmflow.components.prm import step_examples as data, label


def test_estimate_labels_any_and_fraction():
    hard, soft = label.estimate_labels([[0, 0, 1, 0], [0, 0, 0, 0]], final_correct=0.0)
    assert hard == [1.0, 0.0, 0.0] and soft == [0.25, 0.0, 0.0]
    assert label.estimate_labels([[1, 1]], 1.0) == ([1.0, 1.0], [1.0, 1.0])


def test_step_prefixes_keep_the_text_between_steps():
    assert label.step_prefixes("a=1\n\nb=2\nanswer: 2", "\n") == ["a=1\n\n", "a=1\n\nb=2\n"]
    assert label.step_prefixes("answer: 2", "\n") == []


def _perfect_completion(context: str) -> str:
    """The exact rest of the solution from the value the prefix's last step reached."""
    prompt, _, prefix = context.partition("\n")
    start, ops = arithmetic.parse_problem(prompt + "\n")
    done = [s for s in prefix.split("\n") if s.strip()]
    value = int(re.search(r"=(-?\d+)\s*$", done[-1]).group(1))
    rest, value = arithmetic.solve(value, ops[len(done):])
    return "\n".join(rest)


def test_with_a_perfect_completer_labels_equal_the_exact_checker(tmp_path, monkeypatch):
    """Independent reference: if every continuation computes correctly, a prefix reaches the answer
    exactly when it is right so far, so Math-Shepherd labels must equal arithmetic.step_labels."""
    model, tok = modeling.build_tiny_model()
    modeling.save_pretrained(model, tok, tmp_path / "policy")
    rng = random.Random(0)
    problems = {p.prompt: p for p in arithmetic.generate(12, seed=0, split="train")}
    contexts_seen = []

    def fake_generate(model, tokenizer, prompts, *args, **kwargs):
        contexts_seen.extend(prompts)
        return [(problems[c].solution if rng.random() < 0.4 else arithmetic.corrupt(problems[c], rng)[0])
                if c in problems else _perfect_completion(c) for c in prompts]

    monkeypatch.setattr(text_sampling, "generate_texts", fake_generate)
    cfg = config.load(label.Config, overrides={"policy": str(tmp_path / "policy"), "output": str(tmp_path / "labels"),
                                               "num_prompts": 12, "n_samples": 3, "completions": 2,
                                               "tracking.enabled": False})
    metrics = label.run(cfg)
    assert metrics["label/agreement"] == 1.0 and metrics["label/false_positive_rate"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 36
    for row in rows:
        assert row["labels"] == [float(y) for y in arithmetic.step_labels(row["prompt"], "\n".join(row["steps"]))]
    # every continuation started from the prompt plus a whole-step prefix of one of the solutions
    prefixes = [c for c in contexts_seen if c not in problems]
    assert len(prefixes) == 2 * sum(len(r["steps"]) - 1 for r in rows)
    assert all(c.endswith("\n") for c in prefixes)


def test_real_policy_labels_are_consistent_and_train_ready(tmp_path, sft_policy):
    cfg = config.load(label.Config, overrides={"policy": str(sft_policy), "output": str(tmp_path / "labels"),
                                               "num_prompts": 6, "n_samples": 2, "completions": 3,
                                               "sampling.max_new_tokens": 40, "tracking.enabled": False})
    metrics = label.run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    exact, hard_all = [], []
    for row in rows:
        rec = tasks.PromptRecord(row["id"], row["prompt"], row["answer"])
        assert row["hard_labels"] == [1.0 if s > 0 else 0.0 for s in row["soft_labels"]]
        assert all(abs(s * 3 - round(s * 3)) < 1e-9 for s in row["soft_labels"])  # a fraction of 3 continuations
        assert row["labels"] == row["hard_labels"]
        # the last step is the solution's own final answer
        assert row["hard_labels"][-1] == tasks.verify(rec, "\n".join(row["steps"]))
        exact += arithmetic.step_labels(row["prompt"], "\n".join(row["steps"]))
        hard_all += row["hard_labels"]
    agreement = sum(e == h for e, h in zip(exact, hard_all)) / len(exact)
    assert metrics["label/agreement"] == pytest.approx(agreement)
    manifest = json.loads((tmp_path / "labels" / "manifest.json").read_text())
    assert manifest["metrics"]["label/agreement"] == pytest.approx(agreement) and manifest["rows"] == len(rows)
    loaded = data.load_stepwise(tmp_path / "labels")  # the prm stage reads the directory as its task
    assert [e.steps for e in loaded] == [r["steps"] for r in rows]
    assert label.run(cfg) == metrics  # a finished output is not redone


def test_missing_policy_writes_nothing(tmp_path):
    cfg = config.load(label.Config, overrides={"policy": str(tmp_path / "nope"), "output": str(tmp_path / "labels"),
                                               "tracking.enabled": False})
    with pytest.raises(ModelLoadError, match="policy"):
        label.run(cfg)
    assert not (tmp_path / "labels").exists()


def test_soft_labels_are_the_fraction_of_continuations_that_reach_the_answer(tmp_path, monkeypatch):
    """Independent reference: of every N continuations drawn from a prefix, `good` compute exactly,
    the rest give up with a wrong answer. A prefix that is right so far then reaches the answer in
    exactly good/completions of its continuations, a wrong one in none, so soft = exact * good/N,
    hard = exact; label=soft trains on the soft column."""
    model, tok = modeling.build_tiny_model()
    modeling.save_pretrained(model, tok, tmp_path / "policy")
    rng = random.Random(1)
    problems = {p.prompt: p for p in arithmetic.generate(10, seed=0, split="train")}  # the prompts label.run loads (seed 0)
    completions, good = 4, 1
    seen: dict[str, int] = {}

    def fake_generate(model, tokenizer, prompts, *args, **kwargs):
        out = []
        for c in prompts:
            if c in problems:  # a solution: right or with one wrong step
                out.append(problems[c].solution if rng.random() < 0.4 else arithmetic.corrupt(problems[c], rng)[0])
                continue
            k = seen[c] = seen.get(c, 0) + 1  # two solutions may share a prefix: count per draw of N
            out.append(_perfect_completion(c) if (k - 1) % completions < good else "answer: -1")
        return out

    monkeypatch.setattr(text_sampling, "generate_texts", fake_generate)
    cfg = config.load(label.Config, overrides={"policy": str(tmp_path / "policy"), "output": str(tmp_path / "labels"),
                                               "num_prompts": 10, "n_samples": 2, "completions": completions,
                                               "label": "soft", "tracking.enabled": False})
    metrics = label.run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 20
    abs_err, n = 0.0, 0
    for row in rows:
        exact = [float(y) for y in arithmetic.step_labels(row["prompt"], "\n".join(row["steps"]))]
        want_soft = [y * good / completions for y in exact[:-1]] + [exact[-1]]
        assert row["soft_labels"] == pytest.approx(want_soft)
        assert row["hard_labels"] == exact
        assert row["labels"] == row["soft_labels"]  # label=soft: the column the prm stage trains on
        abs_err += sum(abs(e - s) for e, s in zip(exact, want_soft))
        n += len(exact)
    assert any(0 < s < 1 for row in rows for s in row["soft_labels"])
    assert metrics["label/agreement"] == 1.0
    assert metrics["label/soft_mae"] == pytest.approx(abs_err / n)
    loaded = data.load_stepwise(tmp_path / "labels")
    assert [e.labels for e in loaded] == [r["soft_labels"] for r in rows]


def test_prompts_without_answers_are_a_data_error_and_nothing_is_written(tmp_path):
    from prmflow.errors import DataError

    model, tok = modeling.build_tiny_model()
    modeling.save_pretrained(model, tok, tmp_path / "policy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "1+1?", "answer": "2"}) + "\n"
                       + json.dumps({"id": "b", "prompt": "2+2?"}) + "\n")
    cfg = config.load(label.Config, overrides={"policy": str(tmp_path / "policy"), "output": str(tmp_path / "labels"),
                                               "task": str(prompts), "tracking.enabled": False})
    with pytest.raises(DataError, match=r"prompt 'b' has no reference answer"):
        label.run(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "prompts.jsonl"]


def test_prm_label_and_the_prm_stage_sample_the_policy_where_placement_puts_it(tmp_path, monkeypatch):
    # on a GPU pod both once sampled on the CPU in float32 (the policy was loaded and never moved); "meta"
    # stands in for the GPU placement picks there, and the policy each samples with must be on it in bfloat16
    import torch

    model, tok = modeling.build_tiny_model()
    modeling.save_pretrained(model, tok, tmp_path / "policy")
    monkeypatch.setattr(modeling, "placement", lambda device="", dtype="auto": (torch.device("meta"), "bfloat16"))
    problems = {p.prompt: p for p in arithmetic.generate(2, seed=0, split="train")}
    seen = []

    def fake_generate(model, tokenizer, prompts, *args, **kwargs):
        seen.append({(p.device.type, p.dtype) for p in model.parameters()})
        return [problems[c].solution if c in problems else _perfect_completion(c) for c in prompts]

    monkeypatch.setattr(text_sampling, "generate_texts", fake_generate)
    cfg = config.load(label.Config, overrides={"policy": str(tmp_path / "policy"), "output": str(tmp_path / "labels"),
                                               "num_prompts": 2, "n_samples": 1, "completions": 1,
                                               "tracking.enabled": False})
    label.run(cfg)
    monkeypatch.setattr(data, "generate_texts", fake_generate)
    records = tasks.load("arithmetic", "train", 2, 0)
    data.policy_examples(str(tmp_path / "policy"), records, 1)
    assert len(seen) >= 3 and all(s == {("meta", torch.bfloat16)} for s in seen)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(),
                    reason="reads what the CPU stand-in (tests/fake_vllm.py) recorded")
def test_sampler_vllm_draws_every_solution_and_continuation_from_one_engine(vllm_module, sft_policy, tmp_path):
    made = len(vllm_module.ENGINES)
    cfg = config.load(label.Config, overrides={"policy": str(sft_policy), "output": str(tmp_path / "labels"),
                                               "num_prompts": 3, "n_samples": 2, "completions": 2,
                                               "sampling.max_new_tokens": 40, "tracking.enabled": False,
                                               "sampler": "vllm", "vllm.gpu_memory_utilization": 0.5})
    label.run(cfg)
    engines = vllm_module.ENGINES[made:]
    assert len(engines) == 1 and not engines[0].alive  # shut down when the stage ended
    engine = engines[0]
    assert engine.kwargs["dtype"] == "bfloat16" and engine.kwargs["gpu_memory_utilization"] == 0.5  # auto, the settings
    rows = [json.loads(line) for line in (tmp_path / "labels" / "labels.jsonl").read_text().splitlines()]
    tok = modeling.load_tokenizer(sft_policy)
    # 3 x 2 solutions first, then `completions` continuations from every step prefix but the last of each kept one
    assert len(engine.requests) == 6 + 2 * sum(len(r["steps"]) - 1 for r in rows)
    solution_ids = {tuple(tok(r.prompt)["input_ids"]) for r in tasks.load("arithmetic", "train", 3, 0)}
    assert {tuple(r["prompt_token_ids"]) for r in engine.requests[:6]} == solution_ids
    contexts = [tok(row["prompt"] + "\n".join(row["steps"][:k + 1]) + "\n")["input_ids"]
                for row in rows for k in range(len(row["steps"]) - 1) for _ in range(2)]
    assert sorted(r["prompt_token_ids"] for r in engine.requests[6:]) == sorted(contexts)
    assert len({p.seed for p in engine.params}) == len(engine.params)  # no two draws share a seed


def test_a_tiny_preset_policy_is_taken_as_the_error_offers(tmp_path):
    cfg = config.load(label.Config, overrides={"policy": "tiny-llama", "output": str(tmp_path / "labels"),
                                               "num_prompts": 2, "n_samples": 1, "completions": 1,
                                               "sampling.max_new_tokens": 4, "tracking.enabled": False})
    assert label.run(cfg)["label/solutions"] >= 0 and (tmp_path / "labels" / "labels.jsonl").is_file()
