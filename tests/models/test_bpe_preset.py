"""The `tiny-qwen2-bpe` preset: a Qwen2 model with a byte-level BPE tokenizer in Qwen2.5-Instruct's
format, saved and loaded by plain transformers, and the chat conventions every stage relies on."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prmflow.components.models import chat, modeling
from prmflow import tasks
from prmflow.components.models.bpe_tokenizer import DEFAULT_SYSTEM
from prmflow.components.training import supervised_data

PRESET = "tiny-qwen2-bpe"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, tok = modeling.build_tiny_model(PRESET, seed=1)
    out = tmp_path_factory.mktemp("bpe") / "model"
    modeling.save_pretrained(model, tok, out)
    return model, tok, out


def test_round_trips_through_plain_transformers(saved):
    model, tok, out = saved
    tok2, model2 = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    assert type(tok2).__name__ == "Qwen2Tokenizer" and model2.config.model_type == "qwen2"
    assert (tok2.eos_token, tok2.pad_token, tok2.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok2.eos_token_id != tok2.pad_token_id
    assert model2.generation_config.eos_token_id == [tok2.eos_token_id, tok2.pad_token_id]  # Qwen2.5-Instruct's pair
    text = "First, 7 plus 5 is 12.\nThen 12 times 3 is 36. \n\nSo the answer is $\\boxed{36}$ — é😀"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids
    assert tok2.decode(ids) == text  # byte-level: any text round-trips, nothing is unknown
    x = torch.tensor([ids[:20]])
    assert torch.equal(model(x).logits, model2(x).logits)
    assert modeling.load_tokenizer(out).chat_template == tok.chat_template


def test_is_byte_level_bpe_whose_tokens_merge_the_separator():
    """The tokens the step code must survive: punctuation, a space or another newline merged with a newline."""
    tok = modeling.load_tokenizer(PRESET)
    pieces = lambda s: [tok.decode([i]) for i in tok(s, add_special_tokens=False)["input_ids"]]  # noqa: E731
    assert ".\n" in pieces("so 12.\nThen") and " \n" in pieces("12 \nx") and "\n\n" in pieces("12\n\nx")
    assert "answer" in pieces("answer: 14") and pieces("14") == ["1", "4"]  # Qwen2 splits digits
    assert len(tok) > 300


def test_chat_template_is_qwen25_format():
    """Against the Qwen2.5-Instruct format written out by hand."""
    tok = modeling.load_tokenizer(PRESET)
    prompt = "Compute left to right: 7+5\n"
    got = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert got == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                   f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "ok"}], tokenize=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    rec = tasks.PromptRecord("p", prompt, "12")
    assert tasks.render_prompt(tok, rec) == got and tasks.render_prompt(tok, rec, chat_template=False) == prompt
    ids = tok(got, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens stay whole


def test_sft_target_is_the_templated_turn_and_pad_is_never_trained_on():
    """An SFT example is exactly the Qwen2.5 conversation: prompt through the template (masked), then
    response + <|im_end|> (trained); collate pads with <|endoftext|>, which no label ever names."""
    tok = modeling.load_tokenizer(PRESET)
    recs = [tasks.PromptRecord("a", "Compute left to right: 7+5*3\n", "36", "7+5=12\n12*3=36\nanswer: 36"),
            tasks.PromptRecord("b", "Compute left to right: 2+2\n", "4", "answer: 4")]
    examples, dropped = supervised_data.tokenize(recs, tok, 256)
    assert dropped == 0
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    for r, ex in zip(recs, examples):
        want = (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{r.prompt}<|im_end|>\n"
                f"<|im_start|>assistant\n{r.response}<|im_end|>")
        assert tok.decode(ex.input_ids) == want
        trained = [t for t in ex.labels if t != supervised_data.IGNORE]
        assert tok.decode(trained) == r.response + "<|im_end|>" and trained[-1] == im_end
    batch = supervised_data.collate(examples, tok.pad_token_id)
    assert (batch["input_ids"] == pad).any()  # the short example is padded ...
    assert not (batch["labels"] == pad).any()  # ... and padding is never a target
    targets = torch.tensor([len(tok(r.response, add_special_tokens=False)["input_ids"]) + 1 for r in recs])
    assert ((batch["labels"] != supervised_data.IGNORE).sum(1) == targets).all()
    plain, _ = supervised_data.tokenize(recs[:1], modeling.load_tokenizer("tiny-llama"), 256)  # no template: eos
    assert plain[0].labels[-1] == modeling.load_tokenizer("tiny-llama").eos_token_id


def test_end_of_turn_comes_from_the_template_when_eos_differs():
    """A base Qwen2.5 tokenizer (eos <|endoftext|>) with the chat template still ends a turn with <|im_end|>."""
    tok = modeling.load_tokenizer(PRESET)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    tok.eos_token = "<|endoftext|>"
    assert chat.end_of_turn_id(tok) == im_end and chat.end_of_turn_id(tok, templated=False) == eot
    model, _ = modeling.build_tiny_model("tiny-llama")
    assert set(chat.stop_token_ids(model, tok)) >= {im_end, eot}


def test_training_is_deterministic():
    """Every process builds the preset's tokenizer itself (policy, PRM, reference): it must come out
    the same each time, or ids would mean different tokens in different stages."""
    from prmflow.components.models import bpe_tokenizer

    first = bpe_tokenizer.train_bpe(bpe_tokenizer.VOCAB_SIZE, 300, 7)
    bpe_tokenizer.train_bpe.cache_clear()
    again = bpe_tokenizer.train_bpe(bpe_tokenizer.VOCAB_SIZE, 300, 7)
    assert first == again and len(first[1]) > 50
