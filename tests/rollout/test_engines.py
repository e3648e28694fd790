"""Generation engines: one interface test suite that the HF engine and the vLLM adapter pass; the adapter
runs the real vLLM where it and a GPU exist, else the CPU stand-in tests/fake_vllm.py."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from prmflow.components.models import modeling
from prmflow import tasks
from prmflow.components.sampling import engines
from prmflow.components.sampling.engines import HFEngine, SamplingParams
from prmflow.components.sampling.vllm_engine import VLLMEngine, VLLMSettings



@pytest.fixture(scope="module")
def policy(sft_policy):
    model, tok = modeling.load_causal_lm(sft_policy)
    return model.eval(), tok


@pytest.fixture(scope="module")
def prompts(policy):
    _, tok = policy
    return [tok(r.prompt)["input_ids"] for r in tasks.load("arithmetic", "eval", 6, seed=3)]


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, policy, sft_policy):
    model, tok = policy
    if request.param == "hf":
        yield HFEngine(model, tok, batch_size=8)
        return
    request.getfixturevalue("vllm_module")
    eng = VLLMEngine(str(sft_policy), dtype="float32", settings=VLLMSettings(gpu_memory_utilization=0.3, enforce_eager=True),
                     stop_ids=engines.eos_token_ids(model, tok))
    yield eng
    eng.close()


def reference_logprobs(model, prompt, response):
    """log p(response token t | prompt + response[:t]) from one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_greedy_matches_model_generate(engine, policy, prompts):
    """Greedy decoding gives model.generate's tokens, EOS kept as the last id with finish 'stop'."""
    model, tok = policy
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=48))
    for p, (c,) in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                             max_new_tokens=48, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert c.token_ids == ref
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 48 and tok.eos_token_id not in c.token_ids
    assert any(c.finish_reason == "stop" for (c,) in out)  # the SFT policy learned to end its answers


def test_behavior_logprobs_match_a_forward_pass(engine, policy, prompts):
    model, _ = policy
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=5))
    # float32 throughout: the HF engine's KV cache vs a full pass differ by summation order (2e-5); vLLM's kernels
    # (other GEMMs, Triton attention) also only by summation order once its attention dots are IEEE float32
    # (TRITON_F32_DEFAULT=ieee, vllm_engine.py), the bound the rollout stage's test uses. With TF32 attention a
    # likely token is still right to 1e-5 but an unlikely sampled one carries the whole logit error (> 2e-2).
    tol = 2e-5 if isinstance(engine, HFEngine) else 1e-4
    for p, group in zip(prompts, out):
        assert len(group) == 2
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            ref = reference_logprobs(model, p, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=tol), (c.logprobs, ref)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_behavior_logprobs_are_of_the_distribution_sampled(engine, policy, prompts, top_p):
    """At temperature 0.7 (and a top-p) each recorded log-prob is of softmax(filter(logits)), the distribution the
    token was drawn from: a plain forward's logits / 0.7, then top-p (`filter_logits`, transformers' warpers),
    log_softmax; vLLM in its processed_logprobs mode. Before, both engines recorded log_softmax(logits / 1)."""
    model, _ = policy
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, top_p=top_p, max_new_tokens=32, seed=5))
    tol = 2e-5 if isinstance(engine, HFEngine) else 1e-4  # as test_behavior_logprobs_match_a_forward_pass
    moved = 0.0
    for p, group in zip(prompts, out):
        for c in group:
            ids = torch.tensor([list(p) + list(c.token_ids)])
            with torch.no_grad():
                logits = model(ids).logits[0, len(p) - 1:-1].float()                  # (R, V)
            tok = ids[0, len(p):, None]
            ref = torch.log_softmax(engines.filter_logits(logits, 0.7, 0, top_p), -1).gather(-1, tok)[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=tol), (c.logprobs, ref)
            moved = max(moved, float((torch.log_softmax(logits, -1).gather(-1, tok)[:, 0] - ref).abs().max()))
    assert moved > 1e-2  # the raw distribution's log-probs are far from these: the check can tell them apart


def test_same_seed_same_samples_other_seed_differs(engine, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=11)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=12))
    ids = lambda out: [[s.token_ids for s in g] for g in out]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_max_new_tokens_and_ignore_eos(engine, prompts):
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=7, ignore_eos=True, seed=1))
    for group in out:
        for c in group:
            assert len(c.token_ids) == 7 and c.finish_reason == "length"


