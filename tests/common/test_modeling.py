import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prmflow.components.common import modeling
from prmflow.components.common.errors import ModelLoadError


def test_tokenizer_is_character_level_and_round_trips(tmp_path):
    tok = modeling.build_tokenizer()
    text = "Compute left to right: 7+5*3\n7+5=12\n\n\nanswer: 36"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == text
    assert (again.pad_token, again.eos_token) == ("<pad>", "</s>")


@pytest.mark.parametrize("preset", sorted(modeling.TINY_PRESETS))
def test_tiny_model_saves_and_reloads_as_plain_hf(tmp_path, preset):
    model, tok = modeling.build_tiny_model(preset, seed=3)
    modeling.save_pretrained(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.tensor([tok("12+3=15", add_special_tokens=False)["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.config.model_type == modeling.TINY_PRESETS[preset]["model_type"]


def test_same_seed_same_weights():
    a, _ = modeling.build_tiny_model("tiny-llama", seed=5)
    b, _ = modeling.build_tiny_model("tiny-llama", seed=5)
    c, _ = modeling.build_tiny_model("tiny-llama", seed=6)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        modeling.load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="is not a model directory: it has no config.json"):
        modeling.load_causal_lm(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="Cannot load"):
        modeling.load_causal_lm(tmp_path / "broken")
    with pytest.raises(ModelLoadError, match="Unknown tiny model preset"):
        modeling.build_tiny_model("tiny-gpt9")
