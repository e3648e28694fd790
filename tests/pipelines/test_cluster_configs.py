"""The cluster recipes in configs/cluster/ compile with the real KFP compiler, into a DAG that asks for
what their comment tables say (pods x GPUs), reads the public datasets and samples with vLLM."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.pipelines.settings import safe_loader

from .test_compile_submit import IMAGES, STORAGE

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["qwen2.5-math-1.5b-gsm8k-math.yaml", "qwen2.5-7b-gsm8k-math.yaml"]


_compiled: dict[str, tuple[dict, dict]] = {}


def compile_recipe(tmp_path, name):
    """(pipeline spec, kubernetes platform executors) of a recipe, compiled once per test session."""
    if name in _compiled:
        return _compiled[name]
    out = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(ROOT / "configs/cluster" / name), "-o", str(out), *IMAGES]) == 0
    docs = list(yaml.load_all(out.read_text(), Loader=safe_loader()))
    _compiled[name] = docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return _compiled[name]


def table(name) -> dict[str, tuple[int, int | None]]:
    """{step: (pods, GPUs per pod)} from the recipe's comment table ('8 x 1 H100 80GB', '1 x CPU pod')."""
    rows = {}
    for line in (ROOT / "configs/cluster" / name).read_text().splitlines():
        m = re.match(r"#\s*\|\s*([a-z]+)(?: \(once\))?\s*\|\s*(\d+) x (\d+|CPU)", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), None if m.group(3) == "CPU" else int(m.group(3)))
    return rows


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_compiles_to_the_resources_its_table_states(tmp_path, name):
    spec, platform = compile_recipe(tmp_path, name)
    recipe = yaml.safe_load((ROOT / "configs/cluster" / name).read_text())
    pool, rows = recipe["pipeline"]["cluster"]["gpu_pool"], table(name)
    assert set(rows) >= {"sft", "prm", "rollout", "advantage", "ppo", "evaluate"}
    executors = spec["deploymentSpec"]["executors"]
    for stage in ("sft", "prm", "rollout", "ppo", "evaluate"):
        pods, gpus = rows[stage]
        found = [e for e in executors if re.fullmatch(f"exec-{stage}(-\\d+)?", e)]
        assert found, stage
        for ex in found:
            res = executors[ex]["container"]["resources"]
            assert int(res["accelerator"]["resourceCount"]) == gpus <= pool["accelerator_count"], (stage, res)
            assert platform[ex]["nodeSelector"]["labels"] == pool["node_selector"]
    assert rows["advantage"] == (1, None)
    assert all("accelerator" not in executors[e]["container"].get("resources", {})
               for e in executors if e.startswith("exec-advantage"))
    # the rollout fans out over as many pods as the table says, in every iteration
    loops = [t for c in spec["components"].values() for t in c.get("dag", {}).get("tasks", {}).values()
             if "parameterIterator" in t] + [t for t in spec["root"]["dag"]["tasks"].values() if "parameterIterator" in t]
    assert len(loops) == recipe["pipeline"]["iterations"]
    assert {len(yaml.safe_load(t["parameterIterator"]["items"]["raw"])) for t in loops} == {rows["rollout"][0]}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_the_real_model_on_public_data_with_process_rewards(tmp_path, name):
    spec, _ = compile_recipe(tmp_path, name)
    params = {k: v["defaultValue"] for k, v in spec["root"]["inputDefinitions"]["parameters"].items()
              if "defaultValue" in v}
    sft, prm, rollout = params["sft_config"], params["prm_config"], params["rollout_config"]
    assert sft["policy"].startswith("/workspace/models/Qwen2.5-") and sft["policy"] == rollout["policy"]
    assert rollout["sampler"] == "vllm" and rollout["task"] == sft["task"] == "s3://prmflow-data/rl-train/"
    assert prm["task"].endswith("math-shepherd.parquet") and params["evaluate_config"]["task"].endswith("math500-test.jsonl")
    # the advantage section, as the stage reads it, puts the PRM's step rewards into the advantages
    plan = advantage.resolve(config.load(advantage.Config, overrides=config.flatten(params["advantage_config"])))
    assert plan.steps and plan.outcome and "step_rewards" in plan.needs
    # vLLM's tensor parallel size divides Qwen2.5's attention heads (12 / 2 KV for 1.5B, 28 / 4 KV for 7B)
    heads = (12, 2) if "1.5b" in name else (28, 4)
    tp = rollout["vllm"]["tensor_parallel_size"]
    assert all(h % tp == 0 for h in heads) and tp <= yaml.safe_load(
        (ROOT / "configs/cluster" / name).read_text())["pipeline"]["cluster"]["gpu_pool"]["accelerator_count"]


