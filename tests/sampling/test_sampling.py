"""The shared `sampling` section: its checks name the key, and top_k reaches generation in every stage
that samples through generate_texts (evaluate, prm-label, best-of-N), as it does in rollout."""

import pytest

from prmflow.components.models import modeling
from prmflow.errors import ConfigError
from prmflow.components.sampling.generation import generate_texts
from prmflow.components.sampling.config import SamplingConfig


@pytest.mark.parametrize("kw,key", [({"temperature": -1.0}, "sampling.temperature"), ({"top_p": 0.0}, "sampling.top_p"),
                                    ({"top_k": -1}, "sampling.top_k"), ({"max_new_tokens": 0}, "sampling.max_new_tokens")])
def test_a_bad_value_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        SamplingConfig(**kw)


def test_top_k_one_samples_the_greedy_response():
    model, tok = modeling.build_tiny_model("tiny-llama", seed=0)
    prompts = ["1+2=", "3*4=", "7-5="]
    greedy = generate_texts(model, tok, prompts, 12)
    top1 = generate_texts(model, tok, prompts, 12, do_sample=True, temperature=1.0, top_k=1, seed=3)
    assert top1 == greedy
    free = generate_texts(model, tok, prompts, 12, do_sample=True, temperature=1.0, top_k=0, seed=3)
    assert free != greedy  # an untrained model's own distribution is nearly flat: top_k=0 is no cut


def test_a_progress_label_shows_a_bar_over_the_responses(capsys):
    model, tok = modeling.build_tiny_model("tiny-llama", seed=0)
    prompts = [f"{a}+{a}=" for a in range(10)]
    capsys.readouterr()
    quiet = generate_texts(model, tok, prompts, 4, batch_size=4)
    assert "10/10" not in capsys.readouterr().err
    shown = generate_texts(model, tok, prompts, 4, batch_size=4, progress="prm: sampling the policy")
    err = capsys.readouterr().err
    assert "prm: sampling the policy" in err and "10/10" in err, err  # every response counted, over 3 batches
    assert shown == quiet