def test_vllm_engine_given_new_weights_samples_as_a_fresh_engine_would(vllm_module, policy, prompts, sft_policy, tmp_path):
    """`load_weights` (vLLM's reload_weights, then a prefix-cache reset) makes a running engine sample the next
    policy's tokens and log-probs as an engine started on it does: what a pod that samples several policies in
    turn relies on. On a GPU this runs the real engine (the stand-in's own test checks the calls it records)."""
    model, tok = policy
    other = tmp_path / "other"
    shifted = type(model)(model.config)
    shifted.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in shifted.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    modeling.save_pretrained(shifted, tok, other)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    settings = VLLMSettings(gpu_memory_utilization=0.25, enforce_eager=True)
    stop = engines.eos_token_ids(model, tok)
    eng = VLLMEngine(str(sft_policy), dtype="float32", settings=settings, stop_ids=stop)
    before = eng.generate(prompts, greedy)
    eng.load_weights(str(other))
    after = eng.generate(prompts, greedy)
    eng.close()
    fresh = VLLMEngine(str(other), dtype="float32", settings=settings, stop_ids=stop)
    ref = fresh.generate(prompts, greedy)
    fresh.close()
    ids = lambda out: [c.token_ids for (c,) in out]  # noqa: E731
    assert ids(after) == ids(ref) != ids(before)
    for a, r in zip(after, ref):  # the same kernels on the same batch: the bound of the log-prob checks above
        assert torch.allclose(torch.tensor(a[0].logprobs), torch.tensor(r[0].logprobs), atol=1e-4)


def test_stop_strings_end_the_sample_where_they_appear(engine, policy, prompts):
    """A stop string ends the response at the token that completes it; it stays in the text."""
    _, tok = policy
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop=["=", "er:"], seed=3))
    hits = 0
    for group in out:
        for c in group:
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            before = tok.decode(c.token_ids[:-1], skip_special_tokens=True)
            assert not any(s in before for s in ("=", "er:"))
            if c.finish_reason == "stop" and c.token_ids[-1] != tok.eos_token_id:
                assert text.endswith("=") or text.endswith("er:")
                hits += 1
    assert hits > 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.6)])
def test_filter_logits_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(16, 90, generator=torch.Generator().manual_seed(0)) * 3
    ours = engines.filter_logits(logits, temperature, top_k, top_p)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_hf_engine_samples_the_filtered_distribution(policy, prompts):
    """First-token frequencies of 3000 samples match softmax of the filtered logits (and nothing outside it)."""
    model, tok = policy
    prompt = prompts[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    # make the distribution wide enough to test: the tiny SFT policy is nearly deterministic at T=1
    temperature, top_k, top_p = 4.0, 6, 0.9
    expected = torch.softmax(engines.filter_logits(logits[None], temperature, top_k, top_p)[0], -1)
    out = HFEngine(model, tok, batch_size=3000).generate(
        [prompt], SamplingParams(n=3000, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=0))
    first = torch.tensor([c.token_ids[0] for c in out[0]])
    freq = torch.bincount(first, minlength=len(expected)).float() / len(first)
    assert (freq[expected == 0] == 0).all()
    assert (expected > 0).sum() >= 2
    assert torch.allclose(freq, expected, atol=0.03), (freq[expected > 0], expected[expected > 0])
    # and each sample's recorded logprob is of the filtered distribution it was drawn from, not the raw one
    assert torch.allclose(torch.tensor([c.logprobs[0] for c in out[0]]), expected.log()[first], atol=1e-5)


def test_hf_engine_batches_agree_with_one_prompt_at_a_time(policy, prompts):
    """Left padding, cache copies for n samples and dropping finished rows do not change greedy outputs."""
    model, tok = policy
    batched = HFEngine(model, tok, batch_size=12).generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=40))
    for p, group in zip(prompts, batched):
        (single,) = HFEngine(model, tok, batch_size=1).generate([p], SamplingParams(temperature=0, max_new_tokens=40))[0]
        assert [c.token_ids for c in group] == [single.token_ids] * 2


def test_hf_engine_passes_the_kv_cache_by_the_name_this_transformers_knows(policy, prompts, transformers_log):
    """transformers 5.x renamed `past_key_values` to `cache` and drops the old name in 5.40, which pyproject
    allows: the engine's cache loop must not lean on the deprecated name (argument or output field), or
    sampling stops working on an upgrade. A deprecated use warns (FutureWarning, or transformers' log once
    per process, hence the cleared once-cache)."""
    import warnings

    from transformers.utils import logging as hf_logging

    model, tok = policy
    hf_logging.warning_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = HFEngine(model, tok, batch_size=4).generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=8))
    assert [len(c.token_ids) for (c,) in out] and all(c.token_ids for (c,) in out)
    assert not [m for m in transformers_log if "deprecated" in m], transformers_log
