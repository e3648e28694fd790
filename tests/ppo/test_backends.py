"""DeepSpeed (ZeRO 0-3, single process with gloo) and plain PyTorch give the same PPO updates,
and a skipped (NaN/inf) update leaves no trace in either."""

import json

import pytest
import torch

from ppo_helpers import FAST, params, write_advantages
from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.ppo import minibatches as batch, actor_critic as models, stage, update

ENGINES = {
    "torch": {"engine.backend": "torch"},
    "zero0": {"engine.backend": "deepspeed", "engine.zero_stage": 0},
    "zero1": {"engine.backend": "deepspeed", "engine.zero_stage": 1},
    "zero2": {"engine.backend": "deepspeed", "engine.zero_stage": 2},
    "zero3": {"engine.backend": "deepspeed", "engine.zero_stage": 3},
    "zero2-offload": {"engine.backend": "deepspeed", "engine.zero_stage": 2, "engine.offload_optimizer": True},
}
RUN = dict(epochs=1, minibatch_size=4, micro_batch_size=2, train_critic=True, entropy_coef=0.01)


def _run(sft_policy, adv, out, engine):
    stage.run(config.load(stage.Config, overrides={**FAST, **ENGINES[engine], "policy": str(sft_policy),
                                                   "input": str(adv), "output": str(out), **RUN}))
    hist = [json.loads(line) for line in (out / "updates.jsonl").read_text().splitlines()]
    return params(out / "policy"), params(out / "critic"), hist


@pytest.fixture(scope="module")
def torch_reference(sft_policy, rows16, tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo-backends")
    adv = write_advantages(root / "adv", rows16[:8], lambda i, t: (-1) ** i * (1 + t % 3), returns=0.5, values=0.0)
    return adv, _run(sft_policy, adv, root / "torch", "torch")


@pytest.mark.parametrize("engine", [
    "zero0", "zero1", "zero2", "zero3",
    "zero2-offload",  # needs zero_force_ds_cpu_optimizer=false in training/engine.py (set)
])
def test_deepspeed_matches_torch(sft_policy, torch_reference, tmp_path, engine):
    adv, (policy, critic, hist) = torch_reference
    got_policy, got_critic, got_hist = _run(sft_policy, adv, tmp_path / engine, engine)
    for ref, h in zip(hist, got_hist):  # same losses and the same gradient norms, update by update
        for key in ("policy_loss", "value_loss", "entropy", "grad_norm", "critic_grad_norm"):
            assert h[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    # Adam's first steps are about lr * sign(grad), so float noise in a ~0 gradient shows up as a
    # small fraction of lr on a few elements; anything systematic would move many by ~lr
    for ref, got in ((policy, got_policy), (critic, got_critic)):
        for k in ref:
            assert torch.allclose(ref[k], got[k], atol=1e-4), k


def _samples(rows, bad_rows=()):
    out = []
    for i, r in enumerate(rows):
        s = dict(r, advantages=[(-1.0) ** i] * len(r["response_ids"]), returns=None, values=None)
        if i in bad_rows:  # exp(logp - old) overflows; with A < 0 the loss is inf
            s.update(old_logprobs=[-1e30] * len(r["response_ids"]), advantages=[-1.0] * len(r["response_ids"]))
        out.append(batch.Sample.of(s))
    return out


@pytest.mark.parametrize("engine", ["torch", "zero0", "zero2", "zero3"])
def test_skipped_update_leaves_no_trace(sft_policy, rows16, engine):
    cfg = config.load(stage.Config, overrides={**FAST, **ENGINES[engine], "minibatch_size": 4, "micro_batch_size": 2})
    samples = _samples(rows16[:8], bad_rows={7})
    pad = 0

    def train(skip_first: bool):
        model, _ = modeling.load_causal_lm(sft_policy)
        models.disable_dropout(model)
        actor = models.make_engine(model, cfg, cfg.optim.lr, 10, 0, cfg.micro_batch_size)
        updater = update.Updater(cfg, actor, None, max_len=64)
        good = [batch.collate(samples, rows, pad) for rows in ([0, 1], [2, 3])]
        bad = [batch.collate(samples, rows, pad) for rows in ([4, 5], [6, 7])]  # bad row in the 2nd micro-batch
        if skip_first:
            assert updater.update(bad, train_actor=True) is None
        stats = [updater.update(good, train_actor=True) for _ in range(2)]  # two steps: Adam state matters too
        with actor.gathered():
            return {n: p.detach().clone() for n, p in actor.module.named_parameters()}, stats

    with_skip, stats_a = train(True)
    without, stats_b = train(False)
    for a, b in zip(stats_a, stats_b):
        assert ("grad_norm" in a) == ("grad_norm" in b)
        assert a.get("grad_norm", 0) == pytest.approx(b.get("grad_norm", 0), rel=1e-6)
    for k in without:
        assert torch.allclose(with_skip[k], without[k], atol=1e-7, rtol=0), k
