"""pipeline.prm_update: a prm-update task per RL iteration, read from the compiled spec.

Rollout k scores with PRM_k; prm-update-k trains PRM_k+1 on rollouts k (replaying what prm-update-k-1
kept); rollout k+1 and the final evaluate read the updated PRM; advantage k and ppo k never wait for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from prmflow.errors import ConfigError
from prmflow.pipelines import kfp_components as components, kfp_shim, plan
from prmflow.pipelines.settings import load_spec

from .test_compile_submit import CLUSTER_YAML, compile_spec

UPDATE_YAML = CLUSTER_YAML.replace("  iterations: 3\n", "  iterations: 3\n  prm_update: true\n") + """
prm-update:
  max_steps: 40
  replay_share: 0.25
  held_out: 0.2
"""


def dags(ir):
    """{DAG name ('root' or a sub-DAG component): its dag}."""
    return {"root": ir["root"]["dag"], **{n: c["dag"] for n, c in ir["components"].items() if "dag" in c}}


def by_name(ir):
    """{task display name: (task, name of the DAG it sits in, its key there)}, through every sub-DAG."""
    return {t["taskInfo"]["name"].removesuffix(" (trainjob)"): (t, d, key)
            for d, dag in dags(ir).items() for key, t in dag["tasks"].items()}


def holder(ir, dag_name: str):
    """(the task that runs sub-DAG `dag_name`, the DAG that task sits in)."""
    return next((t, d) for d, dag in dags(ir).items() for t in dag["tasks"].values()
                if t["componentRef"]["name"] == dag_name)


def producer(ir, consumer: str, artifact: str) -> str:
    """Display name of the executor task whose output feeds `consumer`'s input `artifact`: up through the
    sub-DAGs' inputs (exit handler, ParallelFor) and down through a loop's Collected output."""
    return source(ir, consumer, artifact)[0]


def source(ir, consumer: str, artifact: str) -> tuple[str, str]:
    """(display name, output key) of the executor task whose output feeds `consumer`'s input `artifact`."""
    task, dag_name, _ = by_name(ir)[consumer]
    src = task["inputs"]["artifacts"][artifact]
    while "componentInputArtifact" in src:
        outer, dag_name = holder(ir, dag_name)
        src = outer["inputs"]["artifacts"][src["componentInputArtifact"]]
    made_by = dags(ir)[dag_name]["tasks"][src["taskOutputArtifact"]["producerTask"]]
    key = src["taskOutputArtifact"]["outputArtifactKey"]
    while "dag" in ir["components"][made_by["componentRef"]["name"]]:
        inner = ir["components"][made_by["componentRef"]["name"]]["dag"]
        sel = inner["outputs"]["artifacts"][key]["artifactSelectors"][0]
        made_by, key = inner["tasks"][sel["producerSubtask"]], sel["outputArtifactKey"]
    return made_by["taskInfo"]["name"].removesuffix(" (trainjob)"), key


def upstream(ir, name: str) -> set[str]:
    """Display names of every task `name` waits for: its dependencies, those of the sub-DAGs around it, theirs."""
    tasks = by_name(ir)
    names = {(d, key): n for n, (_, d, key) in tasks.items()}
    seen, todo = set(), [name]
    while todo:
        task, dag_name, _ = tasks[todo.pop()]
        deps = [(dag_name, key) for key in task.get("dependentTasks", [])]
        if dag_name != "root":  # a sub-DAG's task also waits for what the sub-DAG waits for
            outer, outer_dag = holder(ir, dag_name)
            deps.append((outer_dag, next(k for k, t in dags(ir)[outer_dag]["tasks"].items() if t is outer)))
        for d in deps:
            if names[d] not in seen:
                seen.add(names[d])
                todo.append(names[d])
    return seen


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    ir, platform, _ = compile_spec(tmp_path_factory.mktemp("upd"), UPDATE_YAML)
    return ir, platform


