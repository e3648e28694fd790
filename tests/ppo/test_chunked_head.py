"""The policy scored through its LM head chunk by chunk (`head_chunk_rows`, models.PolicyScorer) gives
the same PPO loss, statistics, gradients, prepass old_logprobs and top-entropy mask as the whole
(B, R, V) logits (`head_chunk_rows=0`), on every backend and model kind PPO trains.

Tolerance 1e-5 in float32: the two paths compute the same logits with matrix products of different
shapes (N rows of the response vs B x (R + 1) positions), so they differ by float rounding only, a few
ulp of logits of order 1-10; log-softmax, entropy and their gradients carry that through at ~1e-6.
A wrong row, token, position or chunk boundary moves them by ~1e-1.

Every test also asserts the chunked path really ran (no fallback to the whole logits), so the
comparison is never of the whole path with itself.
"""

import functools

import pytest
import torch

from ppo_helpers import FAST
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.training import supervised_data
from prmflow.components.ppo import minibatches as batch, losses, actor_critic as models, prepass, ptx, stage, update

TOL = dict(rtol=1e-5, atol=1e-5)
CHUNK = 5  # does not divide the micro-batches' response tokens: the last chunk is short


def _samples(vocab: int, n: int = 4, seed: int = 0, prompt_prefix=(), low: int = 5) -> list[batch.Sample]:
    """n rows of uneven prompt and response lengths (so both paddings occur) with random advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 3 + (2 * i) % 5, 4 + (3 * i) % 7
        out.append(batch.Sample(
            prompt_ids=list(prompt_prefix) + torch.randint(low, vocab, (p,), generator=g).tolist(),
            response_ids=torch.randint(low, vocab, (r,), generator=g).tolist(),
            advantages=torch.randn(r, generator=g).tolist(),
            old_logprobs=(-3 + 0.3 * torch.randn(r, generator=g)).tolist(),
            ref_logprobs=(-3 + 0.3 * torch.randn(r, generator=g)).tolist()))
    return out


def _cfg(chunk: int, engine: str = "torch", **kw) -> stage.Config:
    zero = {"engine.backend": "deepspeed", "engine.zero_stage": int(engine[4:])} if engine.startswith("zero") else {}
    return config.load(stage.Config, overrides={**FAST, **zero, "minibatch_size": 4, "micro_batch_size": 4,
                                                "head_chunk_rows": chunk, **kw})


def _loss_and_grads(model, cfg, mb):
    """The actor's loss, statistics and gradients (by parameter name) of one micro-batch, and whether
    the chunked path ran."""
    actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
    up = update.Updater(cfg, actor, None, max_len=32)
    mb = mb.to(actor.device)
    norm = losses.Normalizer.of([mb.mask], 32)
    loss, stats = up.actor_loss(mb, norm, norm, None, 0)
    actor.backward(loss)
    if cfg.engine.backend == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p).clone() for n, p in actor.module.named_parameters() if p.requires_grad}
    else:
        grads = {n: p.grad.clone() for n, p in actor.module.named_parameters() if p.grad is not None}
    return float(loss.detach()), stats, grads, up.score.chunked


def _assert_same(got, ref):
    loss, stats, grads, chunked = got
    ref_loss, ref_stats, ref_grads, ref_chunked = ref
    assert chunked and not ref_chunked  # the chunked path ran; the reference took the whole logits
    assert loss == pytest.approx(ref_loss, **{"rel": 1e-5, "abs": 1e-5})
    for k in ref_stats:
        assert stats[k] == pytest.approx(ref_stats[k], rel=1e-5, abs=1e-5), k
    assert grads.keys() == ref_grads.keys() and grads
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], **TOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("preset,extra", [
    ("tiny-llama", {"entropy_coef": 0.01, "kl_loss_coef": 0.1}),   # entropy bonus with gradient, KL loss
    ("tiny-qwen2", {"entropy_metric_tokens": 7}),                 # the entropy metric from 7 sampled tokens
])
def test_chunked_actor_loss_and_gradients_equal_the_whole_logits(preset, extra):
    model, tok = modeling.build_tiny_model(preset, seed=1)
    models.disable_dropout(model)
    mb = batch.collate(_samples(len(tok)), [0, 1, 2, 3], tok.pad_token_id)
    ref = _loss_and_grads(model, _cfg(0, **extra), mb)
    model.zero_grad(set_to_none=True)
    _assert_same(_loss_and_grads(model, _cfg(CHUNK, **extra), mb), ref)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_chunked_head_under_deepspeed_zero_equals_the_whole_logits_in_torch(engine):
    """ZeRO-3 partitions the head's weight (tied to the embedding): the hook's head calls, forward and
    the backward's recomputation, must gather it, and the gradient must reach DeepSpeed's partitions."""
    extra = {"entropy_coef": 0.01}
    model, tok = modeling.build_tiny_model("tiny-llama", seed=2)
    models.disable_dropout(model)
    mb = batch.collate(_samples(len(tok), seed=1), [0, 1, 2, 3], tok.pad_token_id)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _loss_and_grads(model, _cfg(0, **extra), mb)
    model, _ = modeling.build_tiny_model("tiny-llama", seed=2)
    model.load_state_dict(state)
    models.disable_dropout(model)
    _assert_same(_loss_and_grads(model, _cfg(CHUNK, engine, **extra), mb), ref)


def test_chunked_head_of_a_lora_policy():
    """A peft-wrapped policy: the head and backbone are found inside the PeftModel, and the LoRA
    adapters' gradients equal the whole path's."""
    from peft import LoraConfig, get_peft_model

    model, tok = modeling.build_tiny_model("tiny-qwen2", seed=3)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                                            init_lora_weights=False))  # non-zero B: the adapters change the output
    models.disable_dropout(lora)
    mb = batch.collate(_samples(len(tok), seed=2), [0, 1, 2, 3], tok.pad_token_id)
    ref = _loss_and_grads(lora, _cfg(0, entropy_coef=0.01), mb)
    lora.zero_grad(set_to_none=True)
    got = _loss_and_grads(lora, _cfg(CHUNK, entropy_coef=0.01), mb)
    assert all("lora_" in k for k in got[2])
    _assert_same(got, ref)


def test_chunked_head_of_a_vision_language_policy():
    """LLaVA: the image's features enter the sequence at its image tokens (pixel inputs from
    mb.model_kwargs); the chunked scores read the language model's hidden states after them."""
    model, tok = modeling.build_tiny_vl_model("tiny-llava", seed=4)
    models.disable_dropout(model)
    image = tok.convert_tokens_to_ids(modeling.IMAGE_TOKEN)
    samples = _samples(len(tok) - 1, seed=3, prompt_prefix=[image] * 4)  # 4 image tokens: a 56x56 image in 28-pixel patches
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.pixels = {"pixel_values": torch.randn(1, 3, 56, 56, generator=g)}
    mb = batch.collate(samples, [0, 1, 2, 3], tok.pad_token_id)
    assert mb.pixels["pixel_values"].shape[0] == 4
    ref = _loss_and_grads(model, _cfg(0, entropy_coef=0.01), mb)
    model.zero_grad(set_to_none=True)
    _assert_same(_loss_and_grads(model, _cfg(CHUNK, entropy_coef=0.01), mb), ref)