def readme_block() -> dict:
    """docs/cluster.md's 'A real model on the cluster' block: the keys that take the quickstart to Qwen2.5 on GSM8K."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    m = re.search(r"```yaml\n# quickstart -> Qwen2.5[^\n]*\n(.*?)```", text, re.S)
    assert m, "docs/cluster.md: the 'A real model on the cluster' YAML block is missing"
    return yaml.safe_load(m.group(1))


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for k, v in change.items():
        out[k] = merged(base.get(k) or {}, v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def test_readme_keys_take_the_quickstart_to_qwen_on_gsm8k(tmp_path):
    """Every key docs/cluster.md names exists, really changes the quickstart's value, and the result compiles."""
    from prmflow import stages

    quick = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    block = readme_block()
    for stage, section in block.items():
        Config = stages.available()[stage].Config
        before = config.flat_dict(config.build(Config, config.flatten(quick.get(stage) or {})))
        after = config.flat_dict(config.build(Config, config.flatten(merged(quick.get(stage) or {}, section))))
        for key, value in config.flatten(section).items():
            if isinstance(value, dict):  # flatten also keeps the nested section itself
                continue
            assert key in after, f"docs/cluster.md names {stage}.{key}, which is not a key"
            assert before[key] != after[key], \
                f"docs/cluster.md says {stage}.{key} changes, but the quickstart already has {value!r}"
    assert block["sft"]["task"].endswith(".parquet") and block["prm"]["task"].endswith("math-shepherd.parquet")
    path = tmp_path / "qwen-gsm8k.yaml"
    path.write_text(yaml.safe_dump(merged(quick, block)))
    assert cli.main(["pipeline", "compile", "--config", str(path), "-o", str(tmp_path / "compiled.yaml"), *IMAGES,
                     *STORAGE]) == 0


def header_commands(name) -> list[list[str]]:
    """The `prmflow pipeline ...` commands in a recipe's header comment, continuation lines joined."""
    import shlex

    text, commands = "", []
    for line in (ROOT / "configs/cluster" / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if text or body.startswith("prmflow pipeline "):
            text += " " + body.rstrip("\\")
            if not body.endswith("\\"):
                commands.append(shlex.split(text))
                text = ""
    return commands


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs/cluster").glob("*.yaml")))
def test_the_header_commands_work_once_the_registry_is_filled_in(name):
    """A recipe's header shows how to compile it; that command, with the registry and digest filled in, gets
    past the image check compile applies (images still placeholders are refused) and names this recipe."""
    from prmflow.pipelines.params import load_with_sets

    commands = header_commands(name)
    assert any(c[:3] == ["prmflow", "pipeline", "compile"] for c in commands)
    for command in commands:
        filled = [a.replace("REGISTRY", "registry.example.com/ml").replace("DIGEST", "0" * 64) for a in command]
        assert filled[filled.index("--config") + 1] == f"configs/cluster/{name}"
        sets = [filled[i + 1] for i, a in enumerate(filled) if a == "--set"]
        spec = load_with_sets(str(ROOT / "configs/cluster" / name), sets)
        assert spec.pipeline.images.placeholders() == [], " ".join(command)
