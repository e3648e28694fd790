"""The ppo stage end to end on the tiny SFT policy, with advantages hand-offs built in the test."""

import json
import math

import pytest
import torch

from ppo_helpers import FAST, params, score, write_advantages
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow import tracking
from prmflow.errors import ConfigError, DataError, ModelLoadError, OutputExistsError
from prmflow.components.training import supervised_data
from prmflow.components.ppo import minibatches as batch, actor_critic as models, prepass, ptx, stage


def make_cfg(policy, adv, out, **overrides):
    return config.load(stage.Config, overrides={**FAST, "policy": str(policy), "input": str(adv),
                                                "output": str(out), **overrides})


def history(out):
    return [json.loads(line) for line in (out / "updates.jsonl").read_text().splitlines()]


def new_logprobs(policy_dir, rows):
    model, _ = modeling.load_causal_lm(policy_dir)
    model.eval()
    return score(model, [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows])


# --- the ratio ---------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
def test_first_minibatch_has_ratio_one_and_later_ones_do_not(sft_policy, rows16, tmp_path, recompute):
    adv = write_advantages(tmp_path / "adv", rows16, lambda i, t: (-1) ** i * (1 + t % 3))
    out = tmp_path / "out"
    stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4,
                       recompute_old_logprobs=recompute))
    first, second = history(out)
    # old_logprobs from the hand-off (scored right-padded by the test) agree with the stage's
    # left-padded forward up to float noise; recomputed ones are bit-identical
    tol = 0.0 if recompute else 1e-5
    assert abs(first["ratio_max"] - 1) <= tol and abs(first["ratio_min"] - 1) <= tol
    assert first["clip_frac"] == 0.0 and first["approx_kl"] <= 1e-10
    # the second minibatch is scored by the updated policy: a ratio computed against the old
    # log-probs twice would stay at exactly 1 here
    assert max(second["ratio_max"] - 1, 1 - second["ratio_min"]) > 1e-3
    assert second["approx_kl"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_old_logprobs_are_recomputed_by_default_where_the_rollouts_numbers_differ(sft_policy, rows16, tmp_path, dtype):
    """A sampler whose log-probs are off by 0.25 per token (bf16, vLLM, another GPU's kernels). On CPU in
    float32 the default reads the hand-off (the rollout's own float32 forward there); with engine.dtype
    bfloat16 (and on any GPU) it recomputes them: the first ratio is exactly 1, the gap is reported."""
    rows = [dict(r, old_logprobs=[x - 0.25 for x in r["old_logprobs"]]) for r in rows16]
    adv = write_advantages(tmp_path / "adv", rows, lambda i, t: (-1) ** i)
    out = tmp_path / "out"
    m = stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4,
                           **{"engine.dtype": dtype}))
    first = history(out)[0]
    if dtype == "float32" and not torch.cuda.is_available():
        assert first["ratio_min"] == pytest.approx(math.exp(0.25), abs=1e-4)  # the hand-off, as written
        assert "train/old_logprob_gap_max" not in m
    else:
        assert first["ratio_max"] == 1.0 and first["ratio_min"] == 1.0 and first["clip_frac"] == 0.0
        # 0.25 plus bf16's own difference from the float32 numbers the rows were scored with
        assert m["train/old_logprob_gap_mean"] == pytest.approx(0.25, abs=0.03)
        assert m["train/old_logprob_gap_max"] >= 0.25


@torch.no_grad()
def tempered_logprobs(policy_dir, rows, temperature):
    """log p of each response token under softmax(logits / temperature), each row alone in one plain forward."""
    model, _ = modeling.load_causal_lm(policy_dir)
    model.eval()
    out = []
    for r in rows:
        ids, p = torch.tensor([r["prompt_ids"] + r["response_ids"]]), len(r["prompt_ids"])
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
        out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("head_chunk_rows", [0, 512])
