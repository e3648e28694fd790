"""The PPO loss functions against slow, element-by-element references and hand-computed numbers."""

import math

import pytest
import torch

from prmflow.components.ppo import losses


def _rand(seed=0, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + torch.randn(B, T, generator=g) * 0.4  # ratios from about 0.3 to 3: every branch is hit
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return logp, old, adv, mask


# --- KL estimators ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,formula", [
    ("k1", lambda x: x),
    ("k2", lambda x: x * x / 2),
    ("k3", lambda x: min(math.exp(-x) - 1 + x, 10.0)),
])
def test_kl_estimators_match_their_definitions(name, formula):
    logp, ref, _, mask = _rand(1)
    got = losses.kl_estimate(name, logp, ref, mask)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            want = formula(float(logp[b, t]) - float(ref[b, t])) if mask[b, t] else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-6)


def test_k3_is_nonnegative_and_padding_cannot_overflow():
    logp = torch.tensor([[-1.0, -500.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, 0.0]])  # x = -500 on the padding: exp(500) would be inf
    mask = torch.tensor([[True, False]])
    k3 = losses.kl_estimate("k3", logp, ref, mask)
    k3.sum().backward()
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


def test_k3_is_clamped_as_verl_clamps_low_var_kl():
    # volcengine/verl@v0.7.0 verl/trainer/ppo/core_algos.py:1637-1643: kl = clamp(ref - logp, -20, 20);
    # clamp(exp(kl) - kl - 1, -10, 10). One token whose reference is far likelier (x = -15: exp(15) = 3.3e6)
    # must not outweigh the batch, and the clamped token gets no gradient
    logp = torch.tensor([[-16.0, -1.0, -0.5, -40.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.3, -31.0, -1.0]])  # x = -15, 0.3, 30.5, -39
    mask = torch.ones(1, 4, dtype=torch.bool)
    k3 = losses.kl_estimate("k3", logp, ref, mask)
    want = [min(math.exp(-x) - 1 + x, 10.0) for x in (-15.0, 0.3, 20.0, -20.0)]  # x past 20 counts as 20
    assert k3[0].tolist() == pytest.approx(want, rel=1e-6)
    k3.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 3] == 0 and logp.grad[0, 1] != 0


# --- policy loss -----------------------------------------------------------------------------

def _slow_policy_loss(logp, old, adv, lo, hi, c):
    """Token by token with math.exp, min and max, as written in docs/design.md."""
    rho = math.exp(logp - old)
    loss = -min(rho * adv, min(max(rho, 1 - lo), 1 + hi) * adv)
    clipped = -min(max(rho, 1 - lo), 1 + hi) * adv > -rho * adv
    dual = False
    if c and adv < 0 and loss > -c * adv:
        loss, dual = -c * adv, True
    return loss, clipped, dual


@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, 0.0), (0.1, 0.28, 0.0), (0.2, 0.2, 1.5)])
def test_policy_loss_matches_slow_reference(lo, hi, c):
    logp, old, adv, mask = _rand(2, B=6, T=8)
    out = losses.ppo_policy_loss(logp, old, adv, mask, lo, hi, c)
    n_dual = 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                assert out.loss[b, t] == 0 and not out.clipped[b, t] and not out.dual_clipped[b, t]
                continue
            want, clipped, dual = _slow_policy_loss(float(logp[b, t]), float(old[b, t]), float(adv[b, t]), lo, hi, c)
            assert out.loss[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
            assert bool(out.clipped[b, t]) == clipped
            assert bool(out.dual_clipped[b, t]) == dual
            n_dual += dual
    assert (n_dual > 0) == (c > 0)  # the random case really exercises the dual clip


def test_dual_clip_acts_only_for_negative_advantage_and_ratio_above_c():
    # ratio:            0.5    2.0    4.0    4.0    2.9    3.1
    ratio = torch.tensor([[0.5, 2.0, 4.0, 4.0, 2.9, 3.1]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0, -2.0, -2.0]])
    logp = torch.log(ratio)
    old = torch.zeros_like(logp)
    mask = torch.ones_like(adv, dtype=torch.bool)
    off = losses.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, 0.0)
    on = losses.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0)
    assert on.dual_clipped.tolist() == [[False, False, True, False, False, True]]
    # where it acts, the loss is -c*A; elsewhere it is unchanged
    assert torch.allclose(on.loss[0, [2, 5]], torch.tensor([3.0, 6.0]))
    keep = [0, 1, 3, 4]
    assert torch.equal(on.loss[0, keep], off.loss[0, keep])
    # hand values without dual clip: A<0 -> |A|*max(r, clip(r)); A>0 -> -A*min(r, clip(r))
    assert torch.allclose(off.loss, torch.tensor([[0.8, 2.0, 4.0, -1.2, 5.8, 6.2]]))


