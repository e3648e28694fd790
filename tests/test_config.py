import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest

from prmflow import stages
from prmflow.components import config
from prmflow.errors import ConfigError


@dataclass
class Inner:
    depth: int = 2
    """How deep."""


@dataclass
class Cfg:
    lr: float = 1e-3
    """Learning rate."""
    name: str = "x"
    """A name."""
    flag: bool = False
    """A switch."""
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    tags: list[str] = field(default_factory=list)
    """Some tags."""
    inner: Inner = field(default_factory=Inner)
    """Nested."""

    def __post_init__(self):
        if self.lr > 1:
            raise ConfigError("lr must be at most 1")


def test_docstrings_are_the_help():
    assert config.field_docs(Cfg) == {"lr": "Learning rate.", "name": "A name.", "flag": "A switch.",
                                      "mode": "Which mode.", "tags": "Some tags.", "inner": "Nested."}
    assert "| `inner.depth` | int | `2` | How deep. |" in config.describe(Cfg)


@dataclass
class Outer:
    gpu: Inner = field(default_factory=lambda: Inner(depth=8))
    """A nested config whose field default differs from the class default."""


def test_nested_field_defaults_survive():
    assert config.build(Outer, {}).gpu.depth == 8
    assert config.load(Outer, overrides={"gpu.depth": 3}).gpu.depth == 3


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.5\ninner:\n  depth: 7\ntags: [p, q]\n")
    cfg = config.load(Cfg, p, {"flag": "true", "inner.depth": "9", "mode": "b"})
    assert (cfg.lr, cfg.flag, cfg.inner.depth, cfg.tags, cfg.mode) == (0.5, True, 9, ["p", "q"], "b")


def test_section_of_a_pipeline_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sft:\n  lr: 0.25\nprm:\n  lr: 0.1\n")
    assert config.load(Cfg, p, section="sft").lr == 0.25


@pytest.mark.parametrize("values,needle", [
    ({"lrr": 1}, "'lrr' is not a config key. Did you mean 'lr'?"),
    ({"inner.deep": 1}, "Did you mean 'inner.depth'?"),
    ({"lr": "fast"}, "key 'lr' must be float"),
    ({"inner.depth": 2.5}, "key 'inner.depth' must be an integer"),
    ({"flag": "maybe"}, "key 'flag' must be true or false"),
    ({"mode": "c"}, "not one of ['a', 'b']"),
    ({"lr": 3}, "lr must be at most 1"),
])
def test_bad_values_name_the_key(values, needle):
    with pytest.raises(ConfigError) as e:
        config.build(Cfg, values, where="my.yaml")
    assert needle in str(e.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("lr: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml' is not valid YAML"):
        config.load(Cfg, p)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(Cfg, tmp_path / "missing.yaml")


def test_cli_flags_and_set():
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, Cfg)
    args = parser.parse_args(["--lr", "0.01", "--set", "inner.depth=4", "--inner.depth", "5"])
    cfg = config.from_args(Cfg, args)
    assert cfg.lr == 0.01 and cfg.inner.depth == 5
    assert "Learning rate." in parser.format_help()


def test_lists_on_the_command_line_take_commas_or_yaml_brackets():
    from prmflow.components.sft import stage

    assert config.build(stage.Config, {"freeze": "model.a, model.b"}).freeze == ["model.a", "model.b"]
    assert config.build(stage.Config, {"freeze": "[model.a, model.b]"}).freeze == ["model.a", "model.b"]
    with pytest.raises(ConfigError, match="key 'freeze' is not a valid list"):
        config.build(stage.Config, {"freeze": "[model.a"})


def test_nested_section_mappings_are_the_same_as_dotted_keys():
    from prmflow.components.prm import stage

    nested = config.build(stage.Config, {"head": {"kind": "lm_tokens"}, "tracking": {"enabled": False}})
    dotted = config.build(stage.Config, {"head.kind": "lm_tokens", "tracking.enabled": False})
    assert nested == dotted and nested.head.kind == "lm_tokens" and not nested.tracking.enabled
    assert config.build(stage.Config, {"head": {"kind": "lm_tokens"}, "head.kind": "token_classification"}).head.kind \
        == "token_classification"  # an explicit dotted key wins over the section mapping
    with pytest.raises(ConfigError, match="'head.knd' is not a config key"):
        config.build(stage.Config, {"head": {"knd": "lm_tokens"}})