def test_the_trainers_logprobs_are_of_the_rollouts_temperature(sft_policy, rows16, tmp_path, head_chunk_rows):
    """Rows sampled at temperature 0.7 carry log-probs of softmax(logits / 0.7) and say so (logprob_temperature): the
    stage's log-probs are that distribution's too, in the update (the first minibatch's ratio against the hand-off's
    old_logprobs, a plain forward's at 0.7, is 1) and in the prepass (recomputed old_logprobs within 1e-5 of
    them), on the whole logits and chunk by chunk. Before, the stage took logits / 1: ratios of exp(+-0.1) and more."""
    old = tempered_logprobs(sft_policy, rows16, 0.7)
    rows = [dict(r, old_logprobs=lp, ref_logprobs=list(lp), logprob_temperature=0.7) for r, lp in zip(rows16, old)]
    adv = write_advantages(tmp_path / "adv", rows, lambda i, t: (-1) ** i)
    out = tmp_path / "out"
    stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4, kl_loss_coef=0.1,
                       head_chunk_rows=head_chunk_rows, recompute_old_logprobs=False))
    first = history(out)[0]
    assert abs(first["ratio_max"] - 1) <= 1e-5 and abs(first["ratio_min"] - 1) <= 1e-5
    assert first["kl_loss"] <= 1e-9  # the ref's log-probs (here the policy's at 0.7) are taken at 0.7 too
    m = stage.run(make_cfg(sft_policy, adv, tmp_path / "recomputed", epochs=1, minibatch_size=8, micro_batch_size=4,
                           head_chunk_rows=head_chunk_rows, recompute_old_logprobs=True))
    assert m["train/old_logprob_gap_max"] <= 1e-5


def test_rows_of_two_temperatures_are_refused_naming_both(sft_policy, rows16, tmp_path):
    """One update takes its log-probs at one temperature: a hand-off mixing 0.7 and 1.0 is refused with both values
    and rows; a hand-off without the column (written before it) is read at 1."""
    rows = [dict(r, logprob_temperature=0.7 if i < 8 else 1.0) for i, r in enumerate(rows16)]
    adv = write_advantages(tmp_path / "adv", rows, 1.0)
    with pytest.raises(DataError, match=r"'logprob_temperature' is 0.7 in row 0 and 1 in row 8"):
        batch.load_batch(make_cfg(sft_policy, adv, tmp_path / "out"))
    plain = write_advantages(tmp_path / "plain", rows16, 1.0)
    assert {batch.temperature_of(s) for s in batch.load_batch(make_cfg(sft_policy, plain, tmp_path / "out"))} == {1.0}


# --- direction of an update --------------------------------------------------------------------

@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_update_moves_logprobs_with_the_sign_of_the_advantage(sft_policy, rows16, tmp_path, sign):
    rows = rows16[:8]
    chosen = {0, 1, 2, 3}  # advantages on these responses' tokens, 0 elsewhere
    adv = write_advantages(tmp_path / "adv", rows, lambda i, t: sign if i in chosen else 0.0)
    out = tmp_path / "out"
    stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4, **{"optim.lr": 1e-4},
                       ema_decay=0.9))
    before = torch.tensor([x for i in sorted(chosen) for x in rows[i]["old_logprobs"]])
    after_all = new_logprobs(out / "policy", rows)
    after = torch.tensor([x for i in sorted(chosen) for x in after_all[i]])
    change = (after - before).mean().item()
    assert change * sign > 1e-4, change
    # parameters changed, and the EMA copy is decay*old + (1-decay)*new after one update
    p0, p1, ema = params(sft_policy), params(out / "policy"), params(out / "policy_ema")
    changed = [k for k in p0 if not torch.equal(p0[k], p1[k])]
    assert len(changed) >= 0.9 * len(p0)
    for k in p0:
        assert torch.allclose(ema[k], 0.9 * p0[k] + 0.1 * p1[k], atol=1e-6)


