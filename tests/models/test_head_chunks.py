"""`head_chunks.chunked_head_scores` (the head read chunk by chunk inside the model's forward pass, as PPO's
policy scorer and the implicit PRM use it) against the slow, obvious computation from whole (B, T, V) logits:
log-probs, entropies, the no-graph entropy sample and their gradients, for a plain HF model and a peft-wrapped
one (the backbone and head found inside the PeftModel). float32, 1e-5: the two paths make the same logits with
matrix products of different shapes, so they differ by float rounding only; a wrong row or position moves
them by ~1e-1."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prmflow.components.models.head_chunks import chunked_head_scores

V = 1000  # a vocabulary wider than the model, as a real one is
IDS = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(0))
MASK = (torch.arange(12)[None, :] < torch.tensor([[12], [9], [7]])).long()  # right padding
# every real token from column 3 on (a "response"), read 4 at a time: 9 + 6 + 4 = 19 tokens, the last chunk short
ROWS, POSITIONS = (MASK.bool() & (torch.arange(12) >= 3)).nonzero(as_tuple=True)
SAMPLE = (ROWS[::5], POSITIONS[::5])
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_lm(wrap: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    if wrap == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))  # non-zero B: the adapters change the output
    return model.eval()


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_chunked_head_scores_equal_the_whole_logits(wrap):
    model = tiny_lm(wrap)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got, why = chunked_head_scores(model, model, IDS, ROWS, POSITIONS, 4, entropy=True, sample=SAMPLE,
                                   attention_mask=MASK)
    assert got is not None, why
    got_grads = torch.autograd.grad(got.logp.sum() + got.entropy.sum(), list(params.values()))

    logp = torch.log_softmax(model(input_ids=IDS, attention_mask=MASK).logits.float(), -1)  # (B, T, V)
    entropy = -(logp.exp() * logp).sum(-1)                                                     # (B, T)
    want_logp = logp[ROWS, POSITIONS - 1].gather(-1, IDS[ROWS, POSITIONS][:, None])[:, 0]    # entry t - 1 predicts token t
    want_entropy = entropy[ROWS, POSITIONS - 1]
    want_grads = torch.autograd.grad(want_logp.sum() + want_entropy.sum(), list(params.values()))

    assert got.logp.shape == (19,) and want_logp.std() > 0.1  # distinct values: a shifted read cannot match
    torch.testing.assert_close(got.logp, want_logp, **TOL)
    torch.testing.assert_close(got.entropy, want_entropy, **TOL)
    assert not got.sampled.requires_grad
    torch.testing.assert_close(got.sampled, entropy[SAMPLE[0], SAMPLE[1] - 1].detach(), **TOL)
    assert wrap == "plain" or all("lora_" in n for n in params)
    for name, g, w in zip(params, got_grads, want_grads):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{name}: {m}")
