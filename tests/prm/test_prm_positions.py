"""Where the PRM reads a step: training puts each label at exactly the last token of its step, for
the character tokenizer and for a multi-character (BPE) tokenizer, with and without a step tag.
(The scoring side is checked against a per-prefix forward pass in test_prm_scoring.py.)"""

from __future__ import annotations

import pytest
import torch

from prmflow.tasks import arithmetic
from prmflow.components.models.prm_model import PRM, encode
from prmflow.components.prm import step_examples as data


def _last_char_positions(response: str, steps: list[str], tag: str = "") -> list[int]:
    """Reference: character index of the last character of every step (of its tag, when tagged)
    in the response text with the tag written after each step, found by searching the text."""
    text, pos, out = "", 0, []
    for s in steps:
        start = response.index(s, pos)
        text += response[pos:start + len(s)] + tag
        out.append(len(text) - 1)
        pos = start + len(s)
    return out


def test_training_loss_reaches_the_model_only_at_step_end_tokens():
    """d(loss)/d(step logit) is non-zero at exactly the last token of every step, and its sign is
    the label's (sigmoid(z) - y < 0 iff y = 1): every label sits on its own step's last token."""
    prm = PRM.load("tiny-llama")
    with torch.no_grad():
        prm.model.score.weight.normal_(0, 0.5)
    tok = prm.tokenizer
    examples = data.arithmetic_examples(8, seed=5, split="train", cfg=arithmetic.ArithmeticConfig(),
                                        negatives_per_problem=2)
    tokenized, dropped = data.tokenize(examples, tok, "\n", "", 256)
    assert dropped == 0 and len(tokenized) == 24
    b = data.collate(tokenized, tok.pad_token_id)
    z = prm(b["input_ids"], b["attention_mask"])
    z.retain_grad()
    loss, n = data.step_bce(z, b["targets"], b["step_mask"])
    loss.backward()

    want, signs = set(), {}
    for i, ex in enumerate(examples):
        n_prompt = len(tok(ex.prompt)["input_ids"])  # BOS + one token per character
        response = ex.response()
        for pos, step, y in zip(_last_char_positions(response, ex.steps), ex.steps, ex.labels):
            t = n_prompt + pos
            assert tok.convert_ids_to_tokens(int(b["input_ids"][i, t])) == step[-1]
            want.add((i, t))
            signs[(i, t)] = y
    got = {tuple(ij) for ij in (z.grad != 0).nonzero().tolist()}
    assert got == want and n == len(want)
    assert any(y == 0 for y in signs.values()) and any(y == 1 for y in signs.values())
    for (i, t), y in signs.items():
        assert (z.grad[i, t] < 0) == (y == 1), (i, t, y)


def _bpe_tokenizer(pre_tokenize: bool = True):
    """A byte-pair tokenizer trained here on arithmetic solutions. Its pre-tokenizer keeps a run of
    newlines with the text before it (as SentencePiece-style tokenizers keep spaces), so tokens span
    several characters and some run from a step's end into the separator, but never into the next
    step. Without it, merges may swallow a whole step into the token that ends the previous one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    if pre_tokenize:
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="merged_with_previous")
    corpus = [p.prompt + p.solution for p in arithmetic.generate(300, seed=9, split="train")]
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                         show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("tag", ["", "#"])
def test_readout_is_the_token_holding_the_step_last_character_with_bpe(tag):
    tok = _bpe_tokenizer()
    multi = crosses = 0
    for p in arithmetic.generate(40, seed=4, split="eval"):
        response = p.solution.replace("\n", "\n\n", 1)  # blank lines are not steps
        steps = arithmetic.split_steps(response)
        enc = encode(tok, p.prompt, response, "\n", tag)
        n_prompt = len(tok(p.prompt)["input_ids"])
        text = "".join(s + tag + sep for s, sep in zip(steps, ["\n\n"] + ["\n"] * len(steps)))[:-1]
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        want = []
        for c in _last_char_positions(response, steps, tag):
            (t,) = [k for k, (a, b) in enumerate(offsets) if a <= c < b]  # the one token holding that character
            want.append(n_prompt + t)
            multi += offsets[t][1] - offsets[t][0] > 1
            crosses += offsets[t][1] > c + 1
        assert enc.step_ends == want, p.prompt
        assert enc.n_steps == len(steps)
        assert enc.input_ids[:n_prompt] == tok(p.prompt)["input_ids"]
    if not tag:  # (an unseen tag character is a one-character token of its own)
        assert multi > 0  # the case the character tokenizer cannot show: readout tokens of several characters
        assert crosses > 0  # and tokens that run past the step's end into the separator


def test_a_step_swallowed_by_the_previous_token_shares_its_readout(tmp_path):
    """With merges across newlines one token can hold the end of a step and the whole next step. Such
    a step has no token of its own: it is read at that shared token (as rollout's step_ends place it),
    so scoring gives both steps that token's score and never fails mid-RL; training data refuses the
    row, naming it (two labels on one token would be indistinguishable to the loss)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from prmflow.components.models import modeling
    from prmflow.components.scoring.prm_scoring import PRMScorer

    tok = _bpe_tokenizer(pre_tokenize=False)
    examples = data.arithmetic_examples(60, seed=4, split="eval", cfg=arithmetic.ArithmeticConfig())
    shared = []
    for ex in examples:
        offsets = tok(ex.response(), add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        holders = [next(k for k, (a, b) in enumerate(offsets) if a <= c < b)
                   for c in _last_char_positions(ex.response(), ex.steps)]
        if len(set(holders)) < len(holders):  # two steps end in the same token
            shared.append((ex, holders))
    assert shared, "the unconstrained tokenizer should merge some step into its neighbour"
    ex, holders = shared[0]
    enc = encode(tok, ex.prompt, ex.response())
    n_prompt = len(tok(ex.prompt)["input_ids"])
    assert enc.step_ends == [n_prompt + h for h in holders] and enc.n_steps == len(ex.steps)

    ex.where = "steps.jsonl, line 7"
    with pytest.raises(data.DataError, match=r"steps.jsonl, line 7: .*two steps in one token.*step_tag"):
        data.tokenize([ex], tok, "\n", "", 256)

    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_labels=1,
                               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    modeling.save_pretrained(model, tok, tmp_path / "bpe-prm")
    (scores,) = PRMScorer(str(tmp_path / "bpe-prm")).score([ex.prompt], [ex.response()])
    assert len(scores) == len(ex.steps)
    by_token = {}
    for h, s in zip(holders, scores):
        by_token.setdefault(h, set()).add(round(s, 6))
    assert all(len(v) == 1 for v in by_token.values())  # steps sharing a token share its score
    assert len({round(s, 6) for s in scores}) == len(set(holders)) > 1  # and different tokens differ
