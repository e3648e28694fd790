"""Fixtures for the rollout tests: scalar-head model directories (PRM, critic) built locally. The `vllm`
package (the real one where it and a GPU exist, else tests/fake_vllm.py) is tests/conftest.py's `vllm_module`."""

from __future__ import annotations

import random

import pytest
import torch

from prmflow.components.models import modeling


def make_scalar_dir(path, base=None, alphabet=None, seed=0, head_std=0.5):
    """A token-classification (num_labels=1) HF directory with a random, non-zero head.

    base: a causal-LM directory to take the backbone and tokenizer from (critic); None builds a tiny
    llama from its preset config with a character tokenizer over `alphabet` (a PRM with its own
    tokenizer). The head is random so scores differ from token to token: a test that reads the
    wrong position or feeds the wrong ids sees different numbers.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(seed)
    if base is not None:
        model, tok = modeling.load_scalar_model(base)
    else:
        tok = modeling.build_tokenizer(alphabet)
        spec = dict(modeling.TINY_PRESETS["tiny-llama"])
        cfg = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, num_labels=1, **spec)
        model = AutoModelForTokenClassification.from_config(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0.0, head_std)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def scalar_dir():
    """`make_scalar_dir` for tests that build their own scalar-head directory."""
    return make_scalar_dir


@pytest.fixture(scope="session")
def shuffled_prm(tmp_path_factory):
    """A PRM directory whose character tokenizer numbers the characters differently from the policy's."""
    alphabet = list(modeling.ALPHABET)
    random.Random(7).shuffle(alphabet)
    assert alphabet != modeling.ALPHABET
    return make_scalar_dir(tmp_path_factory.mktemp("prm") / "prm", alphabet=alphabet, seed=1)


@pytest.fixture(scope="session")
def random_critic(tmp_path_factory, sft_policy):
    """A critic directory: the SFT policy's backbone and tokenizer with a random value head."""
    return make_scalar_dir(tmp_path_factory.mktemp("critic") / "critic", base=sft_policy, seed=2, head_std=0.1)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run the rollout tests on one intra-op thread: the tiny model's small batches gain nothing from
    more, and on a shared 2-core machine a second spinning thread made them over 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
