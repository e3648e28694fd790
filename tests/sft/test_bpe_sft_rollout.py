"""SFT -> rollout -> PPO batch -> evaluation with the `tiny-qwen2-bpe` preset (Qwen2.5 conventions):
prompts go through the chat template, SFT teaches `<|im_end|>` to end a response, sampling stops
there (finish_reason "stop", "length" otherwise), `<|endoftext|>` only pads and is never trained on."""

from __future__ import annotations

import pytest
import torch

from prmflow.components import config
from prmflow.components.models import modeling
from prmflow.components.data import schema
from prmflow.components.models.bpe_tokenizer import DEFAULT_SYSTEM
from prmflow.components.sampling.generation import generate_texts
from prmflow.components.ppo.minibatches import Sample, collate
from prmflow.components.rollout import response_scores as scoring, stage as rollout
from sft_cache import cached_sft

pytestmark = pytest.mark.slow  # one short SFT (cached), one rollout

BPE_POLICY = {"policy": "tiny-qwen2-bpe", "max_steps": 150, "eval_every": 150, "save_every": 0, "num_prompts": 3000,
              "eval_size": 20, "engine.backend": "torch", "tracking.enabled": False}
MAX_NEW = 40


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    policy = cached_sft("bpe-sft-policy", BPE_POLICY)
    out = tmp_path_factory.mktemp("bpe-rollout") / "iter0"
    cfg = config.load(rollout.Config, overrides={"policy": str(policy), "output": str(out), "num_prompts": 12,
                                                 "n_samples": 2, "sampling.max_new_tokens": MAX_NEW,
                                                 "tracking.enabled": False})
    rollout.run(cfg)
    return policy, schema.read_dataset(out, "rollouts").to_pylist()


def test_responses_end_at_im_end_and_pad_is_never_sampled(bpe_run):
    policy, rows = bpe_run
    tok = modeling.load_tokenizer(policy)
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad_token_id == pad != tok.eos_token_id == im_end
    for r in rows:
        assert r["prompt"].startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nCompute")
        assert r["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert r["prompt_ids"] == tok(r["prompt"])["input_ids"]
        ids = r["response_ids"]
        assert pad not in ids
        if r["finish_reason"] == "stop":
            assert ids[-1] == im_end and im_end not in ids[:-1]
        else:
            assert r["finish_reason"] == "length" and len(ids) == MAX_NEW and im_end not in ids
        assert r["response"] == tok.decode(ids, skip_special_tokens=True) and "<|" not in r["response"]
        _, ends = scoring.step_ends(tok, ids)
        assert r["step_ends"] == ends
    assert sum(r["finish_reason"] == "stop" for r in rows) >= len(rows) // 2  # SFT taught the end of a turn


def test_ppo_trains_on_im_end_and_never_on_pad(bpe_run):
    """The PPO micro-batch's mask selects exactly each row's response_ids, <|im_end|> included."""
    policy, rows = bpe_run
    tok = modeling.load_tokenizer(policy)
    samples = [Sample.of({**r, "advantages": [0.0] * len(r["response_ids"])}) for r in rows]
    mb = collate(samples, list(range(len(rows))), tok.pad_token_id, fields=())
    for b, r in enumerate(rows):
        assert mb.response_ids[b][mb.mask[b]].tolist() == r["response_ids"]
        assert (mb.response_ids[b][~mb.mask[b]] == tok.pad_token_id).all()
    stopped = [b for b, r in enumerate(rows) if r["finish_reason"] == "stop"]
    assert all(mb.mask[b, len(rows[b]["response_ids"]) - 1] for b in stopped)  # the end-of-turn token is trained on
    assert mb.mask.sum() == sum(len(r["response_ids"]) for r in rows)


def test_evaluation_stops_where_the_rollout_engine_stops(bpe_run):
    """Greedy evaluation text (generate_texts) = the HF engine's greedy sample, cut at <|im_end|>."""
    from prmflow.components.sampling.engines import HFEngine, SamplingParams

    policy, rows = bpe_run
    model, tok = modeling.load_causal_lm(policy)
    prompts = sorted({r["prompt"] for r in rows})[:6]
    texts = generate_texts(model, tok, prompts, max_new_tokens=MAX_NEW, add_special_tokens=False)
    engine = HFEngine(model, tok, batch_size=8)
    done = engine.generate([tok(p)["input_ids"] for p in prompts], SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    for text, (c,) in zip(texts, done):
        assert text == tok.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id
    assert any(c.finish_reason == "stop" for (c,) in done)
    with torch.no_grad():  # the policy puts <|im_end|>, not <|endoftext|>, after a finished solution
        ids = torch.tensor([tok(prompts[0] + texts[0])["input_ids"]])
        nxt = model(ids).logits[0, -1]
    assert nxt[tok.eos_token_id] > nxt[tok.pad_token_id]
