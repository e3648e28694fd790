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


#: Values a key needs to be valid (in a range), by the last part of its new name.
VALUES = {"top_p": 0.5}


def _value(typ, default, key=""):
    """A value of type `typ` other than `default`, as YAML would give it."""
    if key.rsplit(".", 1)[-1] in VALUES:
        return VALUES[key.rsplit(".", 1)[-1]]
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


#: The flat optimizer and sampling keys that moved into the shared `optim` / `sampling` sections.
OPTIM = {k: f"optim.{k}" for k in ("lr", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm")}
SAMPLING = {k: f"sampling.{k}" for k in ("temperature", "top_p", "max_new_tokens")}

#: Every key renamed in this release, by stage: old -> new (the issue's "one vocabulary" list).
RENAMED = {
    "sft": {"model_path": "policy", "train_size": "num_prompts", **OPTIM},
    "prm": {"model_path": "backbone", "train_size": "num_prompts", "policy_samples_path": "policy",
            "policy_samples_from_backbone": "policy_from_backbone", "policy_samples": "n_samples",
            "bon.policy_path": "bon.policy", "bon.n": "bon.n_samples", "bon.prompts": "bon.num_prompts",
            "bon.batch_size": "bon.batch_sequences", **OPTIM, **{f"bon.{k}": f"bon.{v}" for k, v in SAMPLING.items()}},
    "prm-label": {"policy_path": "policy", "prompts": "num_prompts", "samples_per_prompt": "n_samples",
                  "batch_size": "batch_sequences", **SAMPLING},
    "rollout": {"engine": "sampler", "batch_size": "batch_sequences", "score_batch_size": "score_batch_sequences",
                **SAMPLING, "top_k": "sampling.top_k"},
    "advantage": {"adv_clip": "advantage_clip", "batch_size": "batch_rows"},
    "ppo": {"policy_path": "policy", "advantages": "input", "critic_warmup_updates": "critic_warmup_steps",
            "critic_path": "critic", "prm_path": "prm", "ptx_size": "ptx_num_prompts", "critic": "train_critic",
            **OPTIM, "warmup_updates": "optim.warmup_steps"},
    "evaluate": {"batch_size": "batch_sequences", "html_samples": "log_samples", **SAMPLING},
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
    value = _value(typ, default, new)
    given = {**NEEDS.get((stage, old), {}), old: value}
    with pytest.warns(FutureWarning, match=rf"'{old}' .*deprecated, use '{new}' instead"):
        cfg = config.build(cls, given, where=f"test [{stage}]")
    assert _get(cfg, new) == value


@pytest.mark.parametrize("stage,cls,old,new", CASES)
def test_old_flag_on_the_command_line(stage, cls, old, new):
    import argparse

    typ, _, default = config.flat_fields(cls)[new]
    value = _value(typ, default, new)
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
        if last not in holder:  # two old names of one key (ppo's warmup_updates, then warmup_steps): the first
            continue
        value = holder.pop(last)
        *oparents, olast = old.split(".")
        holder = out
        for p in oparents:
            holder = holder.setdefault(p, {})
        holder[olast] = value
    for old, (new, _) in by_value.items():  # only after the others: the old switch takes the reused name
        out[old] = out.pop(new)

    def drop_emptied(d: dict, before: dict) -> None:  # a section all of whose keys moved out (optim) was not there
        for k in list(d):
            if isinstance(d[k], dict):
                drop_emptied(d[k], before.get(k, {}) if isinstance(before.get(k), dict) else {})
                if not d[k] and before.get(k):
                    del d[k]

    drop_emptied(out, stored)
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


def test_a_checkpoint_with_flat_optimizer_keys_is_recognised(tmp_path):
    """sft and prm resume checkpoints and outputs written with flat lr / warmup_steps / lr_schedule
    (before the shared `optim` section) are the same config as today's optim.*."""
    from prmflow.components.sft.stage import Config

    cfg = config.build(Config, {"optim": {"lr": 1e-3, "warmup_steps": 5}})
    now = io.config_identity(config.to_dict(cfg))
    before = {k: v for k, v in now.items() if k != "optim"}
    before.update(lr=1e-3, warmup_steps=5, lr_schedule="cosine", weight_decay=0.0, max_grad_norm=1.0)
    assert "optim" not in before
    assert io.stored_identity(before, Config) == now
    assert io.stored_identity({**before, "lr": 2e-3}, Config) != now  # another lr is another config
    latest = tmp_path / "work" / "latest"
    with io.atomic_output_dir(latest, "resume-checkpoint", manifest={"config": before}):
        pass
    assert checkpoint.find(tmp_path / "work", config.to_dict(cfg), Config) == latest
    with io.atomic_output_dir(tmp_path / "out", "sft", manifest={"config": before}):
        pass
    assert io.completed_output(tmp_path / "out", {"config": now}, False, "sft", config_cls=Config) is not None


def test_flat_fields_show_each_stage_its_own_section_defaults():
    """One OptimConfig / SamplingConfig class, each stage's defaults (what build makes, --help and the READMEs show)."""
    from prmflow.components.common.optim import OptimConfig

    lrs = {}
    for name, module in stages.available().items():
        fields = config.flat_fields(module.Config)
        if "optim.lr" in fields:
            kw = {"rollout": {"policy": "/p"}, "evaluate": {"policy": "/p"}}.get(name, {})
            assert fields["optim.lr"][2] == config.build(module.Config, kw).optim.lr, name
            lrs[name] = fields["optim.lr"][2]
    assert lrs == {"sft": 3e-3, "prm": 1e-3, "ppo": 1e-4}
    assert OptimConfig().lr not in (3e-3, 1e-3)  # the class default is not what the stages show
    assert config.flat_fields(stages.available()["sft"].Config)["optim.lr_schedule"][2] == "cosine"


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
