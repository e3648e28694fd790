"""Every config key renamed in this release, in every stage: the old key still loads for one release,
warns naming the new key, and sets the new field; an output or resume checkpoint written under the
old names is still recognised as the same config."""

import dataclasses
import typing
import warnings

import pytest

from prmflow import stages
from prmflow.components.common import checkpoint, config, io

#: Settings a value needs to be valid (a Config's own checks), by (stage, old key).
NEEDS = {
    ("rollout", "engine"): {"policy": "/models/policy"},  # sampler=vllm refuses a tiny preset
    ("ppo", "critic_warmup_updates"): {"train_critic": True},
}


def _value(typ, default):
    """A value of type `typ` other than `default`, as YAML would give it."""
    if typing.get_origin(typ) is typing.Literal:
        return next(a for a in typing.get_args(typ) if a != default)
    if typ is bool:
        return not default
    if typ is int:
        return default + 1
    if typ is float:
        return default + 0.5
    if typ is str:
        return "/renamed/value"
    raise AssertionError(f"no test value for {typ}")


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


#: Every key renamed in this release, by stage: old -> new (the issue's "one vocabulary" list).
RENAMED = {
    "sft": {"model_path": "policy", "train_size": "num_prompts"},
    "prm": {"model_path": "backbone", "train_size": "num_prompts", "policy_samples_path": "policy",
            "policy_samples_from_backbone": "policy_from_backbone", "policy_samples": "n_samples",
            "bon.policy_path": "bon.policy", "bon.n": "bon.n_samples", "bon.prompts": "bon.num_prompts",
            "bon.batch_size": "bon.batch_sequences"},
    "prm-label": {"policy_path": "policy", "prompts": "num_prompts", "samples_per_prompt": "n_samples",
                  "batch_size": "batch_sequences"},
    "rollout": {"engine": "sampler", "batch_size": "batch_sequences", "score_batch_size": "score_batch_sequences"},
    "advantage": {"adv_clip": "advantage_clip", "batch_size": "batch_rows"},
    "ppo": {"policy_path": "policy", "advantages": "input", "warmup_updates": "warmup_steps",
            "critic_warmup_updates": "critic_warmup_steps", "critic_path": "critic", "prm_path": "prm",
            "ptx_size": "ptx_num_prompts", "critic": "train_critic"},
    "evaluate": {"batch_size": "batch_sequences", "html_samples": "log_samples"},
}


def _declared(cls) -> dict[str, str]:
    out = dict(config.renamed_keys(cls))
    out.update({old: new for old, (new, _) in config.renamed_values(cls).items()})
    return out


def _cases():
    available = stages.available()
    for name, renames in RENAMED.items():
        if name in available:
            for old, new in renames.items():
                yield pytest.param(name, available[name].Config, old, new, id=f"{name}:{old}->{new}")


CASES = list(_cases())


def test_every_stage_declares_exactly_the_renames_listed_here():
    for name, module in stages.available().items():
        assert _declared(module.Config) == RENAMED.get(name, {}), name


@pytest.mark.parametrize("stage,cls,old,new", CASES)
def test_old_key_loads_warns_and_sets_the_new_field(stage, cls, old, new):
    typ, _, default = config.flat_fields(cls)[new]
    value = _value(typ, default)
    given = {**NEEDS.get((stage, old), {}), old: value}
    with pytest.warns(FutureWarning, match=rf"'{old}' .*deprecated, use '{new}' instead"):
        cfg = config.build(cls, given, where=f"test [{stage}]")
    assert _get(cfg, new) == value


@pytest.mark.parametrize("stage,cls,old,new", CASES)
def test_old_flag_on_the_command_line(stage, cls, old, new):
    import argparse

    typ, _, default = config.flat_fields(cls)[new]
    value = _value(typ, default)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, cls)
    argv = [f"--{old}", str(value).lower() if isinstance(value, bool) else str(value)]
    for k, v in NEEDS.get((stage, old), {}).items():
        argv += ["--set", f"{k}={v}"]
    with pytest.warns(FutureWarning, match=f"use '{new}' instead"):
        cfg = config.from_args(cls, parser.parse_args(argv))
    assert _get(cfg, new) == value


def _old_names(cls, stored: dict) -> dict:
    """`stored` (nested, as to_dict writes it) as the release before the renames would have written it."""
    import copy

    out = copy.deepcopy(stored)
    by_value = config.renamed_values(cls)
    for old, new in config.renamed_keys(cls).items():
        *parents, last = new.split(".")
        holder = out
        for p in parents:
            holder = holder[p]
        value = holder.pop(last)
        *oparents, olast = old.split(".")
        holder = out
        for p in oparents:
            holder = holder.setdefault(p, {})
        holder[olast] = value
    for old, (new, _) in by_value.items():  # only after the others: the old switch takes the reused name
        out[old] = out.pop(new)
    return out


@pytest.mark.parametrize("name", [n for n, m in stages.available().items() if config.renamed_keys(m.Config)])
def test_a_config_stored_under_the_old_names_is_recognised(name):
    cls = stages.available()[name].Config
    kw = {"rollout": {"policy": "/models/policy"}}.get(name, {})
    cfg = config.build(cls, kw)
    now = io.config_identity(config.to_dict(cfg))
    before = _old_names(cls, now)
    assert before != now
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a stored config warns nobody
        assert io.stored_identity(before, cls) == now
    assert io.stored_identity(before) != now  # without the stage's Config it is another config


def test_an_output_and_a_checkpoint_written_before_the_renames_are_recognised(tmp_path):
    from prmflow.components.ppo.config import Config

    cfg = config.build(Config, {"train_critic": True, "critic": "/ppo-0/critic", "prm": "/prm"})
    now = {**config.to_dict(cfg), "inputs": {"/adv": "abc"}}
    before = _old_names(Config, io.config_identity(now))
    assert before["critic"] is True and before["critic_path"] == "/ppo-0/critic" and "train_critic" not in before
    with io.atomic_output_dir(tmp_path / "out", "ppo", manifest={"config": before}):
        pass
    assert io.completed_output(tmp_path / "out", {"config": io.config_identity(now)}, False, "ppo",
                               config_cls=Config) is not None
    latest = tmp_path / "work" / "latest"
    with io.atomic_output_dir(latest, "resume-checkpoint", manifest={"config": before}):
        pass
    assert checkpoint.find(tmp_path / "work", now, Config) == latest
    assert checkpoint.find(tmp_path / "work", now) is None


def test_every_old_key_in_the_stage_readmes_is_gone():
    """The generated tables list only today's keys (the old ones are hidden from --help too)."""
    from prmflow import docs

    for name, module in stages.available().items():
        table = docs.config_table(module.Config)
        for old in config.renamed_keys(module.Config):
            assert f"| `{old}` |" not in table, (name, old)


def test_constant_lr_schedule_everywhere():
    for name, module in stages.available().items():
        fields = config.flat_fields(module.Config)
        schedules = [k for k in fields if k.endswith("lr_schedule")]
        for key in schedules:
            assert "constant" in typing.get_args(fields[key][0]), (name, key)


def test_engine_is_always_the_training_backend():
    from prmflow.components.common.engine import EngineConfig

    for name, module in stages.available().items():
        for f in dataclasses.fields(module.Config):
            if f.name == "engine":
                assert typing.get_type_hints(module.Config)["engine"] is EngineConfig, name
