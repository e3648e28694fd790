import importlib.util
import json
import re

import pytest
import torch

from prmflow.components import config
from prmflow.components.models import modeling
from prmflow import tasks, tracking
from prmflow.components.sampling.generation import generate_texts
from prmflow.components.evaluate import report, stage


@pytest.fixture(scope="module")
def flat_prm(sft_policy, tmp_path_factory):
    """A real PRM directory whose head is zero: every step scores exactly 0.5."""
    out = tmp_path_factory.mktemp("prm") / "prm"
    model, tok = modeling.load_scalar_model(sft_policy)
    modeling.save_pretrained(model, tok, out)
    return out


def test_metrics_against_independent_recomputation(sft_policy, flat_prm, tmp_path, sqlite_store):
    parent = tracking.start_pipeline_run(tracking.TrackingConfig(uri=sqlite_store, pipeline_run_id="kfp-1"))
    cfg = config.load(stage.Config, overrides={
        "policy": str(sft_policy), "prm": str(flat_prm), "baseline": str(sft_policy), "output": str(tmp_path / "eval"),
        "num_prompts": 24, "n_samples": 4, "sampling.max_new_tokens": 40, "tracking.uri": sqlite_store,
        "tracking.pipeline_run_id": "kfp-1", "device": "cpu"})  # as the recomputation below: on a GPU the stage's
    # default is bfloat16 there, whose greedy answers differ (an H200, 2026-11-27: accuracy 0.458 against 0.417)
    m = stage.run(cfg)
    # greedy pass@1, recomputed here with plain generation + the verifier
    records = tasks.load("arithmetic", "test", 24, 0)
    model, tok = modeling.load_causal_lm(sft_policy)
    greedy = generate_texts(model, tok, [r.prompt for r in records], 40)
    assert m["eval/accuracy"] == pytest.approx(sum(tasks.verify(r, g) for r, g in zip(records, greedy)) / 24)
    assert m["eval/baseline_accuracy"] == m["eval/accuracy"]  # same policy
    assert m["eval/mean_at_4"] <= m["eval/pass_at_4"] and m["eval/pass_at_4"] > 0
    for agg in ("min", "last", "mean"):  # every step scores 0.5: these tie, so best-of-k = a random pick
        assert m[f"eval/bon_{agg}"] == pytest.approx(m["eval/mean_at_4"])
    assert 0 <= m["eval/bon_product"] <= m["eval/pass_at_4"]  # product = 0.5^steps prefers short answers
    # format errors: greedy responses with no `answer: N` line; length: their mean token count
    answered = [any(re.fullmatch(r"\s*answer\s*:\s*-?\d+\s*", line, re.IGNORECASE) for line in g.split("\n"))
                for g in greedy]
    assert m["eval/format_errors"] == pytest.approx(answered.count(False) / 24)
    assert m["eval/response_length"] == pytest.approx(
        sum(len(tok(g, add_special_tokens=False)["input_ids"]) for g in greedy) / 24)
    # perf: the tokens it sampled (4 per prompt, drawn again here with the stage's seed) and its greedy ones
    sampled = generate_texts(model, tok, [r.prompt for r in records for _ in range(4)], 40, batch_size=256,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in sampled + greedy)
    assert m["perf/sample_tokens"] == tokens
    assert m["perf/tokens_per_s"] == pytest.approx(tokens / m["perf/sample_s"])
    assert m["perf/score_s"] > 0 and m["perf/baseline_s"] > 0
    out = tmp_path / "eval"
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(m)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(s == pytest.approx([0.5] * len(s)) for s in (r["step_scores"] for r in rows))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(sqlite_store)
    on_parent = client.get_run(parent.run_id).data.metrics
    assert on_parent["final/accuracy"] == pytest.approx(m["eval/accuracy"])
    assert not [k for k in on_parent if k.startswith("perf/")]  # the stage's timings stay on the stage's run


def test_per_step_view_marks_the_first_wrong_step():
    prompt = "Compute left to right: 3+4*2-1\n"
    page = report.per_step_html([
        {"prompt_id": "a", "prompt": prompt, "response": "3+4=7\n7*2=15\n15-1=14\nanswer: 14", "correct": 0.0,
         "step_scores": [0.9, 0.2, 0.6, 0.5], "source": "arithmetic"},
        {"prompt_id": "b", "prompt": prompt, "response": "3+4=7\n7*2=14\n14-1=13\nanswer: 13", "correct": 1.0,
         "step_scores": None, "source": "arithmetic"},
    ])
    assert page.count("&larr; first wrong step") == 1
    marked = page.split("class='step wrong'")[1]
    assert marked.split("</span>")[0].endswith("7*2=15 &larr; first wrong step<span class='score'>0.200")
    assert "rgb(255,0,80)" == report.score_colour(0.0) and "rgb(0,200,80)" == report.score_colour(1.0)