def test_prepass_old_logprobs_and_top_entropy_mask_equal_the_whole_logits():
    """The prepass's recomputed old_logprobs and its top-entropy token mask (entropies of every token of
    the batch), chunked and whole."""
    model, tok = modeling.build_tiny_model("tiny-llama", seed=5)
    models.disable_dropout(model)
    results = []
    for chunk in (0, CHUNK):
        cfg = _cfg(chunk, recompute_old_logprobs=True, top_entropy_frac=0.5, minibatch_size=4, micro_batch_size=2, epochs=1)
        samples = _samples(len(tok), n=8, seed=4)
        actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
        prepass.precompute(cfg, samples, batch.minibatch_plan(len(samples), cfg), actor, None, tok.pad_token_id)
        results.append(samples)
    whole, chunked = results
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(torch.tensor(b.old_logprobs), torch.tensor(a.old_logprobs), **TOL)
        assert b.pg_mask == a.pg_mask
    assert 0 < sum(sum(s.pg_mask) for s in whole) < sum(len(s.pg_mask) for s in whole)


def test_a_model_whose_logits_are_not_its_heads_falls_back_with_a_reason(caplog):
    """Logits scaled after the head (Cohere's logit_scale, Gemma 2's soft-cap): the chunked scores would be
    of another distribution, so the scorer notices on the first call, says why, and takes the whole logits."""
    model, tok = modeling.build_tiny_model("tiny-llama", seed=6)
    models.disable_dropout(model)
    real_forward = model.forward

    @functools.wraps(real_forward)  # the same signature: logits_to_keep is accepted
    def scaled(*args, **kwargs):  # logits = 0.5 * head(hidden): Cohere-style logit scaling
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    mb = batch.collate(_samples(len(tok), seed=5), [0, 1, 2, 3], tok.pad_token_id)
    cfg = _cfg(CHUNK)
    actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
    whole = models.whole_scores(actor, mb, True)
    model.forward = scaled
    scorer = models.PolicyScorer(actor, CHUNK)
    got = scorer(mb)
    assert not scorer.chunked and "not its LM head applied" in caplog.text
    torch.testing.assert_close(got.logp, models.whole_scores(actor, mb, True).logp)  # the scaled model's, whole
    assert not torch.allclose(got.logp[mb.mask], whole.logp[mb.mask])