@dataclass
class Deep:
    inner: Inner = field(default_factory=lambda: Inner(depth=9))
    """A section whose owner sets its own default."""


@dataclass
class OwnDefaults:
    first: Inner = field(default_factory=lambda: Inner(depth=5))
    """Nested, with this config's default."""
    second: Inner = field(default_factory=Inner)
    """Nested, with the class default."""
    deep: Deep = field(default_factory=Deep)
    """Two levels down."""
    deeper: Deep = field(default_factory=lambda: Deep(inner=Inner(depth=7)))
    """Two levels down, overridden one level up."""


def test_a_section_shows_the_default_its_owner_gives_it():
    """A shared section (optim, sampling) whose owner sets its own defaults: flat_fields, --help and
    the README tables show the owner's default, the one build makes, not the section class's."""
    fields = config.flat_fields(OwnDefaults)
    shown = {k: d for k, (_, _, d) in fields.items()}
    assert shown == {"first.depth": 5, "second.depth": 2, "deep.inner.depth": 9, "deeper.inner.depth": 7}
    built = config.build(OwnDefaults, {})
    assert (built.first.depth, built.second.depth, built.deep.inner.depth, built.deeper.inner.depth) == (5, 2, 9, 7)
    assert "`5`" in config.describe(OwnDefaults).splitlines()[2]


def test_a_near_miss_of_a_key_inside_a_section_suggests_the_dotted_key():
    @dataclass
    class Sectioned:
        optim: Inner = field(default_factory=Inner)
        """A section."""

    with pytest.raises(ConfigError, match="'dpeth' is not a config key. Did you mean 'optim.depth'?"):
        config.build(Sectioned, {"dpeth": 3})
    with pytest.raises(ConfigError, match="'optim.dpeth' is not a config key. Did you mean 'optim.depth'?"):
        config.build(Sectioned, {"optim.dpeth": 3})


# --- one vocabulary across the stages ---------------------------------------------------------------

def test_flat_fields_show_each_stage_its_own_section_defaults():
    """One OptimConfig / SamplingConfig class, each stage's defaults (what build makes, --help and the READMEs show)."""
    from prmflow.components.training.optim import OptimConfig

    lrs = {}
    for name, module in stages.available().items():
        fields = config.flat_fields(module.Config)
        if "optim.lr" in fields:
            kw = {"rollout": {"policy": "/p"}, "evaluate": {"policy": "/p"}}.get(name, {})
            assert fields["optim.lr"][2] == config.build(module.Config, kw).optim.lr, name
            lrs[name] = fields["optim.lr"][2]
    assert lrs == {"sft": 3e-3, "prm": 1e-3, "prm-update": 3e-4, "ppo": 1e-4}
    assert OptimConfig().lr not in (3e-3, 1e-3)  # the class default is not what the stages show
    assert config.flat_fields(stages.available()["sft"].Config)["optim.lr_schedule"][2] == "cosine"


def test_constant_lr_schedule_everywhere():
    for name, module in stages.available().items():
        fields = config.flat_fields(module.Config)
        schedules = [k for k in fields if k.endswith("lr_schedule")]
        for key in schedules:
            assert "constant" in typing.get_args(fields[key][0]), (name, key)


def test_engine_is_always_the_training_backend():
    from prmflow.components.training.engine import EngineConfig

    for name, module in stages.available().items():
        for f in dataclasses.fields(module.Config):
            if f.name == "engine":
                assert typing.get_type_hints(module.Config)["engine"] is EngineConfig, name


@dataclass
class WithMapping:
    ppo: dict = field(default_factory=lambda: {"epochs": 2, "optim": {"lr": 1e-4, "warmup_steps": 4}})
    """Keys handed on to another stage."""