def test_a_prm_update_task_per_iteration_feeds_the_next_rollout_and_the_evaluate(compiled):
    ir, _ = compiled
    tasks = by_name(ir)
    assert [n for n in tasks if n.startswith("prm-update")] == ["prm-update-0", "prm-update-1", "prm-update-2"]
    assert producer(ir, "rollout-0", "prm_model") == "prm"
    for k in range(3):
        assert producer(ir, f"prm-update-{k}", "prm_model") == ("prm" if k == 0 else f"prm-update-{k - 1}")
        assert producer(ir, f"prm-update-{k}", "rollouts") == f"rollout-{k}"
        if k:
            assert producer(ir, f"rollout-{k}", "prm_model") == f"prm-update-{k - 1}"
            assert producer(ir, f"prm-update-{k}", "previous") == f"prm-update-{k - 1}"
            assert tasks[f"prm-update-{k}"][0]["inputs"]["artifacts"]["previous"]["taskOutputArtifact"][
                "outputArtifactKey"] == "state"
        else:
            assert "previous" not in tasks["prm-update-0"][0]["inputs"]["artifacts"]
    assert producer(ir, "evaluate", "prm_model") == "prm-update-2"
    cfg = tasks["prm-update-1"][0]["inputs"]["parameters"]["config"]["runtimeValue"]["constant"]
    assert cfg == {"max_steps": 40, "replay_share": 0.25, "held_out": 0.2}


def test_advantage_and_ppo_do_not_wait_for_the_update(compiled):
    ir, _ = compiled
    for k in range(3):
        for stage in ("advantage", "ppo"):  # they wait for update k-1 only through rollout k, which scores with it
            before = upstream(ir, f"{stage}-{k}")
            assert {n for n in before if n.startswith("prm-update")} == {f"prm-update-{j}" for j in range(k)}, (stage, k)
        assert producer(ir, f"advantage-{k}", "rollouts") == f"rollout-{k}"
    assert "prm-update-0" in upstream(ir, "rollout-1") and "prm-update-1" in upstream(ir, "evaluate")


def test_the_update_runs_in_a_one_gpu_pod_of_the_gpu_pool(compiled):
    ir, platform = compiled
    ex = ir["components"][by_name(ir)["prm-update-1"][0]["componentRef"]["name"]]["executorLabel"]
    container = ir["deploymentSpec"]["executors"][ex]["container"]
    assert int(container["resources"]["accelerator"]["resourceCount"]) == 1  # cluster.gpus.prm_update default
    assert container["image"].startswith("registry.example.com/ml/prmflow-gpu@")
    assert platform[ex]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "a100-pool"}
    assert platform[ex]["pvcMount"][0]["mountPath"] == "/workspace"


