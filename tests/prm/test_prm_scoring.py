"""The PRM reads its score at exactly the last token of each step, for both heads."""

import math

import pytest
import torch

from prmflow.components.models import modeling
from prmflow.components.data import steps
from prmflow.components.models.prm_model import PRM, HeadConfig, encode
from prmflow.components.scoring.prm_scoring import PRMScorer, load_scorer

PROMPTS = ["Compute left to right: 7+5*3\n", "Compute left to right: 2*4-1+6\n", "Compute left to right: 9-2\n"]
RESPONSES = ["7+5=12\n12*3=36\nanswer: 36", "2*4=8\n\n8-1=7\n7+6=14\nanswer: 14\n", "9-2=7\nanswer: 7"]


def _random_head_prm(tmp_path, head=None, seed=1):
    """A tiny PRM directory whose head is random (a zero head would score 0.5 everywhere)."""
    head = head or HeadConfig()
    prm = PRM.load("tiny-llama", head, seed=seed)
    torch.manual_seed(seed)
    if head.kind == "token_classification":
        with torch.no_grad():
            prm.model.score.weight.normal_(0, 0.5)
    out = tmp_path / f"prm-{head.kind}"
    modeling.save_pretrained(prm.model, prm.tokenizer, out, extra=prm.metadata("\n"))
    return out


def _slow_scores(path, head, prompt, response):
    """Reference: run the model on prompt + each step prefix separately and read the last position."""
    prm = PRM.load(path, head)
    prm.model.eval()
    tok = prm.tokenizer
    out = []
    ends = [end for _, end in steps.step_spans(response)]
    for k, end in enumerate(ends):
        # the response up to step k's end, with the tag after every step so far
        cuts = [0] + ends[:k + 1]
        prefix = "".join(response[a:b] + head.step_tag for a, b in zip(cuts, cuts[1:]))
        ids = tok(prompt, add_special_tokens=True)["input_ids"] + tok(prefix, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        if head.kind == "token_classification":
            out.append(float(torch.sigmoid(logits[0])))
        else:  # Math-Shepherd: softmax over the (good, bad) logits, probability of good
            pair = logits[[prm.good_id, prm.bad_id]]
            out.append(float(torch.softmax(pair, -1)[0]))
    return out


@pytest.mark.parametrize("head", [HeadConfig(), HeadConfig("lm_tokens", "+", "-", step_tag="?")],
                         ids=["token_classification", "lm_tokens"])
def test_scores_are_read_at_step_end_tokens(tmp_path, head):
    path = _random_head_prm(tmp_path, head)
    scorer = PRMScorer(str(path), batch_size=2, head=head)
    got = scorer.score(PROMPTS, RESPONSES)
    assert [len(g) for g in got] == [len(steps.steps(r)) for r in RESPONSES]
    for p, r, g in zip(PROMPTS, RESPONSES, got):
        want = _slow_scores(path, head, p, r)
        assert g == pytest.approx(want, abs=1e-5)
    flat = [x for g in got for x in g]
    assert len(set(round(x, 6) for x in flat)) > 3  # the head is random: scores differ between steps
    assert scorer.tokens_per_s > 0


def test_saved_head_and_separator_are_picked_up(tmp_path):
    head = HeadConfig("lm_tokens", "+", "-", step_tag="?")
    path = _random_head_prm(tmp_path, head)
    scorer = load_scorer(path)  # no head given: read from prmflow.json
    assert scorer.prm.head == head and scorer.step_separator == "\n"


def test_truncated_steps_score_zero_and_batches_do_not_interact(tmp_path):
    path = _random_head_prm(tmp_path)
    full = PRMScorer(str(path), batch_size=1).score(PROMPTS, RESPONSES)
    batched = PRMScorer(str(path), batch_size=3).score(PROMPTS, RESPONSES)
    assert batched == [pytest.approx(f, abs=1e-5) for f in full]
    tok = modeling.build_tokenizer()
    n_prompt = len(tok(PROMPTS[0])["input_ids"])
    short = PRMScorer(str(path), max_length=n_prompt + 8).score(PROMPTS[:1], RESPONSES[:1])[0]
    assert short[0] == pytest.approx(full[0][0], abs=1e-5) and short[1:] == [0.0, 0.0]
    enc = encode(tok, PROMPTS[0], RESPONSES[0], max_length=n_prompt + 8)
    assert enc.n_steps == 3 and len(enc.step_ends) == 1


def test_untrained_head_scores_one_half(tmp_path):
    lm, tok = modeling.build_tiny_model("tiny-llama")
    modeling.save_pretrained(lm, tok, tmp_path / "lm")
    scores = PRMScorer(str(tmp_path / "lm")).score(PROMPTS, RESPONSES)
    assert all(math.isclose(x, 0.5) for s in scores for x in s)