def test_ratio_one_means_no_clipping_and_gradient_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    out = losses.ppo_policy_loss(logp, logp.detach(), adv, torch.ones(1, 3, dtype=torch.bool), 0.2, 0.2, 3.0)
    assert torch.equal(out.ratio, torch.ones(1, 3)) and not out.clipped.any() and not out.dual_clipped.any()
    out.loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)  # d(-rho*A)/dlogp = -rho*A = -A at rho = 1


def test_policy_loss_padding_with_extreme_logprobs_gives_finite_gradients():
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1e30]])  # padding holds garbage: exp(1e30) would be inf
    out = losses.ppo_policy_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.tensor([[True, False]]))
    mask = torch.tensor([[True, False]])
    losses.token_mean(out.loss, mask, losses.Normalizer.of(mask)).backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(logp.grad).all()


# --- value loss ------------------------------------------------------------------------------

def test_value_loss_matches_slow_reference_and_clips_only_where_defined():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4, 6, generator=g)
    v_old = v + torch.randn(4, 6, generator=g) * 0.5
    ret = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    eps = 0.2
    out = losses.clipped_value_loss(v, v_old, ret, mask, eps)
    n_clipped = 0
    for b in range(4):
        for t in range(6):
            V, Vo, R = float(v[b, t]), float(v_old[b, t]), float(ret[b, t])
            vc = Vo + min(max(V - Vo, -eps), eps)
            want = 0.5 * max((V - R) ** 2, (vc - R) ** 2) if mask[b, t] else 0.0
            assert out.loss[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
            clipped = bool(mask[b, t]) and (vc - R) ** 2 > (V - R) ** 2
            assert bool(out.clipped[b, t]) == clipped
            if clipped:  # clipping can only bind when V moved more than eps away from V_old
                assert abs(V - Vo) > eps
            n_clipped += clipped
    assert n_clipped > 0
    plain = losses.clipped_value_loss(v, v_old, ret, mask, 0.0)
    assert torch.allclose(plain.loss, torch.where(mask, 0.5 * (v - ret) ** 2, 0)) and not plain.clipped.any()


def test_value_loss_hand_values():
    # V_old = 0, eps = 0.2, R = 1: V = 0.1 (inside) -> 0.5*0.81; V = 0.5 -> clipped to 0.2: 0.5*max(0.25, 0.64)
    # V = 1.5 (overshoots, moved > eps) -> 0.5*max(0.25, 0.64) = 0.32; V = -0.5 -> 0.5*max(2.25, 1.44) = 1.125
    out = losses.clipped_value_loss(torch.tensor([[0.1, 0.5, 1.5, -0.5]]), torch.zeros(1, 4), torch.ones(1, 4),
                                    torch.ones(1, 4, dtype=torch.bool), 0.2)
    assert torch.allclose(out.loss, torch.tensor([[0.405, 0.32, 0.32, 1.125]]))
    assert out.clipped.tolist() == [[False, True, True, False]]


# --- aggregation -----------------------------------------------------------------------------

def _hand_batch():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return x, mask


def test_aggregations_hand_values():
    x, mask = _hand_batch()  # valid: [1, 2, 3] and [4]; the third row has no valid token
    assert losses.aggregate("token-mean", x, mask).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert losses.aggregate("seq-mean-token-mean", x, mask).item() == pytest.approx(((1 + 2 + 3) / 3 + 4 / 1) / 2)
    # Dr. GRPO: sum / (rows * max_len): 3 rows, longest response 3 tokens, or a given constant 10
    assert losses.aggregate("seq-mean-token-sum-norm", x, mask).item() == pytest.approx(10 / (3 * 3))
    norm = losses.Normalizer.of(mask, max_len=10)
    assert losses.aggregate("seq-mean-token-sum-norm", x, mask, norm).item() == pytest.approx(10 / 30)


@pytest.mark.parametrize("mode", sorted(losses.AGGREGATIONS))
def test_micro_batch_shares_add_up_to_the_whole_minibatch(mode):
    g = torch.Generator().manual_seed(4)
    lens = [5, 1, 3, 7, 2, 6]
    x = torch.randn(6, 7, generator=g)
    mask = torch.arange(7)[None, :] < torch.tensor(lens)[:, None]
    whole = losses.aggregate(mode, x, mask, losses.Normalizer.of(mask, max_len=9))
    # micro-batches are padded to their own longest response
    parts = [(x[a:b, :max(lens[a:b])], mask[a:b, :max(lens[a:b])]) for a, b in [(0, 2), (2, 3), (3, 6)]]
    norm = losses.Normalizer.of([m for _, m in parts], max_len=9)
    assert norm == losses.Normalizer.of(mask, max_len=9)
    shares = sum(losses.aggregate(mode, xp, mp, norm) for xp, mp in parts)
    assert shares.item() == pytest.approx(whole.item(), rel=1e-6)


def test_unknown_names_are_rejected():
    x, mask = _hand_batch()
    with pytest.raises(ValueError, match="token-mean"):
        losses.aggregate("mean", x, mask)
    with pytest.raises(ValueError, match="k3"):
        losses.kl_estimate("k4", x, x, mask)


# --- top-entropy token selection ------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.2, 0.5, 1.0])
def test_top_fraction_matches_sorting(fraction):
    scores = torch.randn(37, generator=torch.Generator().manual_seed(5))
    got = losses.top_fraction(scores, fraction)
    k = math.ceil(fraction * 37)
    threshold = sorted(scores.tolist(), reverse=True)[k - 1]
    assert got.tolist() == [s >= threshold for s in scores.tolist()]
    assert int(got.sum()) == k


# --- the entropy metric without an entropy bonus ------------------------------------------------------

def test_entropy_metric_is_exact_on_all_tokens_and_the_mean_of_its_sample_otherwise():
    """`train/entropy` with entropy_coef 0: every masked token (max_tokens 0 or >= the count) gives the
    full sum; a cap gives the picked tokens' mean entropy times the masked count, picked evenly over the
    masked tokens only (a padded position's entropy never enters)."""
    from prmflow.components.ppo.update import entropy_metric_sum

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], dtype=torch.bool)
    p = torch.softmax(logits, -1)
    ent = -(p * p.log()).sum(-1)                                   # (3, 7), by the definition
    full = float(ent[mask].sum())
    assert abs(entropy_metric_sum(logits, mask, 0) - full) < 1e-4
    assert abs(entropy_metric_sum(logits, mask, 13) - full) < 1e-4
    # 13 masked tokens, 4 picked: positions 0, 4, 8, 12 of the masked tokens in order
    picked = ent[mask][[0, 4, 8, 12]]
    assert abs(entropy_metric_sum(logits, mask, 4) - float(picked.mean()) * 13) < 1e-4
    assert entropy_metric_sum(logits, torch.zeros_like(mask), 4) == 0.0