def test_missing_policy_is_a_clear_error(tmp_path):
    from prmflow import cli

    code = cli.main(["evaluate", "--policy", str(tmp_path / "none"), "--output", str(tmp_path / "e"),
                     "--tracking.enabled", "false"])
    assert code == 2 and not (tmp_path / "e").exists()


def test_prompts_without_an_answer_are_named_by_evaluate_s_own_key(tmp_path, capsys):
    """evaluate's prompts come from its `task` key, but a file whose rows lack an answer was reported as "bon.task
    'FILE': ..." (the prm stage's key, which evaluate does not have). Now `task`, exit 2, nothing written."""
    from prmflow import cli

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "1+2"}\n')
    code = cli.main(["evaluate", "--policy", "tiny-llama", "--task", str(data), "--num_prompts", "2",
                     "--output", str(tmp_path / "e"), "--tracking.enabled", "false"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "e").exists()
    assert f"prmflow evaluate: error: task '{data}': 1 prompts have no reference answer" in err, err
    assert "bon.task" not in err


def _gsm8k_rows(first, count):
    return [{"question": f"Tom has {k} apples and buys 2 more. How many apples does he have?",
             "answer": f"{k}+2 = <<{k}+2={k + 2}>>{k + 2}\n#### {k + 2}"} for k in range(first, first + count)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_evaluate_refuses_prompts_the_policy_trained_on_naming_both_files(tmp_path, capsys):
    """A file has no splits: evaluate on the training file scored its first rows, which SFT and rollout had
    trained on. With train_tasks (a pipeline fills in sft.task and rollout.task) it exits 2 naming both files and
    the first shared prompt, nothing written; a held-out file passes the check."""
    from prmflow import cli

    train = _write(tmp_path / "train.jsonl", _gsm8k_rows(0, 6))
    held_out = _write(tmp_path / "test.jsonl", _gsm8k_rows(4, 1) + _gsm8k_rows(100, 2))  # one row of train slipped in
    base = ["evaluate", "--policy", "tiny-llama", "--num_prompts", "3", "--tracking.enabled", "false"]
    code = cli.main(base + ["--task", train, "--train_tasks", json.dumps([train]), "--output", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "e").exists()
    assert f"task '{train}': 3 of its 3 evaluated prompts are also in the training data '{train}'" in err, err
    code = cli.main(base + ["--task", held_out, "--train_tasks", json.dumps(["arithmetic", train]),
                            "--output", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and f"task '{held_out}': 1 of its 3 evaluated prompts are also in the training data '{train}'" in err
    records = tasks.load(_write(tmp_path / "clean.jsonl", _gsm8k_rows(100, 3)), "eval", 3)
    tasks.check_held_out(records, [train], "clean.jsonl")  # disjoint: no error


def test_evaluate_on_a_dataset_with_no_train_tasks_warns_that_nothing_checks_it(tmp_path, caplog):
    data = _write(tmp_path / "test.jsonl", _gsm8k_rows(100, 1))
    cfg = config.load(stage.Config, overrides={
        "policy": "tiny-llama", "task": data, "num_prompts": 1, "n_samples": 1, "sampling.max_new_tokens": 2,
        "output": str(tmp_path / "e"), "tracking.enabled": False, "device": "cpu"})
    with caplog.at_level("WARNING"):
        stage.run(cfg)
    assert f"task '{data}' is a dataset and train_tasks is empty" in caplog.text


def test_held_out_reads_of_a_save_to_disk_dataset_take_its_test_split(tmp_path):
    """A `datasets` directory (as save_to_disk writes it; a hub id reads the same way) without ?split=: training
    reads its train split, evaluate (best-of-N's prompts) its test split; with no test split, a held-out read is
    an error listing the splits, not the train split scored as held out."""
    import datasets

    from prmflow.components.scoring import bestofn
    from prmflow.errors import DataError

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_gsm8k_rows(0, 4)),
                               "test": datasets.Dataset.from_list(_gsm8k_rows(100, 2))})
    dd.save_to_disk(str(tmp_path / "gsm8k"))
    train = [r.answer for r in tasks.load(str(tmp_path / "gsm8k"))]
    evaluated = [r.answer for r in bestofn.load_prompts(bestofn.BestOfNConfig(task=str(tmp_path / "gsm8k"),
                                                                              num_prompts=10), key="task")]
    assert (train, evaluated) == (["2", "3", "4", "5"], ["102", "103"])
    assert [r.answer for r in tasks.load(str(tmp_path / "gsm8k") + "?split=train", "eval")] == train  # asked for
    datasets.DatasetDict({"train": dd["train"]}).save_to_disk(str(tmp_path / "only-train"))
    with pytest.raises(DataError, match=r"has splits \['train'\] and none is 'test': held-out prompts"):
        tasks.load(str(tmp_path / "only-train"), "eval")


def test_a_pipeline_gives_evaluate_the_datasets_the_policy_trains_on(tmp_path):
    from prmflow.pipelines import settings

    data = {"sft": {"task": "data/sft.jsonl", "eval_task": "data/test.jsonl"}, "rollout": {"task": "data/rl/"},
            "ppo": {"ptx_coef": 0.1, "ptx_task": "data/sft.jsonl"}, "evaluate": {"task": "data/test.jsonl"}}
    spec = settings.load_spec(None, data=data)
    assert spec.stages["evaluate"]["train_tasks"] == ["data/sft.jsonl", "data/rl/"]
    data["evaluate"]["train_tasks"] = []  # said so: nothing is added
    assert settings.load_spec(None, data=data).stages["evaluate"]["train_tasks"] == []
    assert "train_tasks" not in settings.load_spec(None, data={"evaluate": {}}).stages["evaluate"]  # built-in tasks


def perturbed_copy(policy, path, seed=1):
    """`policy`'s directory with other weights (noise added): the same architecture, tokenizer and stop ids."""
    model, tok = modeling.load_causal_lm(policy)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn(w.shape, generator=gen) * 0.05)
    modeling.save_pretrained(model, tok, path)
    return path


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(),
                    reason="reads what the CPU stand-in (tests/fake_vllm.py) recorded")
