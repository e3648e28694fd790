from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from prmflow.components.common import config
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


# --- renamed keys -----------------------------------------------------------------------------------

@dataclass
class Sampling:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature."""
    renamed: ClassVar[dict[str, str]] = {"temp": "temperature"}  # a section's own renames, relative to it


@dataclass
class Renamed:
    policy: str = ""
    """The policy directory."""
    sampling: Sampling = field(default_factory=Sampling)
    """How to sample."""
    renamed: ClassVar[dict[str, str]] = {"policy_path": "policy", "n_samples": "sampling.n", "gen": "sampling"}


def _cli(argv: list[str], path=None) -> Renamed:
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, Renamed)
    return config.from_args(Renamed, parser.parse_args((["--config", str(path)] if path else []) + argv))


def _yaml(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("make,old,new", [
    (lambda tmp: config.build(Renamed, {"policy_path": "/p", "n_samples": 4, "sampling.temp": 0.5}), "policy_path", "policy"),
    (lambda tmp: config.build(Renamed, {"policy_path": "/p", "gen": {"n": 4}, "sampling": {"temp": 0.5}}), "gen", "sampling"),
    (lambda tmp: config.load(Renamed, _yaml(tmp, "policy_path: /p\nn_samples: 4\nsampling:\n  temp: 0.5\n")), "n_samples", "sampling.n"),
    (lambda tmp: config.load(Renamed, _yaml(tmp, "policy: /p\ngen:\n  n: 4\n  temp: 0.5\n")), "gen", "sampling"),
    (lambda tmp: config.load(Renamed, overrides={"policy_path": "/p", "gen.n": 4, "sampling.temp": "0.5"}), "gen", "sampling"),
    (lambda tmp: _cli(["--set", "policy_path=/p", "--n_samples", "4", "--sampling.temp", "0.5"]), "sampling.temp", "sampling.temperature"),
    (lambda tmp: _cli(["--policy_path", "/p", "--gen.n", "4", "--gen.temp", "0.5"]), "policy_path", "policy"),
])
def test_old_keys_load_as_the_new_ones_with_a_deprecation_warning(tmp_path, caplog, make, old, new):
    with pytest.warns(FutureWarning) as warned:
        cfg = make(tmp_path)
    assert (cfg.policy, cfg.sampling.n, cfg.sampling.temperature) == ("/p", 4, 0.5)
    messages = [str(w.message) for w in warned]
    assert [m for m in messages if f"'{old}' is deprecated, use '{new}' instead" in m and "next release" in m], messages
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("prmflow") and r.levelname == "WARNING"]
    assert [m for m in logged if f"'{old}' is deprecated, use '{new}'" in m], logged


def test_new_keys_load_without_a_warning(recwarn):
    cfg = config.build(Renamed, {"policy": "/p", "sampling": {"n": 4}})
    assert (cfg.policy, cfg.sampling.n) == ("/p", 4)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("values,old,new", [
    ({"policy_path": "/a", "policy": "/b"}, "policy_path", "policy"),
    ({"n_samples": 2, "sampling": {"n": 3}}, "n_samples", "sampling.n"),
    ({"n_samples": 2, "sampling.n": 3}, "n_samples", "sampling.n"),
    ({"gen": {"n": 2}, "sampling": {"n": 3}}, "gen.n", "sampling.n"),
    ({"sampling": {"temp": 0.5, "temperature": 0.7}}, "sampling.temp", "sampling.temperature"),
])
def test_an_old_key_with_its_new_one_is_an_error_naming_both(values, old, new):
    with pytest.raises(ConfigError) as e:
        config.build(Renamed, values, where="my.yaml")
    assert f"both '{old}' and '{new}' are set" in str(e.value) and str(e.value).startswith("my.yaml")


def test_an_old_and_a_new_key_for_different_settings_combine(tmp_path):
    with pytest.warns(FutureWarning):
        cfg = config.build(Renamed, {"gen": {"n": 2}, "sampling": {"temperature": 0.5}})
    assert (cfg.sampling.n, cfg.sampling.temperature) == (2, 0.5)
    with pytest.warns(FutureWarning):  # the command line still overrides the file, whichever name each uses
        assert _cli(["--policy_path", "/cli"], _yaml(tmp_path, "policy: /file\n")).policy == "/cli"
    with pytest.raises(ConfigError, match="both 'policy_path' and 'policy' are set"):
        _cli(["--policy_path", "/a", "--policy", "/b"])


def test_old_flags_are_hidden_from_help():
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, Renamed)
    text = parser.format_help()
    assert "--policy " in text and "--sampling.temperature" in text
    assert not any(f"--{old}" in text for old in ("policy_path", "n_samples", "gen.n", "sampling.temp "))


def test_a_mapping_to_a_key_that_does_not_exist_fails_where_it_is_declared():
    @dataclass
    class Typo:
        policy: str = ""
        """The policy."""
        renamed: ClassVar[dict[str, str]] = {"policy_path": "polcy"}

    @dataclass
    class Stale:
        policy: str = ""
        """The policy."""
        renamed: ClassVar[dict[str, str]] = {"policy": "policy"}

    with pytest.raises(TypeError, match="maps 'policy_path' to 'polcy', which is not a key of Typo"):
        config.build(Typo, {})
    with pytest.raises(TypeError, match="maps 'policy', which is still a key of Stale"):
        config.build(Stale, {})


def test_every_stage_renames_only_to_keys_it_has():
    from prmflow import stages

    for name, module in stages.available().items():
        for old, new in config.renamed_keys(module.Config).items():
            assert old not in config.flat_fields(module.Config), (name, old)


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


def test_a_near_miss_of_an_old_key_suggests_its_new_name():
    @dataclass
    class Moved:
        optim: Inner = field(default_factory=Inner)
        """The section the old key moved into."""
        renamed: ClassVar[dict[str, str]] = {"depth": "optim.depth"}

    with pytest.raises(ConfigError, match="'dpeth' is not a config key. Did you mean 'optim.depth'?"):
        config.build(Moved, {"dpeth": 3})