# --- aggregation through micro-batches ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_matches_hand_value_and_is_micro_batch_invariant(sft_policy, rows16, tmp_path, mode):
    rows = rows16[:8]
    a = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.25, -0.5]  # one advantage per response
    # Dr. GRPO's constant: the generation budget the advantages' manifest carries (40), not the longest response
    adv = write_advantages(tmp_path / "adv", rows, lambda i, t: a[i], manifest={"max_new_tokens": 40})
    lens = [len(r["response_ids"]) for r in rows]
    assert max(lens) < 40
    aggregate = {  # per-row token losses (lists of tensors) -> one number, written out by hand
        "token-mean": lambda ls: sum(loss.sum() for loss in ls) / sum(lens),
        "seq-mean-token-mean": lambda ls: sum(loss.mean() for loss in ls) / 8,
        "seq-mean-token-sum-norm": lambda ls: sum(loss.sum() for loss in ls) / (8 * 40),
    }[mode]
    # reference: the whole minibatch in one right-padded forward, loss -A * exp(logp - old)
    model, _ = modeling.load_causal_lm(sft_policy)
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    T = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (T - len(q)) for q in seqs])
    attn = torch.tensor([[1] * len(q) + [0] * (T - len(q)) for q in seqs])
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits, -1)
    per_row = []
    for i, r in enumerate(rows):
        p = len(r["prompt_ids"])
        logp = lp[i, p - 1:p - 1 + lens[i]].gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0]
        per_row.append(-a[i] * torch.exp(logp - torch.tensor(r["old_logprobs"])))
    ref_loss = aggregate(per_row)
    ref_loss.backward()
    ref_norm = torch.sqrt(sum((q.grad ** 2).sum() for q in model.parameters() if q.grad is not None)).item()
    ref_grad = {k: q.grad for k, q in model.named_parameters() if q.grad is not None}
    at_ratio_one = aggregate([-torch.full((n,), a[i]) for i, n in enumerate(lens)])  # per-token loss -A
    assert ref_loss.item() == pytest.approx(at_ratio_one.item(), rel=1e-4)
    outs = []
    for micro in (2, 8):
        out = tmp_path / f"out{micro}"
        stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=micro,
                           loss_agg=mode))
        h = history(out)[0]
        assert h["policy_loss"] == pytest.approx(ref_loss.item(), rel=1e-4)
        assert h["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)  # same gradient, not just the same loss
        outs.append(params(out / "policy"))
    # Both policies took the same first Adam step. That step is lr * g / (|g| + eps) per element, about
    # lr * sign(g): where g is near 0 it is decided by float summation order (the two micro-batch sizes
    # add the gradient up differently), and the two runs may move such an element in opposite directions.
    # The paths agree to rel 1e-4 on the gradient (grad_norm above), so an element whose reference
    # gradient is below 1e-4 of the tensor's largest may flip; every other element must move identically,
    # and every trained tensor must have moved.
    before = params(sft_policy)
    for k in outs[0]:
        g = ref_grad.get(k)
        if g is None:
            continue
        assert not torch.equal(outs[0][k], before[k]), f"{k} did not move"
        differs = ~torch.isclose(outs[0][k], outs[1][k], rtol=0, atol=1e-5)
        noisy = g.abs() <= 1e-4 * g.abs().max()
        assert not (differs & ~noisy).any(), \
            f"{k}: {int((differs & ~noisy).sum())} elements with a clear gradient moved differently"


# --- rollout correction ------------------------------------------------------------------------

def test_rollout_correction_weights_each_tokens_loss_and_logs_its_statistics(sft_policy, rows16, tmp_path):
    """behavior_logprobs = old_logprobs - d with d chosen per token: the first update (ratio 1, A = 1) has
    policy loss -(token-mean of min(e^d, 2)), and the logged statistics are those of the weights."""
    rows = rows16[:8]
    def d(i, t):  # e^0.9 > 2: capped
        return (0.9 if t == 0 else -0.3) if i % 2 else 0.1 * ((t % 3) - 1)

    behavior = [[lp - d(i, t) for t, lp in enumerate(r["old_logprobs"])] for i, r in enumerate(rows)]
    adv = write_advantages(tmp_path / "adv", rows, 1.0, behavior_logprobs=behavior)
    w = [min(math.exp(d(i, t)), 2.0) for i, r in enumerate(rows) for t in range(len(r["response_ids"]))]
    raw = [math.exp(d(i, t)) for i, r in enumerate(rows) for t in range(len(r["response_ids"]))]
    m = stage.run(make_cfg(sft_policy, adv, tmp_path / "out", epochs=1, minibatch_size=8, micro_batch_size=4,
                           rollout_correction="token_truncate", recompute_old_logprobs=False))
    assert history(tmp_path / "out")[0]["policy_loss"] == pytest.approx(-sum(w) / len(w), rel=1e-4)
    assert m["train/is_weight_mean"] == pytest.approx(sum(w) / len(w), rel=1e-6)
    assert m["train/is_weight_raw_max"] == pytest.approx(max(raw), rel=1e-6)
    assert m["train/is_capped_frac"] == pytest.approx(sum(x > 2 for x in raw) / len(raw))
    # without behavior_logprobs in the hand-off the key cannot act: a clear error, not weights of 1
    bare = write_advantages(tmp_path / "bare", rows, 1.0)
    with pytest.raises(DataError, match="'behavior_logprobs' is null in row 0.*rollout_correction"):
        stage.run(make_cfg(sft_policy, bare, tmp_path / "out2", minibatch_size=8, micro_batch_size=4,
                           rollout_correction="token_truncate"))


# --- critic, warm-up and KL control ------------------------------------------------------------

def test_critic_warmup_value_loss_and_adaptive_kl(sft_policy, rows16, tmp_path):
    adv = write_advantages(tmp_path / "adv", rows16, lambda i, t: (-1) ** i, returns=0.5, values=0.0,
                           kl=lambda i, t: 0.01 * (i % 4))
    out = tmp_path / "out"
    m = stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4, train_critic=True,
                           critic_warmup_steps=1, kl_control="adaptive", kl_target=1.0, kl_horizon=100,
                           kl_coef=0.1))
    warm, first_actor = history(out)
    assert not warm["actor"] and "policy_loss" not in warm and warm["value_loss"] > 0
    # the actor did not move during the warm-up: its first update still sees ratio 1
    assert abs(first_actor["ratio_max"] - 1) < 1e-5 and abs(first_actor["ratio_min"] - 1) < 1e-5
    # V_old = V = 0 at the start, R = 0.5: the first value loss is 0.5 * 0.5^2
    assert warm["value_loss"] == pytest.approx(0.125, rel=1e-5)
    assert first_actor["value_loss"] < warm["value_loss"]
    # the critic was written and its values moved toward the returns
    critic, _ = modeling.load_scalar_model(out / "critic")
    r = rows16[0]
    with torch.no_grad():
        v = critic(input_ids=torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0, :, 0]
    assert v.abs().max() > 0
    # adaptive KL: per-response KL = mean over rows of 0.01*(i%4)*len
    kl = sum(0.01 * (i % 4) * len(r["response_ids"]) for i, r in enumerate(rows16)) / 16
    want = 0.1 * (1 + max(min(kl / 1.0 - 1, 0.2), -0.2) * 16 / 100)
    state = json.loads((out / "kl_state.json").read_text())
    assert state["kl_coef"] == pytest.approx(want) and m["train/kl_coef"] == pytest.approx(want)
    assert state["previous_kl_coef"] == 0.1 and state["measured_kl"] == pytest.approx(kl)


