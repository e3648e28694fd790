"""Turns of a chat model: which token ends an assistant response, and where generation stops.

A chat-tuned tokenizer (Qwen2.5-Instruct: `<|im_start|>role\\n ... <|im_end|>\\n`) ends a turn with
a special token that its template writes after the content. For Qwen2.5-Instruct that token is
also `eos_token`; for a base model with the same template (Qwen2.5-Math-1.5B) the eos is
`<|endoftext|>` while the template still closes turns with `<|im_end|>`. SFT must teach the token
the template uses, and generation must stop at it, so both ask `end_of_turn_id`.
"""

from __future__ import annotations

from jinja2 import TemplateError

_PROBE = "\x00prmflow-response\x00"


def end_of_turn_id(tokenizer, templated: bool = True) -> int | None:
    """The token that ends an assistant response: the special token the chat template writes right
    after an assistant message's content (`<|im_end|>` for Qwen2.5), else the tokenizer's eos.

    `templated`: whether prompts go through the chat template (a plain prompt ends with eos)."""
    eos = tokenizer.eos_token_id
    template = getattr(tokenizer, "chat_template", None)
    if not (templated and template):
        return eos
    found = eos
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}],
                                            tokenize=False)
    except (TemplateError, ValueError, TypeError):  # a template that refuses this conversation: keep eos
        text = ""
    if _PROBE in text:
        after = text.split(_PROBE, 1)[1]
        for token in tokenizer.all_special_tokens:
            if token and after.startswith(token):
                found = tokenizer.convert_tokens_to_ids(token)
                break
    return found


def stop_token_ids(model, tokenizer, templated: bool = True) -> list[int]:
    """Ids that end a generated response: the model's generation config (which may list several,
    Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`), the tokenizer's eos, and the chat
    template's end of turn; in that order, without repeats."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids += [tokenizer.eos_token_id, end_of_turn_id(tokenizer, templated)]
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out