def test_without_prm_update_the_spec_is_as_before(tmp_path):
    """The key off (the default), even with a prm-update: section: no task, no component, the same spec."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, _, text_a = compile_spec(tmp_path / "a", CLUSTER_YAML)
    _, _, text_b = compile_spec(tmp_path / "b", UPDATE_YAML.replace("prm_update: true", "prm_update: false"))

    def body(text):  # KFP's header comment lists the dict parameters' defaults in no fixed order
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert body(text_a) == body(text_b)
    assert not any("prm-update" in n for n in by_name(a)) and not any("prm-update" in e for e in a["deploymentSpec"]["executors"])


@pytest.mark.parametrize("extra, match", [
    ("rollout:\n  prm: oracle\n", r"pipeline.prm_update is true but rollout.prm is oracle"),
    ("advantage:\n  estimator: grpo\n", r"pipeline.prm_update is true but the advantage stage reads no step rewards "
                                         r"\(estimator=grpo"),
])
def test_prm_update_without_a_trained_prm_whose_scores_are_read_is_refused(tmp_path, extra, match):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(UPDATE_YAML + extra)
    with pytest.raises(ConfigError, match=match):
        plan.compiled(load_spec(cfg))


def test_the_plan_counts_the_update_in_every_iteration(compiled):
    ir, _ = compiled
    spec = load_spec(None, data=yaml.safe_load(UPDATE_YAML))
    P = 7e9
    s = plan.sizes_of(spec, P)
    rows = plan.walk(json.loads(json.dumps(ir)), s)
    by = {r.name: r for r in rows}
    upd = by["prm-update-1"]
    # through the object store: the PRM's location, the previous update's and every rollout shard
    assert upd.object_store_read == 2 * plan.LOCATION_BYTES + 4 * s.rollouts_per_shard
    # on the workspace: the PRM, its copy of the rollouts and the replayed ones read; the new PRM and the copy written
    assert upd.workspace_read == s.weights + 2 * s.rollouts
    assert upd.workspace_written == s.weights + s.rollouts
    assert by["prm-update-0"].workspace_read == s.weights + s.rollouts  # nothing to replay yet
    assert s.rollouts == 4 * s.rollouts_per_shard
    assert upd in plan.per_iteration(rows)
    without = load_spec(None, data=yaml.safe_load(UPDATE_YAML.replace("prm_update: true", "prm_update: false")))
    assert plan.storage(spec, s) == plan.storage(without, s) + 3 * (s.weights + s.rollouts)


def test_the_component_copies_its_rollouts_and_the_next_update_replays_them(tmp_path, monkeypatch):
    """The component itself (no KFP): update k copies rollouts k to its workspace directory; update k+1
    replays that copy and what update k replayed; the workspace path changes with every input."""
    from prmflow.components.data import io

    seen = []

    def fake_run(name, stage, config, paths, **kw):
        seen.append(paths)
        out = Path(paths["output"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(b"w")
        io.write_json_atomic(out / "manifest.json", io.build_manifest(out, "prm"))
        return {"eval/step_auc": 0.7}

    monkeypatch.setattr(kfp_shim, "run_stage", fake_run)

    class Art:
        def __init__(self, path):
            self.path, self.metadata = str(path), {}

    def shard(path, rows):
        path.mkdir(parents=True)
        (path / "part-0.parquet").write_bytes(rows)
        io.write_json_atomic(path / "manifest.json", io.build_manifest(path, "rollouts"))
        return Art(path)

    prm = tmp_path / "ws" / "prm"
    prm.mkdir(parents=True)
    (prm / "model.safetensors").write_bytes(b"p")
    io.write_json_atomic(prm / "manifest.json", io.build_manifest(prm, "prm"))
    prm_art = Art(tmp_path / "a" / "prm")
    kfp_shim.write_location(prm_art.path, str(prm))
    ws = str(tmp_path / "ws")
    states = []
    for k in range(2):
        shards = [shard(tmp_path / f"r{k}" / f"s{i}", f"{k}{i}".encode()) for i in range(2)]
        new, state = Art(tmp_path / "a" / f"upd{k}"), Art(tmp_path / "a" / f"state{k}")
        components.prm_update({"max_steps": 40}, "", "e", ws, k, prm_art, shards, new, state,
                              states[-1] if states else None)
        states.append(state)
        prm_art = new
    first, second = (Path(kfp_shim.located(s.path)) for s in states)
    assert sorted(os.listdir(first / "rollouts")) == ["shard-00000", "shard-00001"]  # the shards, copied
    assert not (first / "rollouts" / "shard-00000").is_symlink()
    assert (first / "rollouts" / "shard-00001" / "part-0.parquet").read_bytes() == b"01"
    assert seen[0]["replay"] == [] and seen[0]["input"] == str(first / "rollouts")
    assert seen[1]["replay"] == [str(first / "rollouts")]  # update 1 replays update 0's copy
    assert json.loads((second / "replay.json").read_text()) == [str(first / "rollouts")]
    assert seen[1]["prm"] == str(first.parent / "prm")  # warm start from update 0's PRM
    assert kfp_shim.located(prm_art.path) == str(second.parent / "prm")
    assert first.parent.parent == Path(ws) and first.parent.name.startswith("prm-update-0-")
    # the workspace path is what the update computes from: another previous state (here none) is another path
    alone = Art(tmp_path / "a" / "alone")
    components.prm_update({"max_steps": 40}, "", "e", ws, 1, Art(tmp_path / "a" / "upd0"), shards, Art(tmp_path / "a" / "x"),
                          alone)
    assert Path(kfp_shim.located(alone.path)) != second and seen[-1]["replay"] == []


def test_the_prm_update_section_is_compiled_in_not_a_run_parameter():
    from prmflow.pipelines.params import run_arguments

    with pytest.raises(ConfigError, match=r"--set prm-update.KEY: the prm-update section is not a parameter of this "
                                          r"pipeline; it is compiled in. Compile with the change: --config FILE"):
        run_arguments({"ppo_config": {}}, {}, {"prm-update": {"max_steps": 10}})


def test_two_updates_with_the_real_stage_train_on_the_copied_shards_and_replay_them(tmp_path):
    """The component with the prm-update stage itself (tiny PRM, two steps an update): update 0 trains on
    its gathered shards' copy, update 1 warm starts from update 0's PRM and replays that copy."""
    import pyarrow as pa

    from prmflow.components import config
    from prmflow.components.data import schema
    from prmflow.components.prm import stage
    from prmflow.tasks import arithmetic

    base = tmp_path / "base"
    stage.run(config.load(stage.Config, overrides={
        "backbone": "tiny-llama", "extra_layers": 0, "num_prompts": 20, "eval_size": 4, "max_steps": 2,
        "micro_batch_size": 4, "optim.warmup_steps": 0, "eval_every": 0, "save_every": 0, "engine.backend": "torch",
        "tracking.enabled": False, "output": str(base)}))

    class Art:
        def __init__(self, path):
            self.path, self.metadata = str(path), {}

    def shard(path, k, seed):
        rows = [{"prompt_id": p.prompt_id, "sample_idx": i, "iteration": k, "prompt": p.prompt,
                 "response": "\n".join(arithmetic.split_steps(p.solution)), "response_ids": [1, 2],
                 "outcome_reward": float(i % 2)}
                for p in arithmetic.generate(4, seed=seed, split="train") for i in range(2)]
        with schema.DatasetWriter(path, "rollouts") as w:
            w.write(pa.Table.from_pylist(rows))
        return Art(path)

    prm, state, ws = Art(tmp_path / "a" / "prm"), None, str(tmp_path / "ws")
    kfp_shim.write_location(prm.path, str(base))
    cfg = {"max_steps": 2, "micro_batch_size": 4, "held_out": 0.25, "replay_share": 0.25, "tracking": {"enabled": False}}
    for k in range(2):
        new, out_state = Art(tmp_path / "a" / f"prm{k}"), Art(tmp_path / "a" / f"state{k}")
        components.prm_update(cfg, "", "e", ws, k, prm, [shard(tmp_path / f"r{k}" / f"s{i}", k, 10 * k + i) for i in range(2)],
                              new, out_state, state)
        prm, state = new, out_state
    assert prm.metadata["eval_step_auc"] >= 0 and prm.metadata["data_replay_examples"] > 0  # update 1 replayed
    manifest = json.loads((Path(kfp_shim.located(prm.path)) / "manifest.json").read_text())
    first = Path(manifest["parents"][0])  # the PRM update 1 started from: update 0's
    assert first.parent.name.startswith("prm-update-0-")
    assert str(first.parent / "replay" / "rollouts") in manifest["parents"]


def test_every_pipeline_stage_of_the_registry_is_a_task_of_the_dag(compiled):
    """stages.PIPELINE_STAGES is what the DAG runs: each stage has a task whose executor runs its KFP
    component, `stages.component(name)` (a stage registered without its wiring in pipeline.build fails here)."""
    from prmflow import stages

    ir, _ = compiled
    executors = ir["deploymentSpec"]["executors"]
    run = {c["executorLabel"]: executors[c["executorLabel"]]["container"] for c in ir["components"].values()
           if "executorLabel" in c}
    functions = {args[args.index("--function_to_execute") + 1] for c in run.values()
                 if "--function_to_execute" in (args := c.get("args", []))}
    assert {stages.component(name) for name in stages.PIPELINE_STAGES} <= functions, functions