# --- top-entropy mask ------------------------------------------------------------------------

def test_top_entropy_mask_selects_highest_entropy_tokens_and_only_they_train(sft_policy, rows16, tmp_path):
    rows = rows16[:8]
    cfg = make_cfg(sft_policy, tmp_path / "unused", tmp_path / "x", epochs=1, minibatch_size=8,
                   micro_batch_size=4, top_entropy_frac=0.25)
    model, tok = modeling.load_causal_lm(sft_policy)
    actor = models.make_engine(model, cfg, cfg.optim.lr, 1, 0, 4)
    samples = [batch.Sample.of({**r, "advantages": [0.0] * len(r["response_ids"])}) for r in rows]
    prepass.precompute(cfg, samples, batch.minibatch_plan(8, cfg), actor, None, tok.pad_token_id)
    # independent entropies: one row at a time, full logits, -(p log p).sum()
    ent = []
    with torch.no_grad():
        for r in rows:
            logits = model(input_ids=torch.tensor([r["prompt_ids"] + r["response_ids"]], device=actor.device)).logits[0]
            p = torch.softmax(logits[len(r["prompt_ids"]) - 1:-1], -1)
            ent += (-(p * p.log()).sum(-1)).tolist()
    k = math.ceil(0.25 * len(ent))
    threshold = sorted(ent, reverse=True)[k - 1]
    kept = [x for s in samples for x in s.pg_mask]
    assert sum(kept) == k
    assert [bool(x) for x in kept] == [e >= threshold - 1e-6 for e in ent]
    # advantages only on tokens outside the mask: no policy gradient at all, the policy is unchanged
    flags = iter([not bool(x) for x in kept])
    adv_values = [[1.0 if next(flags) else 0.0 for _ in r["response_ids"]] for r in rows]
    adv = write_advantages(tmp_path / "adv", rows, adv_values)
    out = tmp_path / "out"
    stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4, top_entropy_frac=0.25))
    p0, p1 = params(sft_policy), params(out / "policy")
    assert all(torch.equal(p0[n], p1[n]) for n in p0)