def test_dotted_keys_inside_a_mapping_field_are_laid_over_it_not_dropped():
    """`--set ppo.optim.lr=3e-5` on a dict-typed field (the benchmark's stage sections, rollout's vllm.extra)
    changes that one key and keeps the rest, from a file's mapping or the field's default; it was accepted and
    silently ignored before."""
    assert config.build(WithMapping, {"ppo.optim.lr": 3e-5}).ppo == {"epochs": 2, "optim": {"lr": 3e-5, "warmup_steps": 4}}
    # load() lays the command line over the file's config flattened: the override must beat the whole mapping
    # and the file's own dotted copy of the key it holds
    assert config.load(WithMapping, overrides={"ppo.optim.lr": 3e-5, "ppo.new.deep": 1}).ppo == {
        "epochs": 2, "optim": {"lr": 3e-5, "warmup_steps": 4}, "new": {"deep": 1}}
    assert config.build(WithMapping, {"ppo": {"epochs": 5}}).ppo == {"epochs": 5}  # a whole mapping still replaces
    # a key holding dots (a Kubernetes label) stays one key, from a file and from the command line
    sel = {"ppo": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}
    assert config.build(WithMapping, config.flatten(sel)).ppo == sel["ppo"]
    assert config.build(WithMapping, {**config.flatten(sel), "ppo.cloud.google.com/gke-accelerator": "h200"}).ppo == {
        "cloud.google.com/gke-accelerator": "h200"}
    # a mapping whose keys hold dots and map to mappings (the benchmark's variant `adversarial-ungated-w0.2`):
    # a file's flattened copy of its inner keys lands inside it, not under a key split at the dot
    variants = {"ppo": {"outcome-only": {"prm": ""}, "adversarial-w0.2": {"prm": "adversarial", "w": {"x": 0.2}}}}
    assert config.build(WithMapping, config.flatten(variants)).ppo == variants["ppo"]
    assert config.build(WithMapping, {**config.flatten(variants), "ppo.adversarial-w0.2.w.x": 0.3}).ppo == {
        "outcome-only": {"prm": ""}, "adversarial-w0.2": {"prm": "adversarial", "w": {"x": 0.3}}}
    from prmflow.components.rollout import stage

    cfg = config.load(stage.Config, overrides={"vllm.extra.load_format": "safetensors", "vllm.extra.quantization": "fp8"})
    assert cfg.vllm.extra == {"load_format": "safetensors", "quantization": "fp8"}


def test_the_config_files_loader_is_yaml_safe_loader_refusing_a_key_twice():
    """read_yaml's loader is yaml.SafeLoader with one constructor added (tests/reliability's static check reads
    its name only): no Python object is built from a config file, and a key written twice is an error."""
    import yaml

    loader = config.UniqueKeySafeLoader
    assert issubclass(loader, yaml.SafeLoader) and not issubclass(loader, (yaml.FullLoader, yaml.UnsafeLoader))
    with pytest.raises(yaml.constructor.ConstructorError, match="could not determine a constructor"):
        yaml.load("x: !!python/object/apply:os.system ['true']\n", Loader=loader)
    with pytest.raises(yaml.constructor.ConstructorError, match="key 'a' is written twice"):
        yaml.load("a: 1\nb: {c: 2}\na: 3\n", Loader=loader)
    assert yaml.load("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n", Loader=loader) == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}


def test_an_empty_value_of_an_optional_key_is_its_empty_default(tmp_path, capsys):
    """advantage's help says `--whiten` "Empty: reinforce_baseline only" and the key tables show its default as
    empty, but `--whiten ''` was refused ("must be true or false, got ''"), naming neither empty nor null.
    Empty (on the command line or in YAML) is now None, the help shows the default as empty, and a bad value
    says that empty is allowed."""
    from prmflow import cli
    from prmflow.components.advantage.config import Config

    cfg = tmp_path / "adv.yaml"
    cfg.write_text("advantage:\n  whiten: ''\n  outcome_reward:\n")
    assert config.load(Config, str(cfg), {"step_rewards": ""}, section="advantage").whiten is None
    loaded = config.load(Config, str(cfg), {"step_rewards": "", "whiten": "true"}, section="advantage")
    assert (loaded.whiten, loaded.outcome_reward, loaded.step_rewards) == (True, None, None)
    with pytest.raises(ConfigError, match=r"key 'whiten' must be true or false, got 'maybe', or empty \(null\)"):
        config.load(Config, None, {"whiten": "maybe"})
    with pytest.raises(SystemExit):
        cli.main(["advantage", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "Empty: reinforce_baseline only. (default: empty)" in shown and "(default: None)" not in shown
