"""PRIME's implicit PRM (head.kind=implicit): the step score is sigmoid(beta x the response's log-likelihood
ratio so far) against a direct computation, a PRM started from a policy scores 0.5 everywhere, and
prm-update starts one from a policy and learns the policy's failures from outcomes alone."""

from __future__ import annotations

import json

import pytest
import torch

from prmflow.components import config
from prmflow.components.data import io
from prmflow.components.models import modeling
from prmflow.components.models.prm_model import PRM, HeadConfig, saved_head
from prmflow.components.scoring.prm_scoring import load_scorer
from prmflow.components.prm import online_update as update
from prmflow.errors import ConfigError, ModelLoadError

from test_prm_update import scorer_auc, write_rollouts

PAIRS = [("2+3*4=?", "3*4=12\n2+12=14\nanswer: 14"), ("7-1=?", "7-1=6\nanswer: 6"),
         ("(5+5)*2=?", "5+5=10\n10*2=20\n20\nanswer: 20")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny causal-LM policy written as a finished prmflow output (what an sft stage leaves)."""
    out = tmp_path_factory.mktemp("policy") / "policy"
    model, tok = modeling.build_tiny_model("tiny-llama", seed=0)
    with io.atomic_output_dir(out, "sft") as tmp:
        modeling.save_pretrained(model, tok, tmp)
    return out


def implicit_dir(path, policy, beta: float, noise: float):
    """An implicit PRM on disk: the policy with its weights moved by `noise`, the policy as the reference."""
    prm = PRM.load(str(policy), HeadConfig("implicit", beta=beta))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in prm.model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    with io.atomic_output_dir(path, "prm") as tmp:
        prm.save(tmp, "\n", False)
    return path


def direct_scores(path, policy, beta, prompt, response):
    """sigmoid(beta * sum over response tokens up to each step's last token of log p / p_ref), one row alone,
    from plain log_softmax of each model's logits (no batching, padding or shared helper)."""
    model, tok = modeling.load_causal_lm(path)
    ref, _ = modeling.load_causal_lm(policy)
    p_ids = tok(prompt)["input_ids"]  # BOS + prompt, as the scorer reads a plain prompt
    enc = tok(response, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([p_ids + enc["input_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0], -1)
        lp_ref = torch.log_softmax(ref(ids).logits[0], -1)
    ratio = [float(lp[j - 1, ids[0, j]] - lp_ref[j - 1, ids[0, j]]) for j in range(len(p_ids), ids.shape[1])]
    out, start = [], 0
    for step in response.split("\n"):  # the step's last token: the last one starting before its end
        end_char = start + len(step)
        last = max(k for k, (a, _) in enumerate(enc["offset_mapping"]) if a < end_char)
        out.append(float(torch.sigmoid(torch.tensor(beta * sum(ratio[:last + 1])))))
        start = end_char + 1
    return out


def test_the_step_score_is_the_sigmoid_of_the_log_ratio_summed_over_the_response_so_far(tmp_path, policy):
    path = implicit_dir(tmp_path / "imp", policy, beta=0.5, noise=0.05)
    assert saved_head(path) == HeadConfig("implicit", beta=0.5)
    scores = load_scorer(path, device="cpu", batch_size=3).score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    for (prompt, response), got in zip(PAIRS, scores):
        want = direct_scores(path, policy, 0.5, prompt, response)
        assert got == pytest.approx(want, abs=1e-5)
        assert max(abs(x - 0.5) for x in want) > 0.02  # the perturbation moves the scores: the check has teeth


def test_a_prm_started_from_its_policy_scores_every_step_one_half(tmp_path, policy):
    path = implicit_dir(tmp_path / "imp", policy, beta=1.0, noise=0.0)
    scores = load_scorer(path, device="cpu").score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    assert [len(s) for s in scores] == [3, 2, 4]
    assert all(x == pytest.approx(0.5, abs=1e-6) for s in scores for x in s)


def test_a_saved_implicit_prm_without_its_reference_is_an_error(tmp_path, policy):
    path = implicit_dir(tmp_path / "imp", policy, beta=1.0, noise=0.0)
    for f in (path / "reference").iterdir():
        f.unlink()
    (path / "reference").rmdir()
    with pytest.raises(ModelLoadError, match="without its reference model"):
        PRM.load(path)


def test_prm_update_starts_an_implicit_prm_from_the_policy_and_learns_its_failures(tmp_path, policy):
    write_rollouts(tmp_path / "rollouts", 24)  # failures are the responses with a wrong line '1+1=0'
    cfg = config.load(update.Config, overrides={
        "prm": str(policy), "implicit_beta": 0.5, "input": str(tmp_path / "rollouts"), "output": str(tmp_path / "new"),
        "max_steps": 30, "micro_batch_size": 8, "train_layers": 0, "optim.lr": 2e-3, "held_out": 0.25,
        "tracking.enabled": False})
    metrics = update.run(cfg)
    assert metrics["eval/before_step_auc"] == pytest.approx(0.5)  # the policy's own copy: no evidence yet
    assert metrics["eval/step_auc"] > 0.8
    meta = json.loads((tmp_path / "new" / "prmflow.json").read_text())
    assert meta["prm_head"]["kind"] == "implicit" and meta["prm_head"]["beta"] == 0.5
    # the reference is the policy, unchanged; the trained model moved
    ref, _ = modeling.load_causal_lm(tmp_path / "new" / "reference")
    pol, _ = modeling.load_causal_lm(policy)
    new, _ = modeling.load_causal_lm(tmp_path / "new")
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pol.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), pol.state_dict().values()))
    # the rollout stage's scorer reads the written PRM as the update evaluated it
    assert scorer_auc(tmp_path / "new", tmp_path / "rollouts", 0.25) == pytest.approx(metrics["eval/step_auc"], abs=1e-4)
    # a second update warm-starts from the written implicit PRM (its head and reference kept)
    cfg2 = config.load(update.Config, overrides={**config.to_dict(cfg), "prm": str(tmp_path / "new"),
                                                 "output": str(tmp_path / "next"), "iteration": 1, "implicit_beta": 0.0})
    assert update.run(cfg2)["eval/before_step_auc"] == pytest.approx(metrics["eval/step_auc"], abs=0.1)
    # the frozen reference is not written again: the next PRM's reference files are the same bytes on disk
    first, second = tmp_path / "new" / "reference", tmp_path / "next" / "reference"
    assert sorted(f.name for f in second.iterdir()) == sorted(f.name for f in first.iterdir())
    assert all((second / f.name).stat().st_ino == f.stat().st_ino for f in first.iterdir())
    assert PRM.load(tmp_path / "next").reference_dir == second  # and the PRM reads it from its own directory


def test_a_policy_without_implicit_beta_is_refused(tmp_path, policy):
    write_rollouts(tmp_path / "rollouts", 4)
    cfg = config.load(update.Config, overrides={"prm": str(policy), "input": str(tmp_path / "rollouts"),
                                                "output": str(tmp_path / "new"), "tracking.enabled": False})
    with pytest.raises(ConfigError, match="set implicit_beta"):
        update.run(cfg)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="head.beta=0"):
        HeadConfig("implicit", beta=0.0)


def test_the_prm_stage_trains_an_implicit_prm_on_step_labels(tmp_path, policy):
    """`prmflow prm --head.kind implicit`: the prm stage's BCE on step labels trains the LM; the output carries
    the untouched backbone as its reference and scores with the rollout stage's scorer as it evaluated."""
    from prmflow.components.prm import stage

    from test_prm_update import SHORT

    cfg = config.load(stage.Config, overrides={**SHORT, "backbone": str(policy), "head.kind": "implicit",
                                               "head.beta": 0.5, "output": str(tmp_path / "prm")})
    metrics = stage.run(cfg)
    assert saved_head(tmp_path / "prm") == HeadConfig("implicit", beta=0.5)
    ref, _ = modeling.load_causal_lm(tmp_path / "prm" / "reference")
    pol, _ = modeling.load_causal_lm(policy)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pol.state_dict().values()))
    scores = load_scorer(tmp_path / "prm", device="cpu").score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    assert any(abs(x - 0.5) > 1e-3 for s in scores for x in s)
    assert 0 <= metrics["eval/step_auc"] <= 1


