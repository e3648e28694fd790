"""Step boundaries stay exact with a byte-level BPE tokenizer whose tokens merge the separator with
its neighbours (`tiny-qwen2-bpe`, Qwen2's pre-tokenizer: `.\\n`, ` \\n`, `\\n\\n` are single tokens).

Each place that turns steps into token positions is compared with a character-level reference on
adversarial strings (a hand list, then hypothesis): rollout's step_ends, the PRM's readout
positions (training/scoring `encode`, and the scores `PRMScorer` returns) and prm-label's prefixes.
The reference works on characters only: steps are the non-empty pieces of `text.split(separator)`,
a step's readout is the first token at which decoding the ids covers the step's last character.
"""

from __future__ import annotations

import unicodedata

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from prmflow.components.models import modeling
from prmflow.components.data import steps
from prmflow import tasks
from prmflow.components.models.prm_model import PRM, encode
from prmflow.components.scoring.prm_scoring import PRMScorer
from prmflow.components.prm import label
from prmflow.components.rollout import response_scores as scoring

TOK = modeling.load_tokenizer("tiny-qwen2-bpe")
RAW_PROMPT = "Compute left to right: 7+5*3\n"
PROMPT = tasks.render_prompt(TOK, tasks.PromptRecord("p", RAW_PROMPT))  # Qwen2.5's template around it

ADVERSARIAL = [
    "7+5=12\n12*3=36\nanswer: 36",
    "First, 7 plus 5 is 12.\nThen 12 times 3 is 36.\n\nSo the answer is 36.",  # `.\n`, `.\n\n`
    "12 \n36 \n answer: 36 ",  # ` \n`, a step starting with a space, trailing space
    "a.\n\n\n\nb.\n \n.\n",  # runs of newlines, a whitespace-only segment, a step that is one '.'
    "\n\nlead\n",  # leading blank lines, trailing separator
    "x=1.\ny=2.\n\nanswer: $\\boxed{3}$.",
    "é😀.\n∑ \n\n😀😀",  # multi-byte characters split across byte-level tokens next to merged separators
    "#### 7\n\n####\n",
    ".\n.\n.",
    "no separator at all",
    "tabs\t\nand\r\ncrlf\r\n\r\nend",
]
FRAGMENTS = ["7", "12", "+", "=", "answer", ":", " ", ".", "\n", "\n\n", " \n", ".\n", "\t", "é", "😀", "Then", " is",
             "$\\boxed{3}$", "#", ",", "-", "  "]


def ref_spans(text: str, sep: str) -> list[tuple[int, int]]:
    """Character reference: the non-empty pieces of text.split(sep) as (start, end)."""
    out, pos = [], 0
    for piece in text.split(sep):
        if piece.strip():
            out.append((pos, pos + len(piece)))
        pos += len(piece) + len(sep)
    return out


def ref_readouts(ids: list[int], text: str, sep: str) -> list[int]:
    """Per step, the first token k such that decoding ids[:k+1] covers the step's last character
    (a character split across tokens is covered once its last byte is decoded)."""
    covered = [len(TOK.decode(ids[:k + 1], skip_special_tokens=True).rstrip("\ufffd")) for k in range(len(ids))]
    return [next(k for k, n in enumerate(covered) if n >= end) for _, end in ref_spans(text, sep)]


def check_all(text: str, sep: str = "\n"):
    text = unicodedata.normalize("NFC", text)  # what the tokenizer's NFC normalizer makes of it (decode = text)
    assert steps.step_spans(text, sep) == ref_spans(text, sep)

    # rollout: step_ends from the policy's own ids (here: the text's tokens + <|im_end|>, as a stopped sample)
    ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    decoded, ends = scoring.step_ends(TOK, ids, sep)
    assert decoded == text
    assert ends == ref_readouts(ids, text, sep)

    # PRM: readout positions in prompt + response ids (training and scoring both use encode)
    enc = encode(TOK, PROMPT, text, sep)
    p_len = len(TOK(PROMPT)["input_ids"])
    assert enc.input_ids[:p_len] == TOK(PROMPT)["input_ids"]
    r_ids = enc.input_ids[p_len:]
    assert TOK.decode(r_ids) == text
    assert enc.step_ends == [p_len + k for k in ref_readouts(r_ids, text, sep)]
    assert enc.n_steps == len(ref_spans(text, sep))

    # prm-label: the prefix before step k+1 is the text up to that step's first character
    spans = ref_spans(text, sep)
    assert label.step_prefixes(text, sep) == [text[:a] for a, _ in spans[1:]]
    return ends, enc


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_adversarial_strings_agree_with_the_character_reference(text):
    check_all(text)


def test_the_hand_list_really_has_tokens_that_merge_the_separator():
    """Without these the tests above could not fail the way a character tokenizer cannot show."""
    merged = set()
    for text in ADVERSARIAL:
        offsets = TOK(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for _, end in ref_spans(text, "\n"):  # a token holding a step's last character and the separator after it
            merged |= {text[a:b] for a, b in offsets if a < end < b}
    assert {".\n", " \n", ".\n\n"} <= merged


@pytest.mark.parametrize("sep", ["\n\n", " ки", "."])
def test_other_separators(sep):
    for text in ADVERSARIAL:
        check_all(text.replace("\n", sep) if sep == " ки" else text, sep)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=14).map("".join))
def test_random_strings_agree_with_the_character_reference(text):
    check_all(text)


def test_prm_label_prefixes_end_on_a_token_boundary_of_the_response():
    """A continuation from prefix k is conditioned on the same tokens as the full response up to there:
    the separator (with whatever it merged with) is never cut in half."""
    for text in ADVERSARIAL:
        full = TOK(PROMPT + text, add_special_tokens=False)["input_ids"]
        for prefix in label.step_prefixes(text, "\n"):
            part = TOK(PROMPT + prefix, add_special_tokens=False)["input_ids"]
            assert full[:len(part)] == part, (text, prefix)


@pytest.mark.parametrize("templated", [True, False])
def test_prm_scores_are_read_at_the_reference_tokens(tmp_path, templated):
    """PRMScorer's score of every step = the PRM's output at the reference token, from one plain forward
    of the prompt as the PRM was trained to read it (through the chat template or not, prmflow.json)."""
    prm = PRM.load("tiny-qwen2-bpe", seed=3)
    with torch.no_grad():
        prm.model.score.weight.normal_(0, 1.0)
    modeling.save_pretrained(prm.model, prm.tokenizer, tmp_path / "prm", extra=prm.metadata("\n", templated))
    texts = ADVERSARIAL[:8]
    got = PRMScorer(str(tmp_path / "prm"), device="cpu").score([RAW_PROMPT] * len(texts), texts)
    p_ids = TOK(PROMPT if templated else RAW_PROMPT)["input_ids"]
    for text, scores in zip(texts, got):
        r_ids = TOK(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            z = prm.model(input_ids=torch.tensor([p_ids + r_ids])).logits[0, :, 0]
        want = [float(torch.sigmoid(z[len(p_ids) + k])) for k in ref_readouts(r_ids, text, "\n")]
        assert scores == pytest.approx(want, abs=1e-5), text