# --- the ptx loss ------------------------------------------------------------------------------

def _ptx_batch(vocab: int, pad_id: int, n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ptx micro-batch as ptx.ptx_batch makes it: prompts masked, responses trained on, right-padded
    rows of uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        p, r = 2 + (3 * i) % 5, 3 + (2 * i) % 6
        ids = torch.randint(5, vocab, (p + r,), generator=g).tolist()
        examples.append(supervised_data.Example(ids, [supervised_data.IGNORE] * p + ids[p:]))
    return supervised_data.collate(examples, pad_id)


def _ptx_reference(model, b: dict[str, torch.Tensor], tokens: int):
    """The token-mean cross-entropy over the trained tokens from the model's whole logits, by hand, and its
    gradients by parameter name."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()  # (B, T, V)
    labels = b["labels"][:, 1:]                                                   # token t predicted at t - 1
    trained = labels != supervised_data.IGNORE
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    loss = -(logp * trained).sum() / tokens
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("chunk,engine", [(CHUNK, "torch"), (0, "torch"), (CHUNK, "zero3")])
def test_ptx_loss_and_gradients_equal_the_cross_entropy_of_the_whole_logits(chunk, engine):
    """The actor's loss with only the ptx term (zero advantages: the surrogate and its gradient are 0): its
    value, `ptx_loss` and gradients equal the hand-computed token-mean cross-entropy, chunked (ZeRO-3
    gathering the head for it) and whole; the chunked one really read the head in chunks."""
    model, tok = modeling.build_tiny_model("tiny-qwen2", seed=7)
    models.disable_dropout(model)
    samples = _samples(len(tok), seed=6)
    for s in samples:
        s.advantages = [0.0] * len(s.response_ids)
    mb = batch.collate(samples, [0, 1, 2, 3], tok.pad_token_id)
    ptx_mb = _ptx_batch(len(tok), tok.pad_token_id)
    tokens = int((ptx_mb["labels"][:, 1:] != supervised_data.IGNORE).sum())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref_grads = _ptx_reference(model, ptx_mb, tokens)
    model.load_state_dict(state)

    cfg = _cfg(chunk, engine, ptx_coef=1.0)
    actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
    up = update.Updater(cfg, actor, None, max_len=32)
    norm = losses.Normalizer.of([mb.mask], 32)
    loss, stats = up.actor_loss(mb.to(actor.device), norm, norm, ptx_mb, tokens)
    actor.backward(loss)
    assert up.ptx.chunked == (chunk > 0)
    assert stats["policy_loss"] == 0.0
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert stats["ptx_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    if cfg.engine.backend == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p).clone() for n, p in actor.module.named_parameters() if p.requires_grad}
    else:
        grads = {n: p.grad.clone() for n, p in actor.module.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and grads
    for k in ref_grads:
        torch.testing.assert_close(grads[k].cpu(), ref_grads[k], **TOL, msg=lambda m: f"{k}: {m}")


def test_ptx_loss_of_a_model_whose_logits_are_not_its_heads_falls_back_with_a_reason(caplog):
    """Logits scaled after the head: the ptx scorer notices, says why, and takes the whole logits."""
    model, tok = modeling.build_tiny_model("tiny-llama", seed=8)
    models.disable_dropout(model)
    real_forward = model.forward

    @functools.wraps(real_forward)
    def scaled(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    ptx_mb = _ptx_batch(len(tok), tok.pad_token_id, seed=1)
    cfg = _cfg(CHUNK)
    actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
    unscaled = ptx.whole_ce_sum(actor, ptx_mb)
    model.forward = scaled
    scorer = ptx.PtxScorer(actor, CHUNK)
    got = scorer(ptx_mb)
    assert not scorer.chunked and "not its LM head applied" in caplog.text and "ptx loss" in caplog.text
    torch.testing.assert_close(got, ptx.whole_ce_sum(actor, ptx_mb))  # the scaled model's, whole
    assert not torch.allclose(got, unscaled)