def test_outputs_written_before_the_implicit_keys_existed_still_count_as_finished(tmp_path, policy):
    """head.beta (prm) and implicit_beta (prm-update) read nothing for the other heads, so they are left out of
    the recorded config: a finished output written before they existed (its manifest without them) is still
    this config's result, not a 'different config' refusal."""
    from prmflow.components.prm import stage

    from test_prm_update import SHORT

    cfg = config.load(stage.Config, overrides={**SHORT, "output": str(tmp_path / "prm")})
    stage.run(cfg)
    write_rollouts(tmp_path / "rollouts", 8)
    ucfg = config.load(update.Config, overrides={"prm": str(tmp_path / "prm"), "input": str(tmp_path / "rollouts"),
                                                 "output": str(tmp_path / "new"), "max_steps": 2, "micro_batch_size": 8,
                                                 "tracking.enabled": False})
    metrics = update.run(ucfg)
    prm_config = json.loads((tmp_path / "prm" / "manifest.json").read_text())["config"]
    update_config = json.loads((tmp_path / "new" / "manifest.json").read_text())["config"]
    assert set(prm_config["head"]) == {"kind", "good_token", "bad_token", "step_tag"}  # the keys before beta
    assert "implicit_beta" not in update_config
    weights = (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns
    stage.run(cfg)  # finished: nothing retrained
    assert (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns == weights
    assert update.run(ucfg) == metrics
    # an implicit head records its beta: two betas are two results
    icfg = config.load(stage.Config, overrides={**SHORT, "backbone": str(policy), "head.kind": "implicit",
                                                "output": str(tmp_path / "imp")})
    from prmflow.components.prm.config import training_identity

    assert training_identity(icfg)["head"]["beta"] == 0.05
