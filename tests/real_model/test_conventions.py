"""SmolLM2-135M-Instruct's conventions, as every stage must read them: its own chat template (ChatML, with a
default system turn), pad == eos == `<|im_end|>` (so a mask can never be `ids != pad`: a response's eos is
trained on and scored, the padding beside it is not), and a 49,152-token byte-level BPE whose tokens merge
newlines with text. Each is checked against an independent reference: jinja2 rendering the template file,
a per-row forward pass with no padding at all, decoding every prefix of the ids."""

from __future__ import annotations

import json

import jinja2
import numpy as np
import pytest
import torch

from prmflow.components.models import modeling
from prmflow.components.data import steps
from prmflow import tasks
from prmflow.tasks import arithmetic
from prmflow.components.training import supervised_data
from prmflow.components.ppo.minibatches import Sample, collate as ppo_collate
from prmflow.components.rollout import response_scores as scoring
from prmflow.components.models.tensor_ops import sequence_logprobs

pytestmark = pytest.mark.real_model

IM_END = "<|im_end|>"


def template_file_render(model_dir, messages, add_generation_prompt):
    """The chat template as the model directory stores it, rendered by jinja2 itself (not by transformers)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        source = path.read_text()
    else:
        source = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    return jinja2.Environment().from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt)


def problems(n=3):
    return arithmetic.generate(n, seed=0, split="eval", cfg=arithmetic.ArithmeticConfig(min_ops=1, max_ops=3))


def test_the_directory_keeps_pad_equal_to_eos(smollm2):
    tok = modeling.load_tokenizer(smollm2)
    assert tok.eos_token == tok.pad_token == IM_END and tok.eos_token_id == tok.pad_token_id == 2
    assert len(tok) == 49152


def test_prompts_and_sft_examples_use_the_model_directorys_template_verbatim(smollm2):
    tok = modeling.load_tokenizer(smollm2)
    for p in problems():
        record = tasks.PromptRecord(p.prompt_id, p.prompt, answer=p.answer, response=p.solution)
        user = [{"role": "user", "content": p.prompt}]
        expected_prompt = template_file_render(smollm2, user, add_generation_prompt=True)
        assert expected_prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        text, ids, _ = tasks.encode_prompt(tok, record)
        assert text == expected_prompt
        assert ids == tok(expected_prompt, add_special_tokens=False)["input_ids"]
        # an SFT example is the whole templated conversation up to and including the assistant's <|im_end|>
        # (the template's trailing newline is not trained on: generation stops at <|im_end|>)
        full = template_file_render(smollm2, user + [{"role": "assistant", "content": p.solution}], False)
        assert full.endswith(p.solution + IM_END + "\n")
        (example,), dropped = supervised_data.tokenize([record], tok, max_seq_len=512)
        assert dropped == 0
        assert example.input_ids == tok(full[:-1], add_special_tokens=False)["input_ids"]
        trained = [t for t in example.labels if t != supervised_data.IGNORE]
        assert trained == example.input_ids[len(ids):] and trained[-1] == tok.eos_token_id


def reference_step_ends(tok, ids, separator="\n"):
    """Slow reference: decode every prefix of the ids; a step's last token is the first whose prefix covers
    the step's last character. Steps are found by splitting the text by hand."""
    text = tok.decode(ids, skip_special_tokens=True)
    covered = [len(tok.decode(ids[:k + 1], skip_special_tokens=True).rstrip("\ufffd")) for k in range(len(ids))]
    ends, pos = [], 0
    for piece in text.split(separator):
        if piece.strip():
            ends.append(next(k for k, n in enumerate(covered) if n >= pos + len(piece)))
        pos += len(piece) + len(separator)
    return ends


RESPONSES = [
    "1. 6 + 6 = 12\n2. 12 - 6 = 6\n\nThe answer is 6.",   # SmolLM2's own style (greedy, before SFT)
    "7+5=12\n12*3=36\n36-4=32\nanswer: 32",                  # the task's format
    "Step one.\n \n3×4 = 12 \nanswer:  12\n\n\n",            # "\n " and "\n\n\n" are single tokens here, "×"
    "x=1.\ny=2.\n\nanswer: 3",
]


@pytest.mark.parametrize("text", RESPONSES)
def test_step_ends_equal_a_character_level_reference_on_its_tokenizer(smollm2, text):
    tok = modeling.load_tokenizer(smollm2)
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # a stopped response
    decoded, ends = scoring.step_ends(tok, ids)
    assert decoded == text
    assert ends == reference_step_ends(tok, ids)
    assert len(ends) == len(steps.steps(text))