@pytest.mark.parametrize("baseline_kind", ["other-weights", "other-architecture"])
def test_sampler_vllm_samples_policy_and_baseline_through_one_engine_and_frees_it_before_the_prm(
        vllm_module, sft_policy, flat_prm, tmp_path, monkeypatch, baseline_kind):
    """The baseline's greedy solutions come from the policy's running engine, its weights read in (a second engine
    start in one evaluate process never came up on an H200, docs/testing.md); a baseline of another architecture
    gets its own engine. Either way the baseline's solutions are its own model's greedy ones."""
    from prmflow.components.scoring import bestofn, prm_scoring

    made = len(vllm_module.ENGINES)
    alive_when_the_prm_loaded = []
    scorer_init = prm_scoring.PRMScorer.__init__

    def recording_init(self, *args, **kwargs):
        alive_when_the_prm_loaded.append([e.alive for e in vllm_module.ENGINES[made:]])
        scorer_init(self, *args, **kwargs)

    monkeypatch.setattr(prm_scoring.PRMScorer, "__init__", recording_init)
    results = []
    real_sample = bestofn.sample
    monkeypatch.setattr(bestofn, "sample", lambda *a, **k: results.append(real_sample(*a, **k)) or results[-1])
    if baseline_kind == "other-weights":
        baseline = perturbed_copy(sft_policy, tmp_path / "baseline")
    else:
        model, tok = modeling.load_causal_lm("tiny-qwen2", seed=3)
        baseline = tmp_path / "baseline"
        modeling.save_pretrained(model, tok, baseline)
    # 0.6 of the GPU each: the stand-in refuses a second engine while the first still holds its memory
    cfg = config.load(stage.Config, overrides={
        "policy": str(sft_policy), "prm": str(flat_prm), "baseline": str(baseline), "output": str(tmp_path / "eval"),
        "num_prompts": 6, "n_samples": 3, "sampling.max_new_tokens": 24, "tracking.enabled": False,
        "sampler": "vllm", "dtype": "float32", "vllm.gpu_memory_utilization": 0.6})
    m = stage.run(cfg)
    engines = vllm_module.ENGINES[made:]
    assert not any(e.alive for e in engines)
    if baseline_kind == "other-weights":
        assert len(engines) == 1 and engines[0].reloads == [str(baseline)] and engines[0].prefix_cache_fresh
    else:
        assert len(engines) == 2 and engines[0].reloads == []
    assert alive_when_the_prm_loaded == [[False] * len(engines)]  # every engine gone before the PRM loaded
    policy_engine = engines[0]
    # 6 x 3 sampled requests, each its own seed, then 6 greedy ones (then, on the one engine, the baseline's 6)
    sampled, greedy_params = policy_engine.params[:18], policy_engine.params[18:24]
    assert len(greedy_params) == 6 and all(p.temperature == 0 for p in greedy_params)
    assert all(p.temperature == 1.0 and p.n == 1 for p in sampled) and len({p.seed for p in sampled}) == 18
    # independent reference: HF's own greedy generation of each model gives the same texts and the same accuracy
    records = tasks.load("arithmetic", "test", 6, 0)
    model, tok = modeling.load_causal_lm(sft_policy)
    hf_greedy = generate_texts(model, tok, [r.prompt for r in records], 24)
    assert [r["prompt_token_ids"] for r in policy_engine.requests[18:24]] == [tok(r.prompt)["input_ids"] for r in records]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["response"] for r in rows] == hf_greedy
    assert m["eval/accuracy"] == pytest.approx(sum(tasks.verify(r, g) for r, g in zip(records, hf_greedy)) / 6)
    base_model, base_tok = modeling.load_causal_lm(str(baseline))
    base_greedy = generate_texts(base_model, base_tok, [r.prompt for r in records], 24)
    assert results[0].baseline_greedy == base_greedy != hf_greedy
    assert m["eval/baseline_accuracy"] == pytest.approx(sum(tasks.verify(r, g) for r, g in zip(records, base_greedy)) / 6)


