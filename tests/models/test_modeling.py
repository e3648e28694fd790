import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prmflow.components.models import modeling
from prmflow.errors import ModelLoadError


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


def test_saving_a_model_trained_without_deepspeed_does_not_import_deepspeed(tmp_path):
    """transformers' save goes through accelerate, which imports DeepSpeed whenever it is installed
    (1-2.5 s on a CPU, and a 'Setting accelerator to CPU' warning in every stage's output)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from prmflow.components.models import modeling\n"
        "m, t = modeling.load_causal_lm('tiny-llama', seed=2)\n"
        f"modeling.save_pretrained(m, t, {str(tmp_path / 'm')!r})\n"
        "print('deepspeed imported:', 'deepspeed' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "deepspeed imported: False" in out.stdout
    assert "accelerator" not in out.stderr and "Writing model shards" not in out.stderr
    model, _ = modeling.load_causal_lm("tiny-llama", seed=2)
    loaded, _ = modeling.load_causal_lm(tmp_path / "m")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_scalar_model_from_a_causal_lm_loads_quietly_unless_more_than_its_head_is_missing(tmp_path, capsys,
                                                                                             transformers_log):
    from safetensors.torch import load_file, save_file

    model, tok = modeling.build_tiny_model("tiny-llama", seed=1)
    modeling.save_pretrained(model, tok, tmp_path / "lm")
    capsys.readouterr()
    scalar, _ = modeling.load_scalar_model(tmp_path / "lm")
    assert float(scalar.score.weight.abs().sum()) == 0.0
    assert not [m for m in transformers_log if "LOAD REPORT" in m]  # the new head is expected: no report
    assert "Loading weights" not in capsys.readouterr().err  # nor transformers' own progress bar
    # a checkpoint that lacks one of the backbone's weights: transformers' report is shown, naming it
    weights = load_file(tmp_path / "lm" / "model.safetensors")
    del weights[next(k for k in weights if "layers.1.mlp.up_proj" in k)]
    save_file(weights, tmp_path / "lm" / "model.safetensors", metadata={"format": "pt"})
    modeling.load_scalar_model(tmp_path / "lm")
    reports = [m for m in transformers_log if "LOAD REPORT" in m]
    assert len(reports) == 1 and "layers.1.mlp.up_proj" in reports[0], transformers_log