def test_this_tokenizer_merges_separators_with_text(smollm2):
    """The step-end cases above are real for this tokenizer: a token holds a newline and the next step's
    leading space, another three newlines (a separator and two empty steps)."""
    tok = modeling.load_tokenizer(smollm2)
    pieces = [tok.decode([i]) for i in tok(RESPONSES[2], add_special_tokens=False)["input_ids"]]
    assert "\n " in pieces and "\n\n\n" in pieces


def unpadded_logprobs(model, prompt, response):
    """log p(response token t | prompt + response[:t]) from one sequence alone: no padding, no mask."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(prompt) + list(response))[1:, None])[:, 0]
    return lp[len(prompt) - 1:].numpy()


def rows_of_different_lengths(tok):
    """Prompt/response ids of three stopped responses of different lengths (each ends with <|im_end|> = pad)."""
    out = []
    for p, response in zip(problems(), ["answer: 3", "7+5=12\n12*3=36\nanswer: 36", "1+1=2\nanswer: 2"]):
        _, p_ids, _ = tasks.encode_prompt(tok, tasks.PromptRecord(p.prompt_id, p.prompt))
        out.append((p_ids, tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    return out


def test_sft_trains_on_the_response_eos_and_never_on_padding(smollm2_lm):
    model, tok = smollm2_lm
    records = [tasks.PromptRecord(p.prompt_id, p.prompt, response=r)
               for p, r in zip(problems(), ["answer: 3", "7+5=12\n12*3=36\nanswer: 36", "1+1=2\nanswer: 2"])]
    examples, _ = supervised_data.tokenize(records, tok, max_seq_len=512)
    batch = supervised_data.collate(examples, tok.pad_token_id)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        assert batch["labels"][b, n - 1] == tok.eos_token_id  # the response's eos is a target
        assert (batch["input_ids"][b, n:] == tok.pad_token_id).all()  # padding: the same id ...
        assert (batch["labels"][b, n:] == supervised_data.IGNORE).all()  # ... never a target
    with torch.no_grad():
        logits = model(**supervised_data.model_inputs(batch)).logits
    loss, count = supervised_data.response_loss(logits, batch["labels"])
    reference = 0.0
    for e in examples:  # each example alone, no padding: the summed NLL of its response tokens (eos included)
        n_prompt = e.labels.count(supervised_data.IGNORE)
        reference -= unpadded_logprobs(model, e.input_ids[:n_prompt], e.input_ids[n_prompt:]).sum()
    assert count == sum(len(e.input_ids) - e.labels.count(supervised_data.IGNORE) for e in examples)
    assert loss.item() == pytest.approx(reference, rel=1e-4)


def test_rollout_scores_the_response_eos_and_never_padding(smollm2_lm):
    model, tok = smollm2_lm
    rows = rows_of_different_lengths(tok)
    got = scoring.forward_logprobs(model, [p for p, _ in rows], [r for _, r in rows], batch_size=8, pad_id=tok.pad_token_id)
    for (p, r), lp in zip(rows, got):
        assert len(lp) == len(r)  # the eos has its logprob
        np.testing.assert_allclose(lp, unpadded_logprobs(model, p, r), atol=2e-4)


def test_ppo_batch_trains_on_the_response_eos_and_never_on_padding(smollm2_lm):
    model, tok = smollm2_lm
    rows = [{"prompt_ids": p, "response_ids": r} for p, r in rows_of_different_lengths(tok)]
    samples = [Sample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], advantages=[0.0] * len(r["response_ids"]))
               for r in rows]
    mb = ppo_collate(samples, list(range(len(rows))), tok.pad_token_id, fields=())
    assert (~mb.mask).any() and (mb.response_ids[~mb.mask] == tok.pad_token_id).all()  # right padding with the eos id
    for b, r in enumerate(rows):
        assert mb.response_ids[b][mb.mask[b]].tolist() == r["response_ids"]  # eos included, padding not
    assert int(mb.mask.sum()) == sum(len(r["response_ids"]) for r in rows)
    with torch.no_grad():  # the left-padded batch scores the masked tokens as each row alone does
        lp = sequence_logprobs(model, mb.input_ids, mb.attention_mask)[:, mb.input_ids.shape[1] - mb.response_ids.shape[1] - 1:]
    for b, r in enumerate(rows):
        np.testing.assert_allclose(lp[b][mb.mask[b]].numpy(), unpadded_logprobs(model, r["prompt_ids"], r["response_ids"]),
                                   atol=2e-4)
