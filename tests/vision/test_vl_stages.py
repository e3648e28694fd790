"""Vision-language through every stage with the tiny VL model (LLaVA built from a config): the
images travel in the hand-offs, every model pass sees them, each stage checks image tokens against
image features before an update, and bad images stop a stage with the row named and nothing written."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest
import torch

from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.components.data import io, schema
from prmflow.components.models import modeling, vision
from prmflow import tasks
from prmflow.errors import ConfigError, DataError
from prmflow.components.evaluate import stage as evaluate
from prmflow.components.ppo import minibatches as ppo_batch, stage as ppo
from prmflow.components.prm import stage as prm
from prmflow.components.scoring.prm_scoring import PRMScorer
from prmflow.components.rollout import stage as rollout
from prmflow.components.sft import stage as sft

OFF = {"enabled": False}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """sft (a few steps) -> prm (lm_tokens head on the SFT backbone) -> rollout (with PRM step
    rewards) -> advantage, on the visual task."""
    root = tmp_path_factory.mktemp("vl")
    sft.run(config.build(sft.Config, {
        "policy": "tiny-llava", "task": "visual", "output": str(root / "sft"), "max_steps": 12, "optim.warmup_steps": 2,
        "num_prompts": 200, "eval_size": 8, "micro_batch_size": 8, "eval_every": 12, "save_every": 0,
        "engine": {"backend": "torch"}, "tracking": OFF}))
    prm.run(config.build(prm.Config, {
        "backbone": str(root / "sft"), "task": "visual", "output": str(root / "prm"), "head": {"kind": "lm_tokens"},
        "extra_layers": 0, "train_layers": 0, "max_steps": 6, "optim.warmup_steps": 1, "num_prompts": 40, "eval_size": 10,
        "micro_batch_size": 8, "eval_every": 6, "save_every": 0, "engine": {"backend": "torch"}, "tracking": OFF}))
    rollout.run(config.build(rollout.Config, {
        "policy": str(root / "sft"), "prm": str(root / "prm"), "task": "visual", "output": str(root / "rollouts"),
        "num_prompts": 6, "n_samples": 4, "sampling.max_new_tokens": 24, "tracking": OFF,
        "dtype": "float32"}))  # checked against float32 references below (auto is bf16 on a GPU)
    advantage.run(config.build(advantage.Config, {
        "input": str(root / "rollouts"), "output": str(root / "adv"), "estimator": "grpo_process", "tracking": OFF}))
    return root


def test_rollouts_carry_the_images_and_score_with_them(chain):
    rows = schema.read_dataset(chain / "rollouts", "rollouts").to_pylist()
    policy, tok = modeling.load_causal_lm(chain / "sft")
    records = {r.prompt_id: r for r in tasks.load("visual", "train", 6, 0 * 100_003 + 0)}
    assert len(rows) == 24
    for row in rows[::5]:
        rec = records[row["prompt_id"]]
        assert row["images"] == rec.images  # the prompt's own image, as bytes
        # reference: the processor on this one sequence, unpadded, and one forward pass
        enc = vision.processor_of(tok)(text=[row["prompt"]], images=[vision.decode_image(rec.images[0], "x")],
                                       return_tensors="pt")
        assert enc["input_ids"][0].tolist() == row["prompt_ids"]
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(policy(input_ids=ids, pixel_values=enc["pixel_values"]).logits[0, :-1].float(), -1)
        p = len(row["prompt_ids"])
        want = logp[p - 1:p - 1 + len(row["response_ids"])].gather(-1, ids[0, p:, None])[:, 0]
        assert torch.allclose(torch.tensor(row["old_logprobs"]), want, atol=1e-5)
        assert len(row["step_rewards"]) == len(row["step_ends"])


def test_the_vl_prm_sees_the_image(chain):
    scorer = PRMScorer(str(chain / "prm"))
    rec = tasks.load("visual", "test", 2, 0)
    response = f"{rec[0].response.splitlines()[0]}\nanswer: 3"
    same_text = [rec[0].prompt, rec[0].prompt]
    a, b = scorer.score(same_text, [response, response], images=[rec[0].images, rec[1].images])
    assert len(a) == 2 and a != b  # the same text with another image scores differently


def test_a_text_prm_refuses_images():
    from prmflow.components.models.prm_model import prompt_ids

    with pytest.raises(DataError, match="needs a vision-language PRM"):
        prompt_ids(modeling.load_tokenizer("tiny-llama"), "<image>x", tasks.load("visual", "test", 1, 0)[0].images)


def test_the_vl_prm_needs_the_lm_tokens_head(chain):
    with pytest.raises(ConfigError, match="vision-language model: read its steps with head.kind=lm_tokens"):
        from prmflow.components.models.prm_model import PRM

        PRM.load(str(chain / "sft"))


def _adv_table(chain) -> pa.Table:
    return schema.read_dataset(chain / "adv", "advantages")


def test_ppo_refeeds_pixels_and_trains(chain, tmp_path):
    m = ppo.run(config.build(ppo.Config, {
        "policy": str(chain / "sft"), "input": str(chain / "adv"), "output": str(tmp_path / "ppo"),
        "minibatch_size": 8, "micro_batch_size": 4, "epochs": 1, "engine": {"backend": "torch"}, "tracking": OFF}))
    assert m["train/skipped_updates"] == 0 and m["train/skipped_image_mismatch"] == 0
    first = _history(tmp_path / "ppo")[0]
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-5) and first["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert (tmp_path / "ppo" / "policy" / "processor_config.json").is_file()  # still a complete VL directory


def test_ppo_skips_a_batch_whose_image_tokens_do_not_match(chain, tmp_path, caplog):
    table = _adv_table(chain)
    prompt_ids = table.column("prompt_ids").to_pylist()
    image_id = modeling.load_causal_lm(chain / "sft")[0].config.image_token_index
    bad_row = 5
    assert prompt_ids[bad_row][-4:] == [image_id] * 4
    prompt_ids[bad_row] = prompt_ids[bad_row][:-1]  # one image token lost
    table = table.set_column(table.schema.get_field_index("prompt_ids"), "prompt_ids",
                             pa.array(prompt_ids, pa.list_(pa.int32())))
    schema.write_dataset(tmp_path / "adv", table, "advantages")
    plan = ppo_batch.minibatch_plan(table.num_rows, config.build(ppo.Config, {"minibatch_size": 8, "epochs": 1}))
    hit = [u for u, rows in enumerate(plan) if bad_row in rows]
    with caplog.at_level(logging.WARNING):
        ppo.run(config.build(ppo.Config, {
            "policy": str(chain / "sft"), "input": str(tmp_path / "adv"), "output": str(tmp_path / "ppo"),
            "minibatch_size": 8, "micro_batch_size": 4, "epochs": 1, "engine": {"backend": "torch"}, "tracking": OFF}))
    history = [h for h in _history(tmp_path / "ppo")]
    skipped = [h["update"] - 1 for h in history if h.get("skipped")]
    assert skipped == hit and len(history) == len(plan)  # exactly the minibatch holding that row, the rest trained
    reason = f"row {bad_row}: 3 image tokens in the sequence but its images make 4 features"
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def _history(out):
    import json

    return [json.loads(line) for line in (out / "updates.jsonl").read_text().splitlines()]


def test_ppo_names_the_row_of_an_undecodable_image(chain, tmp_path):
    table = _adv_table(chain)
    images = table.column("images").to_pylist()
    images[3] = [b"\x89PNG\r\n\x1a\n broken"]
    table = table.set_column(table.schema.get_field_index("images"), "images", pa.array(images, pa.list_(pa.binary())))
    schema.write_dataset(tmp_path / "adv", table, "advantages")
    with pytest.raises(DataError, match=r"row 3, image 0: not a decodable image"):
        ppo.run(config.build(ppo.Config, {
            "policy": str(chain / "sft"), "input": str(tmp_path / "adv"), "output": str(tmp_path / "ppo"),
            "minibatch_size": 8, "engine": {"backend": "torch"}, "tracking": OFF}))
    assert not (tmp_path / "ppo").exists()


def test_a_text_policy_refuses_image_rows(chain, tmp_path):
    with pytest.raises(DataError, match="has rows with images, but the policy 'tiny-llama' is text-only"):
        ppo.run(config.build(ppo.Config, {
            "policy": "tiny-llama", "input": str(chain / "adv"), "output": str(tmp_path / "ppo"),
            "minibatch_size": 8, "engine": {"backend": "torch"}, "tracking": OFF}))
    assert not (tmp_path / "ppo").exists()


def test_rollout_names_a_bad_image_in_a_dataset_and_writes_nothing(chain, tmp_path):
    import json

    (tmp_path / "ok.png").write_bytes(tasks.load("visual", "train", 1, 0)[0].images[0])
    (tmp_path / "bad.png").write_bytes(b"not an image")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Compute left+right.\n", "answer": "3", "images": "ok.png"}) + "\n"
                    + json.dumps({"prompt": "Compute left+right.\n", "answer": "4", "images": ["bad.png"]}) + "\n")
    with pytest.raises(DataError, match=r"prompts.jsonl, line 2, field 'images'\[0\]: not a decodable image"):
        rollout.run(config.build(rollout.Config, {
            "policy": str(chain / "sft"), "task": str(data), "output": str(tmp_path / "out"), "num_prompts": 0,
            "n_samples": 2, "tracking": OFF}))
    assert not (tmp_path / "out").exists()


def test_critics_are_refused_for_vl_policies(chain, tmp_path):
    with pytest.raises(ConfigError, match="vision-language model; critics are text-only"):
        rollout.run(config.build(rollout.Config, {
            "policy": str(chain / "sft"), "critic": str(chain / "sft"), "task": "visual", "output": str(tmp_path / "o"),
            "num_prompts": 2, "n_samples": 2, "tracking": OFF}))


def test_evaluate_scores_vl_policies_with_the_vl_prm(chain, tmp_path):
    m = evaluate.run(config.build(evaluate.Config, {
        "policy": str(chain / "sft"), "prm": str(chain / "prm"), "task": "visual", "num_prompts": 6, "n_samples": 2,
        "sampling.max_new_tokens": 24, "output": str(tmp_path / "eval"), "tracking": OFF}))
    assert {"eval/accuracy", "eval/bon_min", "eval/majority"} <= set(m)
    assert io.read_manifest(tmp_path / "eval")["kind"] == "evaluation"


def test_sft_skips_a_batch_whose_image_tokens_do_not_match(tmp_path, caplog, monkeypatch):
    """The check before every SFT update: examples made to mismatch (a processor that expands one
    image token fewer) are skipped with the reason, and nothing crashes."""
    from prmflow.components.training import supervised_data as sft_data

    real, calls = sft_data.tasks.encode_prompt, []

    def short(tokenizer, record, chat_template=True, where="prompt"):
        text, ids, pixels = real(tokenizer, record, chat_template, where)
        calls.append(record.prompt_id)
        return text, (ids[:-1] if len(calls) == 1 else ids), pixels  # the first example loses one image token

    monkeypatch.setattr(sft_data.tasks, "encode_prompt", short)
    with caplog.at_level(logging.WARNING):
        sft.run(config.build(sft.Config, {
            "policy": "tiny-llava", "task": "visual", "output": str(tmp_path / "sft"), "max_steps": 2,
            "optim.warmup_steps": 1, "num_prompts": 16, "eval_size": 2, "micro_batch_size": 8, "eval_every": 0,
            "save_every": 0, "engine": {"backend": "torch"}, "tracking": OFF}))
    messages = [r.getMessage() for r in caplog.records if "skipping the batch" in r.getMessage()]
    assert messages and all("3 image tokens in the sequence but its images make 4 features" in m for m in messages)
    assert io.read_manifest(tmp_path / "sft")["kind"] == "policy"  # the other batch trained; the run finished


def test_sft_freezes_the_named_modules(tmp_path):
    from safetensors.torch import load_file

    base = tmp_path / "base"
    model, tok = modeling.load_causal_lm("tiny-llava")
    modeling.save_pretrained(model, tok, base)
    sft.run(config.build(sft.Config, {
        "policy": str(base), "task": "visual", "output": str(tmp_path / "sft"), "max_steps": 2, "optim.warmup_steps": 1,
        "num_prompts": 16, "eval_size": 2, "micro_batch_size": 8, "eval_every": 0, "save_every": 0,
        "freeze": "model.vision_tower, model.multi_modal_projector", "engine": {"backend": "torch"}, "tracking": OFF}))
    before, after = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "sft" / "model.safetensors"))
    # (LLaVA's files keep the original checkpoint names: vision_tower.*, multi_modal_projector.*, language_model.*)
    frozen = [k for k in before if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("language_model."))
    with pytest.raises(ConfigError, match="freeze: no parameter name starts with 'model.vision'"):
        sft.run(config.build(sft.Config, {
            "policy": "tiny-llama", "output": str(tmp_path / "x"), "max_steps": 2, "optim.warmup_steps": 1,
            "freeze": "model.vision", "tracking": OFF}))


def test_prm_label_refuses_image_prompts_clearly(chain, tmp_path):
    from prmflow.components.prm import label

    with pytest.raises(DataError, match="has images; prm-label labels text prompts only"):
        label.run(config.build(label.Config, {"policy": str(chain / "sft"), "task": "visual", "num_prompts": 2,
                                              "output": str(tmp_path / "labels"), "tracking": OFF}))
    assert not (tmp_path / "labels").exists()
