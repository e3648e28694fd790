"""Multi-turn rows in the PPO update: the environment's tokens (policy_mask 0) are context, never trained.

Perturb the logits the policy gives at environment tokens (by a lot) and what the hand-off says there
(advantages, old and reference log-probs): the loss, every statistic (entropy, KL loss, approx KL, clip
fraction) and every parameter's gradient stay bit-identical, and the gradient reaching those logits is
exactly zero. The chunked head (which never computes those logits) gives the loss of the whole logits."""

import pytest
import torch

from ppo_helpers import FAST
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.ppo import actor_critic as models, losses, minibatches as batch, stage, update

EXTRA = {"entropy_coef": 0.01, "kl_loss_coef": 0.1}


def _samples(vocab: int, seed: int = 0) -> list[batch.Sample]:
    """Four episodes: policy turn, observation, policy turn (row 3 single-turn, no mask), random numbers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        turns = [2 + i, 3 + (i % 2), 2 + (2 * i) % 3]
        mask = [1] * turns[0] + [0] * turns[1] + [1] * turns[2]
        r = len(mask)
        out.append(batch.Sample(
            prompt_ids=torch.randint(5, vocab, (3 + i,), generator=g).tolist(),
            response_ids=torch.randint(5, vocab, (r,), generator=g).tolist(),
            advantages=torch.randn(r, generator=g).tolist(),
            old_logprobs=(-3 + 0.3 * torch.randn(r, generator=g)).tolist(),
            ref_logprobs=(-3 + 0.3 * torch.randn(r, generator=g)).tolist(),
            policy_mask=mask if i < 3 else None))
    return out


def _cfg(chunk: int) -> stage.Config:
    return config.load(stage.Config, overrides={**FAST, "minibatch_size": 4, "micro_batch_size": 4,
                                                "head_chunk_rows": chunk, **EXTRA})


def _environment(samples) -> torch.Tensor:
    """(B, R) bool: the environment's tokens of the collated rows."""
    R = max(len(s.response_ids) for s in samples)
    env = torch.zeros(len(samples), R, dtype=torch.bool)
    for b, s in enumerate(samples):
        if s.policy_mask is not None:
            env[b, :len(s.policy_mask)] = torch.tensor(s.policy_mask) == 0
    return env


def _loss(model, cfg, samples, monkeypatch, noise: float = 0.0):
    """(loss, stats, gradients by parameter, gradient at the response logits (B, R, V) or None)."""
    env = _environment(samples)
    seen = {}
    original = models.response_logits

    def perturbed(engine, mb, keep):
        logits = original(engine, mb, keep)
        g = torch.Generator().manual_seed(1)
        logits = logits + noise * torch.randn(logits.shape, generator=g) * env[..., None]
        logits.retain_grad()
        seen["logits"] = logits
        return logits

    monkeypatch.setattr(models, "response_logits", perturbed)
    model.zero_grad(set_to_none=True)
    actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
    up = update.Updater(cfg, actor, None, max_len=32)
    mb = batch.collate(samples, list(range(len(samples))), 0)
    norm = losses.Normalizer.of([mb.mask], 32)
    loss, stats = up.actor_loss(mb, norm, norm, None, 0)
    actor.backward(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logits = seen.get("logits")
    return float(loss.detach()), stats, grads, None if logits is None else logits.grad


def test_environment_tokens_get_exactly_zero_gradient_and_no_kl_or_entropy(monkeypatch):
    model, tok = modeling.build_tiny_model("tiny-llama", seed=1)
    models.disable_dropout(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    samples = _samples(len(tok))
    env = _environment(samples)
    assert env.any() and (~env).any()
    loss, stats, grads, logit_grad = _loss(model, _cfg(0), samples, monkeypatch)

    # the environment's logits moved by ~10 nats and its hand-off numbers replaced: nothing moves
    other = _samples(len(tok))
    for s, o in zip(samples, other):
        if s.policy_mask is None:
            continue
        for name in ("advantages", "old_logprobs", "ref_logprobs"):
            setattr(o, name, [v if m else v + 5.0 for v, m in zip(getattr(s, name), s.policy_mask)])
    model.load_state_dict(state)
    loss2, stats2, grads2, _ = _loss(model, _cfg(0), other, monkeypatch, noise=10.0)
    assert loss2 == loss and stats2 == stats
    assert grads2.keys() == grads.keys() and grads
    for k in grads:
        assert torch.equal(grads2[k], grads[k]), k

    # the gradient reaching the environment's logits is exactly zero; the policy's tokens get one
    assert logit_grad is not None
    assert torch.count_nonzero(logit_grad[env]) == 0
    assert torch.count_nonzero(logit_grad[~env & batch.collate(samples, [0, 1, 2, 3], 0).mask]) > 0

    # the chunked head reads the policy's tokens only, and gives the same loss
    model.load_state_dict(state)
    chunked, chunked_stats, _, _ = _loss(model, _cfg(5), samples, monkeypatch)
    assert chunked == pytest.approx(loss, rel=1e-5)
    assert chunked_stats["kl_loss"] == pytest.approx(stats["kl_loss"], rel=1e-5)