# --- rollout correction ----------------------------------------------------------------------

def _correction_batch():
    """Three responses (lengths 3, 2, 2) with old - behavior differences chosen by hand."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, 0.0], [-1.0, -1.0, 0.0]])
    diff = torch.tensor([[0.5, -1.0, 0.0], [1.0, -3.0, 0.0], [0.5, 0.5, 0.0]])  # old - behavior
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, False]])
    behavior = torch.where(mask, old - diff, torch.full_like(old, -900.0))  # padding far off: must not count
    return old, behavior, mask


@pytest.mark.parametrize("mode,want", [
    # token: w = exp(diff), capped at 2 -> truncated to 2, or 0 under mask
    ("token_truncate", [[math.exp(0.5), math.exp(-1), 1.0], [2.0, math.exp(-3), 0], [math.exp(0.5), math.exp(0.5), 0]]),
    ("token_mask", [[math.exp(0.5), math.exp(-1), 1.0], [0.0, math.exp(-3), 0], [math.exp(0.5), math.exp(0.5), 0]]),
    # sequence: w = exp(sum of diffs) on every token: exp(-0.5), exp(-2), exp(1) > 2
    ("sequence_truncate", [[math.exp(-0.5)] * 3, [math.exp(-2)] * 2 + [0], [2.0, 2.0, 0]]),
    ("sequence_mask", [[math.exp(-0.5)] * 3, [math.exp(-2)] * 2 + [0], [0.0, 0.0, 0]]),
])
def test_rollout_correction_weights_match_hand_values(mode, want):
    old, behavior, mask = _correction_batch()
    corr = losses.rollout_correction(old, behavior, mask, mode, cap=2.0)
    assert torch.allclose(corr.weights, torch.tensor(want), atol=1e-6), corr.weights
    stats = losses.rollout_correction_stats(corr, mask, mode)
    if mode.startswith("token"):  # over the 7 valid tokens; one (e^1) is above the cap
        applied = [w for row, m in zip(want, mask.tolist()) for w, v in zip(row, m) if v]
        assert stats["is_capped_frac"] == pytest.approx(1 / 7)
        assert stats["is_weight_raw_max"] == pytest.approx(math.e, rel=1e-6)
    else:  # over the 3 responses; the third (e^1) is above the cap
        applied = [row[0] for row in want]
        assert stats["is_capped_frac"] == pytest.approx(1 / 3)
        assert stats["is_weight_raw_max"] == pytest.approx(math.e, rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(sum(applied) / len(applied), rel=1e-6)


def test_rollout_correction_of_a_long_sequence_stays_finite_and_capped():
    """A response whose summed log-ratio is far beyond exp's range still gets a finite weight, the cap."""
    old = torch.zeros(1, 400)
    behavior = torch.full((1, 400), -1.0)  # sum = 400: exp(400) is inf in float32
    corr = losses.rollout_correction(old, behavior, torch.ones(1, 400, dtype=torch.bool), "sequence_truncate", 2.0)
    assert torch.isfinite(corr.raw).all() and (corr.weights == 2.0).all() and corr.capped.all()
