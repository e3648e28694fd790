"""`text_sampling.differs`: when a running vLLM engine may sample another checkpoint by reading its weights
(evaluate's baseline after its policy), and when it needs an engine of its own."""

from __future__ import annotations

import json

import pytest

from prmflow.components.models import modeling
from prmflow.components.sampling.text_sampling import differs


@pytest.fixture
def policy(tmp_path):
    model, tok = modeling.load_causal_lm("tiny-llama-tools", seed=0)
    modeling.save_pretrained(model, tok, tmp_path / "a")
    return tmp_path / "a"


def saved(tmp_path, name, seed=1, edit=None, model_name="tiny-llama-tools"):
    model, tok = modeling.load_causal_lm(model_name, seed=seed)
    modeling.save_pretrained(model, tok, tmp_path / name)
    if edit:
        edit(tmp_path / name)
    return str(tmp_path / name)


def test_other_weights_of_the_same_model_are_read_into_the_running_engine(policy, tmp_path):
    other = saved(tmp_path, "b", seed=1)  # other random weights, everything else the same
    assert differs(str(policy), other) == ""
    # the dtype the weights were saved in is not the engine's (it was started with its own)
    def to_bf16(path):
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert differs(str(policy), saved(tmp_path, "c", edit=to_bf16)) == ""


def test_another_model_config_template_or_vocabulary_needs_its_own_engine(policy, tmp_path):
    def wider(path):
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1024}))
    assert "max_position_embeddings" in differs(str(policy), saved(tmp_path, "b", edit=wider))

    def template(path):
        (path / "chat_template.jinja").write_text((path / "chat_template.jinja").read_text() + " ")
    assert differs(str(policy), saved(tmp_path, "c", edit=template)) == "its chat template differs"
    # another family of tiny model: its config differs first
    assert differs(str(policy), saved(tmp_path, "d", model_name="tiny-qwen2")).startswith("its model config differs")
    assert differs(str(policy), "no/such/dir").startswith("no config.json to compare")
