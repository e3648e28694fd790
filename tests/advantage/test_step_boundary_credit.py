"""grpo_progress's baseline credit where the policy chooses whether to end a step, computed exactly over real
tokenizations: the baseline of a token must not depend on the token it scores.

One prompt, responses "x = 4<choice>so y = 5" with the choice ending the step (a newline: two steps) or not (a
space: one step), the two-step text taken with probability P_NEWLINE; the outcome is drawn apart from the text
(1 with probability P_SUCCESS), so it is independent of the choice and GRPO's expected gradient on the choice's
logit is 0. The PRM rates the first step's prefix 0.9 (issue 61, item 1). The step ends are placed by the
rollout's own code (`scoring.step_ends`: `steps.step_spans` / `steps.step_end_tokens`) from the token ids, and
the rollouts' manifest records the separator as the rollout stage's does; every group of G responses is
enumerated with its probability, so the stage's advantages give the exact E[A_t * d/d logit log pi(choice)] at
the token where the two texts first differ.
"""

import itertools

import numpy as np
import pyarrow as pa
import pytest
from test_advantage_stage import make_cfg, read_out, row

from prmflow.components.advantage import stage
from prmflow.components.data import schema
from prmflow.components.models.bpe_tokenizer import build_bpe_tokenizer
from prmflow.components.rollout import response_scores as scoring

G = 2
P_NEWLINE, P_SUCCESS = 0.5, 0.1
FIRST_STEP_SCORE, OTHER_SCORE = 0.9, 0.4
UNGATED = {"estimator": "grpo_progress", "step_reward_mode": "progress", "process_weight": 1.0,
           "process_auc_min": 0.0, "process_auc_full": 0.0}


def _byte_level(merges: list[tuple[str, str]]):
    """A byte-level BPE without a pre-tokenizer split (as SentencePiece-style vocabularies do): every byte a
    token, then `merges` (in the byte-level alphabet: "Ċ" is a newline, "Ġ" a space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def _newline_opens_the_next_token():
    """"\\ns" and " s" are single tokens: the newline opens the token after it."""
    return _byte_level([("Ċ", "s"), ("Ġ", "s")])


# name -> (tokenizer, step separator, the two texts (two steps, one step), the choice's token in each)
CASES = {
    "newline its own token": (build_bpe_tokenizer, "\n", ("x = 4\nso y = 5", "x = 4 so y = 5"), ("\n", " ")),
    "newline opens the next token": (_newline_opens_the_next_token, "\n", ("x = 4\nso y = 5", "x = 4 so y = 5"),
                                     ("\ns", " s")),
    "qwen2 '.\\n' one token": (build_bpe_tokenizer, "\n", ("x = 4.\nso y = 5", "x = 4. so y = 5"), (".\n", ".")),
    # a two-byte separator, one token per byte: the choice is the separator's second token
    "'\\n\\n' separator, a token per newline": (lambda: _byte_level([]), "\n\n",
                                              ("x = 4\n\nso y = 5", "x = 4\nso y = 5"), ("\n", "s")),
}


def _prm(text: str, end: int) -> float:
    """The PRM's score of the prefix that ends with the step ending at character `end`: a function of it alone."""
    return FIRST_STEP_SCORE if text[:end].rstrip(".") == "x = 4" else OTHER_SCORE


def _choice_gradient(tmp_path, case: str, **options) -> float:
    """Exact E[A_t(choice token) * (1[two steps] - P_NEWLINE)] per response (the group's sum over G)."""
    make_tokenizer, separator, texts, choice_tokens = CASES[case]
    tok = make_tokenizer()
    variants = []  # (response_ids, step_ends, step scores) of the two-step and the one-step response
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        decoded, ends = scoring.step_ends(tok, ids, separator)
        spans = [b for _, b in scoring.steps_lib.step_spans(decoded, separator)]
        variants.append((ids, ends, [_prm(decoded, b) for b in spans]))
    (nl_ids, nl_ends, _), (sp_ids, sp_ends, _) = variants
    d = next(i for i, (a, b) in enumerate(zip(nl_ids, sp_ids)) if a != b)  # the token that decides
    assert [tok.decode([nl_ids[d]]), tok.decode([sp_ids[d]])] == list(choice_tokens)  # the case is what it says
    assert len(nl_ends) == 2 and len(sp_ends) == 1
    kinds = [(c, o) for c in (0, 1) for o in (1.0, 0.0)]  # c = 0: two steps
    prob = {(c, o): (P_NEWLINE if c == 0 else 1 - P_NEWLINE) * (P_SUCCESS if o else 1 - P_SUCCESS) for c, o in kinds}
    rows, weight = [], {}
    for g, combo in enumerate(itertools.product(kinds, repeat=G)):
        weight[g] = float(np.prod([prob[k] for k in combo]))
        for i, (c, o) in enumerate(combo):
            ids, ends, scores = variants[c]
            rows.append(row(pid="target", idx=i, n=len(ids), response_ids=ids, step_ends=ends, step_rewards=scores,
                            outcome_reward=o, iteration=g, old_logprobs=[-1.0] * len(ids),
                            ref_logprobs=[-1.0] * len(ids), values=[0.0] * len(ids)))
    out = tmp_path / "".join(c if c.isalnum() else "_" for c in case) / options["estimator"]
    out.mkdir(parents=True)
    with schema.DatasetWriter(out / "rollouts", "rollouts", config={"step_separator": separator}) as w:
        w.write(pa.Table.from_pylist(rows))  # the rollout stage's manifest records its config, separator included
    stage.run(make_cfg(out, **options))
    grad = 0.0
    for r in read_out(out):
        newline = r["response_ids"] == nl_ids
        grad += weight[r["iteration"]] * r["advantages"][d] * ((1.0 if newline else 0.0) - P_NEWLINE)
    return grad / G


@pytest.mark.parametrize("case", sorted(CASES))
def test_baseline_credit_leaves_the_step_boundary_choice_grpos(tmp_path, case):
    grpo = _choice_gradient(tmp_path, case, estimator="grpo")
    assert grpo == pytest.approx(0.0, abs=1e-7)  # the outcome does not depend on the choice
    baseline = _choice_gradient(tmp_path, case, **UNGATED, process_credit="baseline")
    assert baseline == pytest.approx(grpo, abs=1e-6)  # advantages are stored as float32
