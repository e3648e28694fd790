"""`prmflow pipeline compare` config handling: variants are merged over the base and checked up front."""

import pytest
import yaml

from prmflow import cli
from prmflow.errors import ConfigError
from prmflow.pipelines.compare import load_variants

from .test_compile_submit import IMAGES, STORAGE


def write(tmp_path, data) -> str:
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_variants_are_laid_over_the_base_without_touching_it(tmp_path):
    base = {"pipeline": {"iterations": 3}, "advantage": {"estimator": "grpo", "gamma": 0.9},
            "ppo": {"lr": 1e-4}}
    path = write(tmp_path, {**base, "variants": {"a": {"advantage": {"estimator": "rloo"}},
                                                 "b": {"pipeline": {"iterations": 1}, "ppo": {"epochs": 3}}}})
    data, variants = load_variants(path)
    assert data == base
    assert variants["a"]["advantage"] == {"estimator": "rloo", "gamma": 0.9}
    assert variants["b"]["pipeline"] == {"iterations": 1} and variants["b"]["ppo"] == {"lr": 1e-4, "epochs": 3}
    assert variants["b"]["advantage"] == base["advantage"]


@pytest.mark.parametrize("variants,match", [(None, "'variants' must map"), ({}, "'variants' must map"),
                                            ({"a": "grpo"}, "variant 'a' must be a mapping")])
def test_bad_variants_are_named(tmp_path, variants, match):
    with pytest.raises(ConfigError, match=match):
        load_variants(write(tmp_path, {"pipeline": {}, "variants": variants}))


def test_a_bad_key_in_any_variant_fails_before_anything_runs(tmp_path, capsys):
    path = write(tmp_path, {"variants": {"good": {"advantage": {"estimator": "grpo"}},
                                         "typo": {"ppo": {"learning_rate": 1e-4}}}})
    assert cli.main(["pipeline", "compare", "--config", path, "--root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "variant typo" in err and "learning_rate" in err
    assert not (tmp_path / "runs").exists()


def test_the_shipped_comparison_runs_the_quickstarts_budget():
    """configs/compare.yaml claims 'the quickstart's budget five ways': every stage section matches."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    quick = yaml.safe_load((root / "quickstart.yaml").read_text())
    base, variants = load_variants(str(root / "compare.yaml"))
    for section in ("sft", "prm", "rollout", "ppo", "evaluate"):
        assert base[section] == quick[section], section
    assert {k: v for k, v in base["pipeline"].items() if k != "experiment"} == \
        {k: v for k, v in quick["pipeline"].items() if k != "experiment"}
    for v in variants.values():  # only the advantage recipe differs
        assert {k: s for k, s in v.items() if k != "advantage"} == base


def test_the_vl_quickstart_compiles_with_images_in_every_stage(tmp_path):
    """configs/quickstart-vl.yaml is a valid pipeline whose stages all run the visual task on the VL preset."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    assert cli.main(["pipeline", "compile", "--config", str(root / "quickstart-vl.yaml"), "-o", str(tmp_path / "p.yaml"),
                     *IMAGES, *STORAGE]) == 0
    cfg = yaml.safe_load((root / "quickstart-vl.yaml").read_text())
    assert cfg["sft"]["policy"] == "tiny-llava"
    assert all(cfg[stage]["task"] == "visual" for stage in ("sft", "prm", "rollout", "evaluate"))
    assert cfg["prm"]["head"]["kind"] == "lm_tokens"  # a VL PRM reads the LM's own logits: it sees the image
    assert "tiny-llava" in (tmp_path / "p.yaml").read_text()
