"""The turns of a multi-turn episode as ids: the opening messages and the tool-role observation fragment.

The fragment is read off the tokenizer's chat template; for Qwen2.5-Instruct's template (verbatim in
bpe_tokenizer.py) it is written out here by hand from the template's tool branch."""

import pytest

from prmflow.components.models import chat, modeling


def test_qwen25_tool_turn_fragment():
    tok = modeling.preset_tokenizer("tiny-qwen2-bpe")
    want = "\n<|im_start|>user\n<tool_response>\n{\"ok\": 1}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert chat.observation_text(tok, '{"ok": 1}') == want
    # a turn ended by a stop string, not by <|im_end|>: the fragment closes it first
    assert chat.observation_text(tok, '{"ok": 1}', closed=False) == "<|im_end|>" + want
    assert chat.observation_ids(tok, "x") == tok(chat.observation_text(tok, "x"), add_special_tokens=False)["input_ids"]
    text, ids = chat.opening_ids(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text


def test_plain_turns_without_a_chat_template():
    tok = modeling.preset_tokenizer("tiny-llama")  # character-level, no template
    assert chat.observation_text(tok, "ok") == "ok\n"
    text, ids = chat.opening_ids(tok, [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    assert text == "a\nb" and tok.decode(ids) == "a\nb"


@pytest.mark.parametrize("template,why", [
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content }}"
     "{% endfor %}", "cannot render a tool turn"),
    ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}</s>{% endif %}{% endfor %}", "drops the tool message"),
])
def test_a_template_without_a_tool_role_is_an_error(template, why):
    tok = modeling.preset_tokenizer("tiny-qwen2-bpe")
    tok.chat_template = template
    with pytest.raises(chat.ChatTurnError, match=why):
        chat.observation_text(tok, "x")