# --- ptx ---------------------------------------------------------------------------------------

def test_ptx_loss_is_the_supervised_token_mean_and_is_trained(sft_policy, rows16, tmp_path):
    rows = rows16[:8]
    adv = write_advantages(tmp_path / "adv", rows, 0.0)
    out = tmp_path / "out"
    cfg = make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=8, micro_batch_size=4, ptx_coef=1.0, **{"optim.lr": 1e-5},
                   ptx_num_prompts=64, ptx_batch_size=8)
    stage.run(cfg)
    model, tok = modeling.load_causal_lm(sft_policy)
    examples = ptx.load_ptx(cfg, tok)
    micro, _ = ptx.ptx_batch(cfg, examples, 0, 2, tok.pad_token_id)

    def ce(m):  # token-mean cross-entropy over every response token of the update's ptx examples
        total, count = 0.0, 0
        with torch.no_grad():
            for b in micro:
                logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                s, n = supervised_data.response_loss(logits, b["labels"])
                total, count = total + float(s), count + n
        return total / count

    h = history(out)[0]
    assert h["policy_loss"] == 0.0
    assert h["ptx_loss"] == pytest.approx(ce(model), rel=1e-4)
    trained, _ = modeling.load_causal_lm(out / "policy")
    assert ce(trained) < ce(model)


# --- safety ------------------------------------------------------------------------------------

def _bad(rows, bad_rows):
    """Rows whose old_logprobs are -1e30: exp(logp - old) overflows, with A < 0 the loss is inf."""
    return [dict(r, old_logprobs=[-1e30] * len(r["response_ids"])) if i in bad_rows else r for i, r in enumerate(rows)]


def test_nan_update_is_skipped_and_counted(sft_policy, rows16, tmp_path):
    rows = rows16[:8]
    cfg = make_cfg(sft_policy, tmp_path / "adv", tmp_path / "out", epochs=1, minibatch_size=4, micro_batch_size=2,
                   recompute_old_logprobs=False)  # the hand-off's numbers, also on a GPU
    first = batch.minibatch_plan(8, cfg)[0]
    write_advantages(tmp_path / "adv", _bad(rows, {first[3]}), -1.0)  # in the 2nd micro-batch of update 1
    m = stage.run(cfg)
    h = history(tmp_path / "out")
    assert h[0]["skipped"] and not h[1].get("skipped")
    assert m["train/skipped_updates"] == 1
    assert math.isfinite(h[1]["policy_loss"])


def test_run_where_every_update_is_skipped_fails_clearly(sft_policy, rows16, tmp_path):
    rows = rows16[:8]
    adv = write_advantages(tmp_path / "adv", _bad(rows, set(range(8))), -1.0)
    with pytest.raises(stage.TrainingDivergedError, match="every policy update"):
        stage.run(make_cfg(sft_policy, adv, tmp_path / "out", epochs=1, minibatch_size=4, micro_batch_size=4,
                           recompute_old_logprobs=False))
    assert not (tmp_path / "out").exists()


