"""Run-time changes to a compiled pipeline's stage configs: `--param NAME=JSON` and `--set STAGE.KEY=VALUE`
deep-merge into the stage section the pipeline was compiled with (KFP itself would replace the whole
dict parameter, resetting every key the change did not name to the stage's default).

    --param 'ppo_config={"optim": {"lr": 1e-6}}'   ppo's lr changes; its ZeRO stage, critic, ... stay
    --set ppo.optim.lr=1e-6                        the same, one key (the value is read as YAML)
    --param tracking_uri=http://mlflow:5000        a plain parameter: replaced

Every merged section is checked against its stage's Config before anything is sent, so a key that
does not exist fails here, naming the stage and the key.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import yaml

from .. import stages
from ..components import config as config_lib
from ..errors import ConfigError

#: Pipeline parameter of each stage's section (pipeline.py's signature: `<stage>_config`).
SUFFIX = "_config"


def parse_params(items: list[str]) -> dict[str, Any]:
    """--param NAME=VALUE items (VALUE is JSON when it parses as JSON, else a string)."""
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE (VALUE may be JSON).")
        name, value = item.split("=", 1)
        try:
            params[name] = json.loads(value)
        except json.JSONDecodeError:
            params[name] = value
    return params


def _yaml_or_text(value: str) -> Any:
    """A stage --set value read as YAML (`3` a number, `[a, b]` a list), or as the text it is when it is not YAML
    (`[1`, `a: b: c`), as a stage's own --set takes it: the stage's config then names the key it does not fit."""
    if not value:
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def split_sets(items: list[str]) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """--set KEY=VALUE items as (pipeline: keys, {stage: {dotted key: value}}): a key whose first part is
    a stage name sets that stage's config; any other key (or `pipeline.KEY`) sets the pipeline: section."""
    pipeline: dict[str, str] = {}
    per_stage: dict[str, dict[str, Any]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE.")
        key, value = item.split("=", 1)
        head, _, rest = key.partition(".")
        if head in stages.PIPELINE_STAGES and rest:
            per_stage.setdefault(head, {})[rest] = _yaml_or_text(value)
        elif rest and head != "pipeline" and (close := difflib.get_close_matches(head, stages.PIPELINE_STAGES, n=1)):
            # read as a pipeline: key, it was "'sfft.max_steps' is not a config key" with no hint of the stage
            raise ConfigError(f"--set {item!r}: '{head}' is not a stage. Did you mean '{close[0]}.{rest}'?")
        else:
            pipeline[key.removeprefix("pipeline.")] = value
    return pipeline, per_stage


def _leaves(cls: type, section: dict[str, Any], where: str) -> dict[str, Any]:
    """A section as {leaf dotted key: value} of `cls` (a dict-typed field whole)."""
    flat = config_lib.flatten(dict(section or {}))
    leaves = config_lib.flat_fields(cls)
    return {k: v for k, v in flat.items() if k in leaves}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in sorted(flat.items()):
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge_section(stage: str, base: dict[str, Any], change: dict[str, Any], where: str) -> dict[str, Any]:
    """`change` deep-merged into stage `stage`'s section `base`; ConfigError naming the stage and key when
    `change` holds a key the stage does not have or a value it cannot take."""
    module = stages.available().get(stage)
    if module is None:  # a stage this build lacks (evaluate without its extra): nothing to check against
        return _nest({**config_lib.flatten(base or {}), **config_lib.flatten(change)})
    cls = module.Config
    # unknown keys and bad values in `change`, and the combination: checked over the base, as a change may be
    # valid only beside it (advantage.step_rewards=false over an estimator that reads the outcome)
    base_leaves = _leaves(cls, base, f"{where} [{stage}]")
    config_lib.build(cls, {**base_leaves, **config_lib.flatten(change)}, where=f"{where} [{stage}]")
    merged = {**base_leaves, **_leaves(cls, change, f"{where} [{stage}]")}
    # sent as the stage reads them: a compiled default's ints come back from KFP's Struct as doubles (2.0) and a
    # --set value as YAML 1.1 reads it (2e-6 is a string there), so the run's parameters and the dry run would
    # show 2.0 and '2e-6' where the stage runs with 2 and 2e-06
    leaves = config_lib.flat_fields(cls)
    return _nest({k: config_lib.coerce(v, leaves[k][0], k, f"{where} [{stage}]") for k, v in merged.items()})


def run_arguments(defaults: dict[str, Any], params: dict[str, Any],
                  stage_sets: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The pipeline arguments to send: each stage parameter named by `params` or `stage_sets` merged into
    its compiled default (`defaults`: {parameter: default value}); other parameters as given."""
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ConfigError(f"--param {', '.join(unknown)}: the pipeline has no such parameter; it has "
                          f"{', '.join(sorted(defaults))}.")
    args: dict[str, Any] = {}
    for name, value in params.items():
        stage = name.removesuffix(SUFFIX)
        if name.endswith(SUFFIX) and stage in stages.PIPELINE_STAGES:
            if not isinstance(value, dict):
                raise ConfigError(f"--param {name}: expected a JSON object of {stage} config keys, "
                                  f"e.g. {name}='{{\"optim\": {{\"lr\": 1e-6}}}}', not {value!r}.")
            args[name] = merge_section(stage, defaults[name] or {}, value, f"--param {name}")
        else:
            args[name] = value
    for stage, flat in (stage_sets or {}).items():
        name = stage + SUFFIX
        if name not in defaults:  # prm-update: its section is compiled into its tasks, not a run parameter
            raise ConfigError(f"--set {stage}.KEY: the {stage} section is not a parameter of this pipeline; it is "
                              f"compiled in. Compile with the change: --config FILE --set {stage}.KEY=VALUE.")
        args[name] = merge_section(stage, args.get(name, defaults.get(name) or {}), flat, "--set")
    return args


def effective_configs(sections: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{stage: the full config the stage will run with} (defaults filled in) for `submit --dry-run`;
    the KFP step still adds its artifact paths and the run's tracking settings."""
    out = {}
    for stage, section in sections.items():
        module = stages.available().get(stage)
        out[stage] = (config_lib.to_dict(config_lib.build(module.Config, config_lib.flatten(section or {}),
                                                          where=f"[{stage}]")) if module else dict(section or {}))
    return out


def load_with_sets(config: str | None, sets: list[str]):
    """The pipeline spec of `config` with --set applied (compile, plan, submit, upload, run-local): pipeline:
    keys (iterations=3, cluster.kfp_version=2.17), and stage keys (ppo.optim.lr=1e-6) merged into their sections."""
    from .settings import load_spec

    pipeline, per_stage = split_sets(sets)
    spec = load_spec(config, pipeline)
    for stage, change in per_stage.items():
        spec.stages[stage] = merge_section(stage, spec.stages.get(stage) or {}, change, "--set")
    return spec
