"""SFT on multi-turn demonstrations: chat `messages` with assistant turns and tool messages between them.

The example's ids are laid out as the rollout lays out an episode, and its text is the chat template's
rendering of the whole conversation (Qwen2.5's template, verbatim, on the tiny BPE tokenizer): the
independent reference. The loss reads the assistant turns only: the labelled tokens decode to exactly the
assistant contents and their end-of-turn tokens, and perturbing the logits at tool tokens moves nothing."""

import json

import pytest
import torch

from prmflow import tasks
from prmflow.components import config
from prmflow.components.models import chat, modeling
from prmflow.components.sft import stage
from prmflow.components.training import supervised_data as data
from prmflow.errors import DataError

MESSAGES = [{"role": "system", "content": "Keep a memory."},
            {"role": "user", "content": "Chunk 1: Ann is 7."},
            {"role": "assistant", "content": '{"name": "memory_insert", "arguments": {"text": "Ann is 7"}}'},
            {"role": "tool", "content": '{"ok": true, "id": 0}'},
            {"role": "assistant", "content": '{"name": "done", "arguments": {}}'}]


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_every_assistant_turn_is_trained_and_no_tool_turn(tmp_path):
    tok = modeling.preset_tokenizer("tiny-qwen2-bpe")
    record, = tasks.load(str(_write(tmp_path / "d.jsonl", [{"id": "e0", "messages": MESSAGES}])))
    (ex,), dropped = data.tokenize([record], tok, max_seq_len=4096)
    assert dropped == 0
    # the whole conversation as Qwen2.5's template renders it (it adds "\n" after the last turn's <|im_end|>)
    assert tok.decode(ex.input_ids) + "\n" == tok.apply_chat_template(MESSAGES, tokenize=False)
    eot = tok.convert_ids_to_tokens(chat.end_of_turn_id(tok))
    trained = [i for i, l in zip(ex.input_ids, ex.labels) if l != data.IGNORE]
    assert tok.decode(trained) == MESSAGES[2]["content"] + eot + MESSAGES[4]["content"] + eot
    assert [l for l in ex.labels if l != data.IGNORE] == trained

    # the loss at a tool token's position does not exist: perturb those logits, the loss stays
    batch = data.collate([ex], tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, len(ex.input_ids), len(tok), generator=g)
    loss, n = data.response_loss(logits, batch["labels"])
    untrained = torch.tensor([l == data.IGNORE for l in ex.labels[1:]] + [True])  # position t predicts token t + 1
    moved = logits + 50.0 * torch.randn(logits.shape, generator=g) * untrained[None, :, None]
    assert data.response_loss(moved, batch["labels"]) == (loss, n) and n == len(trained)


def test_a_multi_turn_demonstration_trains_through_the_stage(tmp_path):
    rows = [{"id": f"e{i}", "messages": MESSAGES} for i in range(8)]
    f = _write(tmp_path / "d.jsonl", rows)
    cfg = config.load(stage.Config, overrides={"policy": "tiny-qwen2-bpe", "task": str(f), "eval_size": 2,
                                                "max_steps": 2, "optim.warmup_steps": 0, "micro_batch_size": 4, "eval_every": 0, "save_every": 0,
                                                "engine.backend": "torch", "tracking.enabled": False,
                                                "output": str(tmp_path / "sft"), "max_seq_len": 256})
    metrics = stage.run(cfg)
    assert (tmp_path / "sft" / "model.safetensors").exists() and metrics


def test_a_demonstration_out_of_turn_order_is_refused_naming_the_row(tmp_path):
    tok = modeling.preset_tokenizer("tiny-qwen2-bpe")
    bad = MESSAGES[:3] + [{"role": "user", "content": "again"}] + MESSAGES[4:]
    record, = tasks.load(str(_write(tmp_path / "d.jsonl", [{"id": "e7", "messages": bad}])))
    with pytest.raises(DataError, match=r"prompt 'e7'.*message 3 has role 'user' after a 'assistant' turn"):
        data.tokenize([record], tok, max_seq_len=4096)
