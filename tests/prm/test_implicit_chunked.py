"""The implicit PRM reads its LM head chunk by chunk: step logits, the training loss and its gradients
equal the plain computation from whole (B, T, V) logits (`implicit_step_logits`), no vocabulary-wide
tensor larger than one chunk is ever made (forward or backward), and a model whose logits are not its
head's output (Gemma 2's soft-cap) falls back to the plain computation."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from prmflow.components.models.prm_model import PRM, HeadConfig, implicit_step_logits
from prmflow.components.prm.step_examples import step_bce

from live_logits import LiveLogits

V = 1000  # a vocabulary much wider than the model, as Qwen2.5's 151,936 against 1,536
H = 32  # the models' hidden size
BATCH = {"input_ids": torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(0)),
         "response_start": torch.tensor([6, 3, 9])}
BATCH["attention_mask"] = (torch.arange(24)[None, :] < torch.tensor([[24], [17], [21]])).long()  # right padding
STEP_MASK = torch.zeros(3, 24, dtype=torch.bool)
STEP_MASK[0, [8, 15, 23]] = STEP_MASK[1, [5, 16]] = STEP_MASK[2, [12, 20]] = True
TARGETS = torch.where(STEP_MASK, torch.tensor([1.0, 0.0, 1.0])[:, None].expand(3, 24), torch.zeros(3, 24))


def implicit_prm(cls=Qwen2ForCausalLM, tie: bool = True) -> PRM:
    """A small random LM moved away from its own frozen copy (the reference), so the log-ratio is not 0."""
    torch.manual_seed(0)
    if cls is Gemma2ForCausalLM:  # Gemma 2 soft-caps its logits after the head
        cfg = Gemma2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=5.0)
    else:
        cfg = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, tie_word_embeddings=tie)
    model = cls(cfg)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prm = PRM(model, None, HeadConfig("implicit", beta=0.5), reference)
    prm.logit_chunk_rows = 7  # several chunks per batch, the last one short
    return prm


def plain(prm: PRM) -> torch.Tensor:
    """The step logits from whole logits of both models (what the scorer computed before chunking)."""
    ids, mask = BATCH["input_ids"], BATCH["attention_mask"]
    with torch.no_grad():
        ref = prm.reference(input_ids=ids, attention_mask=mask).logits
    return implicit_step_logits(prm.model(input_ids=ids, attention_mask=mask).logits, ref, ids, mask,
                                BATCH["response_start"], prm.head.beta)


def loss_and_grads(prm: PRM, z: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    prm.model.zero_grad()
    loss = step_bce(z, TARGETS, STEP_MASK)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in prm.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "own-head"])
def test_chunked_step_logits_loss_and_gradients_equal_the_plain_computation(tie):
    prm = implicit_prm(tie=tie)
    z = prm(BATCH["input_ids"], BATCH["attention_mask"], response_start=BATCH["response_start"])
    assert prm.chunked  # the chunked path ran, not the fallback
    want = plain(prm)
    assert want[STEP_MASK].abs().max() > 0.05  # the models differ: the comparison has teeth
    torch.testing.assert_close(z, want, rtol=0, atol=1e-5)
    loss, grads = loss_and_grads(prm, z)
    want_loss, want_grads = loss_and_grads(prm, plain(prm))
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-5)
    assert grads.keys() == want_grads.keys() and "lm_head.weight" in grads or tie
    for name, g in want_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def peak_live_logits(prm: PRM, chunked: bool) -> int:
    """Peak rows of live vocabulary-wide tensors in a training step's forward and backward pass."""
    with LiveLogits(V, H) as seen:
        z = prm(BATCH["input_ids"], BATCH["attention_mask"], response_start=BATCH["response_start"]) if chunked \
            else plain(prm)
        step_bce(z, TARGETS, STEP_MASK)[0].backward()
    return seen.peak


def test_the_chunked_path_never_holds_more_than_one_chunk_of_logits():
    """44 response tokens of a (3, 24) batch read 8 at a time: at no moment of the forward or backward
    pass are more than one chunk's logits, float32 copy, log-softmax and gradient (4 x 8 rows) alive;
    the plain path holds whole (B, T, V) logits of both models and their copies."""
    prm = implicit_prm(tie=False)
    prm.logit_chunk_rows = 8
    B, T = BATCH["input_ids"].shape
    assert peak_live_logits(prm, chunked=False) >= 2 * B * T  # the probe sees the plain path's (B, T, V) logits
    assert peak_live_logits(prm, chunked=True) <= 4 * prm.logit_chunk_rows


def test_logits_that_are_not_the_heads_output_fall_back_to_the_plain_computation(caplog):
    """Gemma 2 soft-caps its logits after the head: reading the head alone would be wrong, the check on
    the last position sees it, and the step logits are the plain computation's."""
    prm = implicit_prm(Gemma2ForCausalLM)
    z = prm(BATCH["input_ids"], BATCH["attention_mask"], response_start=BATCH["response_start"])
    assert not prm.chunked and "not its LM head applied" in caplog.text and "computing the logits whole" in caplog.text
    torch.testing.assert_close(z, plain(prm), rtol=0, atol=1e-6)