def test_sampler_vllm_refuses_what_vllm_would_before_a_model_loads(tmp_path):
    from prmflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sampling.temperature=2.5: vLLM accepts temperatures in \[0, 2\]"):
        config.load(stage.Config, overrides={"policy": "nowhere", "sampler": "vllm", "sampling.temperature": 2.5})
    config.load(stage.Config, overrides={"policy": "nowhere", "sampling.temperature": 2.5})  # hf takes it


def test_a_tiny_preset_is_taken_where_the_error_offers_it_and_a_missing_baseline_is_refused_before_sampling(
        tmp_path, capsys, monkeypatch):
    from prmflow import cli
    from prmflow.components.scoring import bestofn

    base = ["evaluate", "--policy", "tiny-llama", "--num_prompts", "2", "--n_samples", "2",
            "--sampling.max_new_tokens", "4", "--tracking.enabled", "false"]
    # "policy 'tiny-llama' does not exist ... or use a tiny preset: ['tiny-llama', ...]" was the answer before
    assert cli.main([*base, "--output", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["eval/accuracy"] >= 0

    def sampled(*args, **kwargs):
        raise AssertionError("the policy was sampled before the baseline was checked")

    monkeypatch.setattr(bestofn, "sample", sampled)
    assert cli.main([*base, "--baseline", str(tmp_path / "nowhere"), "--output", str(tmp_path / "eval2")]) == 2
    assert f"baseline '{tmp_path / 'nowhere'}' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "eval2").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(),
                    reason="reads what the CPU stand-in (tests/fake_vllm.py) recorded")
def test_sampler_vllm_names_a_prompt_that_fills_max_model_len_and_shuts_its_engine_down(vllm_module, sft_policy, tmp_path):
    from prmflow.errors import DataError

    made = len(vllm_module.ENGINES)
    cfg = config.load(stage.Config, overrides={
        "policy": str(sft_policy), "output": str(tmp_path / "eval"), "num_prompts": 3, "n_samples": 2,
        "tracking.enabled": False, "sampler": "vllm", "dtype": "float32", "vllm.max_model_len": 12})
    with pytest.raises(DataError, match=r"prompt\(s\) do not fit vllm.max_model_len=12 \(the first, prompt 0, has \d+ tokens\)"):
        stage.run(cfg)
    engines = vllm_module.ENGINES[made:]
    assert len(engines) == 1 and not engines[0].alive and engines[0].requests == []  # refused before vLLM saw one
    assert not (tmp_path / "eval").exists()