# --- resume ------------------------------------------------------------------------------------

class _Crash(Exception):
    pass


@pytest.mark.parametrize("how", ["crash", "sigterm"])
def test_resume_after_interruption_matches_an_uninterrupted_run(sft_policy, rows16, tmp_path, monkeypatch, how):
    """crash: killed during update 3 with a checkpoint every update (save_every=1); sigterm: the pod
    is stopped during update 2 with no periodic checkpoints, so the preemption save is the only one."""
    import os
    import signal

    from prmflow.components.runtime import preemption

    adv = write_advantages(tmp_path / "adv", rows16, lambda i, t: (-1) ** i * (1 + t % 2), returns=0.3, values=0.0)
    kw = dict(epochs=1, minibatch_size=4, micro_batch_size=2, train_critic=True, ema_decay=0.5,
              save_every=1 if how == "crash" else 0)
    stage.run(make_cfg(sft_policy, adv, tmp_path / "full", **kw))

    real = tracking.start_stage_run

    class InterruptingTracker(tracking.NullTracker):
        def log_metrics(self, metrics, step=None):
            if how == "crash" and step == 3:  # updates 1 and 2 are checkpointed; update 3 dies before its save
                raise _Crash
            if how == "sigterm" and step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(tracking, "start_stage_run", lambda *a, **k: InterruptingTracker())
    with pytest.raises(_Crash if how == "crash" else preemption.Preempted) as stopped:
        stage.run(make_cfg(sft_policy, adv, tmp_path / "resumed", **kw))
    if how == "sigterm":
        assert stopped.value.code == 143 and stopped.value.step == 2
    assert not (tmp_path / "resumed").exists() and (tmp_path / ".resumed.work" / "latest").is_dir()
    monkeypatch.setattr(tracking, "start_stage_run", real)
    stage.run(make_cfg(sft_policy, adv, tmp_path / "resumed", **kw))
    assert not (tmp_path / ".resumed.work").exists()
    for sub in ("policy", "critic", "policy_ema"):
        a, b = params(tmp_path / "full" / sub), params(tmp_path / "resumed" / sub)
        assert all(torch.equal(a[k], b[k]) for k in a), sub
    assert history(tmp_path / "full") == history(tmp_path / "resumed")


# --- idempotence, config and data errors ---------------------------------------------------------

def test_kl_coef_used_is_carried_on_and_other_advantages_in_the_same_place_are_not_the_finished_output(
        sft_policy, rows16, tmp_path):
    """(The re-run of a finished output: tests/reliability/test_kill_resume.py, for every stage.)"""
    # the advantage stage records the beta it used; that, not the kl_coef config key, is carried on
    adv = write_advantages(tmp_path / "adv", rows16[:4], 1.0, manifest={"kl_coef_used": 0.2})
    out = tmp_path / "out"
    m1 = stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=4, micro_batch_size=4, kl_coef=0.7))
    assert json.loads((out / "kl_state.json").read_text())["kl_coef"] == 0.2
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=4, micro_batch_size=4, kl_coef=0.7)) == m1
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    # the same advantages at another path (a pipeline re-run's new artifact): still the same result
    import shutil

    moved = shutil.copytree(adv, tmp_path / "rerun-artifact" / "advantages")
    assert stage.run(make_cfg(sft_policy, moved, out, epochs=1, minibatch_size=4, micro_batch_size=4, kl_coef=0.7)) == m1
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(OutputExistsError):
        stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=4, micro_batch_size=4, **{"optim.lr": 5e-4}))
    # same config, other data in the same place: not "already done" either
    write_advantages(tmp_path / "adv2", rows16[:4], -1.0, manifest={"kl_coef_used": 0.2})
    shutil.rmtree(adv)
    shutil.move(tmp_path / "adv2", adv)
    with pytest.raises(OutputExistsError, match="different config"):
        stage.run(make_cfg(sft_policy, adv, out, epochs=1, minibatch_size=4, micro_batch_size=4, kl_coef=0.7))


