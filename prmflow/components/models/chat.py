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


# --- multi-turn episodes: the opening messages and the tool turns, as token ids ----------------------

_TOOL_PROBE = "\x00prmflow-observation\x00"


class ChatTurnError(ValueError):
    """The tokenizer's chat template cannot render a tool turn."""


def opening_ids(tokenizer, messages: list[dict], templated: bool = True) -> tuple[str, list[int]]:
    """(text, ids) of an episode's opening messages up to the first assistant turn's generation prompt.

    With a chat template: rendered with `add_generation_prompt`, tokenized without added special tokens (the
    template writes its own), as `tasks.encode_prompt` renders a chat-style prompt. Without one (the character
    presets): the contents joined by newlines, with the tokenizer's special tokens."""
    if templated and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "\n".join(str(m.get("content", "")) for m in messages)
    return text, tokenizer(text, add_special_tokens=True)["input_ids"]


def observation_text(tokenizer, text: str, templated: bool = True, closed: bool = True) -> str:
    """What follows a policy turn that ended with its end-of-turn token, when the environment answers `text`: the
    chat template's tool turn and the next assistant turn's generation prompt, as a fragment.

    Read off the template rather than written by hand: the rendering of [user, assistant X, tool TEXT] with the
    generation prompt, after X and the end-of-turn token the policy sampled (kept when `closed` is False: the turn
    ended at a stop string). For Qwen2.5 that is
    `\\n<|im_start|>user\\n<tool_response>\\nTEXT\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.
    Without a chat template (the character presets): TEXT and a newline."""
    if not (templated and getattr(tokenizer, "chat_template", None)):
        return text + "\n"
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    try:
        full = tokenizer.apply_chat_template(base + [{"role": "tool", "content": _TOOL_PROBE}], tokenize=False,
                                             add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError) as e:
        raise ChatTurnError(f"the chat template cannot render a tool turn ({e})") from None
    if _PROBE not in full or _TOOL_PROBE not in full:
        raise ChatTurnError("the chat template drops the tool message (it has no tool role)")
    after = full.split(_PROBE, 1)[1]
    eot = end_of_turn_id(tokenizer, templated)
    eot_text = tokenizer.convert_ids_to_tokens(eot) if eot is not None else None
    if closed and eot_text and after.startswith(eot_text):  # the policy sampled it: it ends the turn's ids already
        after = after[len(eot_text):]
    return after.replace(_TOOL_PROBE, text)


def observation_ids(tokenizer, text: str, templated: bool = True, closed: bool = True) -> list[int]:
    """`observation_text` tokenized once, as a fragment (no special tokens added): the ids appended after a turn.
    closed=False: the turn ended at a stop string, not at the end-of-turn token, so the fragment closes it first."""
    return tokenizer(observation_text(tokenizer, text, templated, closed), add_special_tokens=False)["input_ids"]
