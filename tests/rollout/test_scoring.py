"""Scoring helpers against slow references: token offsets and step ends, forward logprobs, values."""

from __future__ import annotations

import random

import pytest
import torch

from prmflow.components.models import modeling, prm_model
from prmflow.components.data import steps
from prmflow.components.rollout import response_scores as scoring

scoring_selected = scoring.selected_logprobs  # the real one, for the tests that count its calls

TEXTS = ["7+5=12\n12*3=36\n36-4=32\nanswer: 32", "first step\n\nsecond: é ∑ 😀 done\nthird\n", "\n\nlead\n",
         "no separator at all", "ünïcödé\n∫x dx = x²/2\nanswer: \\boxed{\\frac{1}{2}}"]


def byte_level_bpe():
    """A small byte-level BPE tokenizer (GPT-2 style) trained here: multi-token words, tokens that
    merge a newline with text, characters split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [f"{rng.randint(1, 99)}+{rng.randint(1, 9)}={rng.randint(1, 99)}\nanswer: {rng.randint(1, 99)}\n"
              for _ in range(300)]
    core.train_from_iterator(corpus + TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")


def reference_step_ends(tokenizer, ids, separator="\n"):
    """Slow reference: the last token of a step is the first token at which the decoded prefix covers
    the step's last character, decoding every prefix."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    prefix_lens = [len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True).rstrip("\ufffd")) for k in range(len(ids))]
    return [next(k for k, n in enumerate(prefix_lens) if n >= end) for _, end in steps.step_spans(text, separator)]


@pytest.mark.parametrize("which", ["char", "bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_step_ends_match_the_prefix_decoding_reference(which, text):
    tok = modeling.build_tokenizer(list(modeling.ALPHABET) + list("éü∑😀ï∫ö²\\{}")) if which == "char" else byte_level_bpe()
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    decoded, ends = scoring.step_ends(tok, ids)
    assert decoded == tok.decode(ids, skip_special_tokens=True)
    assert ends == reference_step_ends(tok, ids)
    assert len(ends) == len(steps.steps(decoded))


def test_bpe_splits_characters_and_merges_newlines():
    """The BPE test tokenizer really exercises split characters and newline-merging tokens."""
    tok = byte_level_bpe()
    text = TEXTS[1]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # a character split across tokens
    _, offsets = scoring.token_offsets(tok, ids)
    assert offsets[-1][1] == len(text) and all(a <= b for a, b in offsets)


def test_char_tokenizer_step_end_is_followed_by_the_separator():
    tok = modeling.build_tokenizer()
    ids = tok("3+4=7\n7*2=14\n\nanswer: 14\n", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    _, ends = scoring.step_ends(tok, ids)
    assert [tok.decode(ids[e + 1:e + 2]) for e in ends] == ["\n", "\n", "\n"]
    assert [tok.decode(ids[:e + 1]).split("\n")[-1] for e in ends] == ["3+4=7", "7*2=14", "answer: 14"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = modeling.build_tiny_model("tiny-llama", seed=3)
    return model.eval(), tok


def random_rows(n=7, seed=0):
    g = random.Random(seed)
    prompts = [[g.randrange(4, 80) for _ in range(g.randint(3, 12))] for _ in range(n)]
    responses = [[g.randrange(4, 80) for _ in range(g.randint(1, 15))] for _ in range(n)]
    return prompts, responses


def test_forward_logprobs_match_one_row_at_a_time(tiny):
    model, tok = tiny
    prompts, responses = random_rows()
    got = scoring.forward_logprobs(model, prompts, responses, batch_size=3, pad_id=tok.pad_token_id)
    for p, r, lp in zip(prompts, responses, got):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0], -1)[len(p) - 1:-1].gather(-1, torch.tensor(r)[:, None])[:, 0]
        assert lp.shape == (len(r),)
        assert torch.allclose(torch.from_numpy(lp), ref, atol=1e-5)


def test_forward_logprobs_read_the_head_chunk_by_chunk_never_whole_logits(monkeypatch):
    """A vocabulary much wider than the model, as Qwen2.5's 151,936 against 1,536: the head read 5 response
    positions at a time gives each row's log-probs as the whole-logits path and each row alone do, and no
    more than one chunk's rows of vocabulary-wide tensors are ever alive (the whole path: every position
    of the batch, prompts and padding included)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from live_logits import LiveLogits

    V, H = 1000, 32
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    monkeypatch.setattr(prm_model, "LOGIT_CHUNK_BYTES", 4 * V * 5)
    g = random.Random(2)
    prompts = [[g.randrange(1, V) for _ in range(g.randint(3, 12))] for _ in range(7)]
    responses = [[g.randrange(1, V) for _ in range(g.randint(1, 15))] for _ in range(7)]
    with LiveLogits(V, H) as chunked_probe:
        got = scoring.forward_logprobs(model, prompts, responses, batch_size=3, pad_id=0)
    with LiveLogits(V, H) as whole_probe:
        whole = scoring.forward_logprobs(model, prompts, responses, batch_size=3, pad_id=0, chunked=False)
    for p, r, lp, w in zip(prompts, responses, got, whole):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p + r])).logits[0], -1)[len(p) - 1:-1].gather(
                -1, torch.tensor(r)[:, None])[:, 0]
        assert lp.shape == w.shape == (len(r),)
        torch.testing.assert_close(torch.from_numpy(lp), ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(lp), torch.from_numpy(w), rtol=0, atol=1e-5)
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    assert whole_probe.peak >= 3 * (longest - 1)  # the probe sees the whole path's (B, T, V) logits
    assert chunked_probe.peak <= 3 * 5  # one chunk: its logits, the log-softmax, what cross-entropy keeps


def test_forward_logprobs_of_a_soft_capped_model_take_the_whole_path_after_one_look(monkeypatch, caplog):
    """Gemma 2 soft-caps its logits after the head, so the head alone would give other log-probs: the first
    batch's check sees it and that batch and every later one take the whole path (one look, not one a batch)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=0.5)).eval()
    looks = []
    monkeypatch.setattr(scoring, "selected_logprobs", lambda *a, **k: looks.append(scoring_selected(*a, **k)) or looks[-1])
    prompts, responses = random_rows(n=7, seed=3)
    got = scoring.forward_logprobs(model, prompts, responses, batch_size=3, pad_id=0)  # 3 batches
    assert looks == [None]
    said = [r.getMessage() for r in caplog.records if "cannot be read in chunks" in r.getMessage()]
    assert len(said) == 1 and "Gemma2ForCausalLM's logits are not its LM head applied" in said[0]  # once, with why
    for p, r, lp in zip(prompts, responses, got):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p + r])).logits[0], -1)[len(p) - 1:-1].gather(
                -1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(lp), ref, rtol=0, atol=1e-5)


def test_forward_values_read_the_position_before_each_response_token(tmp_path, tiny, scalar_dir):
    model, tok = tiny
    modeling.save_pretrained(model, tok, tmp_path / "lm")
    critic, _ = modeling.load_scalar_model(scalar_dir(tmp_path / "critic", base=tmp_path / "lm", seed=4))
    critic.eval()
    prompts, responses = random_rows(seed=1)
    got = scoring.forward_values(critic, prompts, responses, batch_size=4, pad_id=tok.pad_token_id)
    for p, r, v in zip(prompts, responses, got):
        with torch.no_grad():
            ref = critic(torch.tensor([p + r])).logits[0, :, 0]
        assert torch.allclose(torch.from_numpy(v), ref[len(p) - 1:len(p) - 1 + len(r)], atol=1e-5)
        assert v.std() > 0 or len(v) == 1  # a random head: the values really differ by position