def test_missing_columns_are_reported(sft_policy, rows16, tmp_path):
    adv = write_advantages(tmp_path / "adv", rows16[:4], 1.0)
    with pytest.raises(DataError, match="'returns'"):
        stage.run(make_cfg(sft_policy, adv, tmp_path / "out", minibatch_size=4, micro_batch_size=4, train_critic=True))


@pytest.mark.parametrize("overrides,match", [
    ({"minibatch_size": 8, "micro_batch_size": 3}, "must divide"),
    ({"dual_clip": 0.5}, "dual_clip"),
    ({"critic_warmup_steps": 2}, "train_critic=true"),
    ({"top_entropy_frac": 0.0}, "top_entropy_frac"),
    ({"rollout_correction_cap": 0.5}, "rollout_correction_cap"),
])
def test_bad_configs_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(stage.Config, overrides=overrides)


def test_cli_help_lists_the_knobs(capsys):
    from prmflow import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["ppo", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for key in ("--clip_eps_high", "--loss_agg", "--kl_control", "--critic_warmup_steps", "--engine.zero_stage"):
        assert key in text


def test_metrics_reach_mlflow_under_their_names(sft_policy, rows16, tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient

    adv = write_advantages(tmp_path / "adv", rows16[:8], lambda i, t: (-1) ** i, returns=0.5, values=0.0)
    cfg = make_cfg(sft_policy, adv, tmp_path / "out", epochs=1, minibatch_size=4, micro_batch_size=4, train_critic=True,
                   iteration=2, **{"tracking.enabled": True, "tracking.uri": sqlite_store})
    stage.run(cfg)
    client = MlflowClient(sqlite_store)
    (run,) = client.search_runs([client.get_experiment_by_name("prmflow").experiment_id])
    assert run.data.tags["prmflow.stage"] == "ppo" and run.data.tags["prmflow.iteration"] == "2"
    for key in ("train/policy_loss", "train/value_loss", "train/clip_frac", "train/approx_kl", "train/entropy",
                "train/grad_norm", "train/lr", "train/skipped_updates", "perf/tokens_per_s", "ppo/kl_coef", "ppo/policy_loss"):
        assert key in run.data.metrics, key
    # one point per update, at the global update count (iteration 2 of 2-update iterations: 5, 6); the summary is ppo/*
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/policy_loss")] == [5, 6]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "ppo/policy_loss")] == [6]


def test_next_iteration_continues_the_optimizer(sft_policy, rows16, tmp_path):
    adv = write_advantages(tmp_path / "adv", rows16[:8], 1.0)
    small = dict(epochs=1, minibatch_size=4, micro_batch_size=4, rl_iterations=2)
    out0 = tmp_path / "it0"
    stage.run(make_cfg(sft_policy, adv, out0, **small))
    assert (out0 / "optimizer" / "actor" / "optimizer.safetensors").is_file()
    carried = stage.run(make_cfg(out0 / "policy", adv, tmp_path / "it1", iteration=1,
                                 optimizer_state=str(out0 / "optimizer"), **small))
    fresh = stage.run(make_cfg(out0 / "policy", adv, tmp_path / "fresh", iteration=1, **small))
    assert carried["train/updates"] == fresh["train/updates"] == 2
    p_carried, p_fresh = params(tmp_path / "it1" / "policy"), params(tmp_path / "fresh" / "policy")
    assert any(not torch.equal(p_carried[n], p_fresh[n]) for n in p_carried)  # the moments did change the step
    with pytest.raises(ModelLoadError, match="no actor/ directory"):
        stage.run(make_cfg(out0 / "policy", adv, tmp_path / "bad", iteration=1, optimizer_state=str(out0), **small))
    assert not (tmp_path / "bad").exists()
    off = stage.run(make_cfg(sft_policy, adv, tmp_path / "off", save_optimizer=False, **small))
    assert off and not (tmp_path / "off" / "optimizer").exists()
