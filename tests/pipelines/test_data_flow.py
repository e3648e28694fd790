"""The cluster data flow of the three cluster recipes, read from their compiled specs.

The plan (prmflow/pipelines/plan.py) applies the KFP launcher's rule (every input artifact is
downloaded whole) to the compiled IR; its figures are checked here against sums done by hand from
P (parameters), 2 bytes per bf16 weight, 12 bytes per parameter of DeepSpeed Adam state.
"""

import json
from pathlib import Path

import pytest
import yaml

from prmflow.errors import ConfigError, DataError
from prmflow.pipelines import kfp_shim, plan
from prmflow.pipelines.pipeline import compile_to
from prmflow.pipelines.settings import load_spec, safe_loader

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "cluster"
QWEN7, PPO7, QWEN15 = "qwen2.5-7b-gsm8k-math.yaml", "ppo-7b-2x8.yaml", "qwen2.5-math-1.5b-gsm8k-math.yaml"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{config name: (spec, IR, kubernetes platform executors)}, each compiled once."""
    out = {}
    for name in (QWEN7, PPO7, QWEN15):
        spec = load_spec(CONFIGS / name)
        path = compile_to(spec, str(tmp_path_factory.mktemp("ir") / "p.yaml"))
        ir, platform = yaml.load_all(Path(path).read_text(), Loader=safe_loader())
        out[name] = (spec, ir, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"])
    return out


def tasks(ir):
    """(task name, task, component) of every executor task, through every sub-DAG."""
    comps = ir["components"]
    todo = [ir["root"]["dag"]["tasks"]]
    while todo:
        for name, t in todo.pop().items():
            comp = comps[t["componentRef"]["name"]]
            if "dag" in comp:
                todo.append(comp["dag"]["tasks"])
            else:
                yield name, t, comp


def inputs_by_stage(ir):
    """{task display name: sorted input artifact names}."""
    return {t["taskInfo"]["name"].removesuffix(" (trainjob)"): sorted((t.get("inputs") or {}).get("artifacts", {}))
            for _, t, _ in tasks(ir)}


# --- compiled IR -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, rollout_reads, ppo_reads", [
    (QWEN7, ["policy", "prm_model", "ref"], ["advantages", "policy", "previous"]),  # kl_loss_coef: ref; no critic
    (PPO7, ["critic", "policy", "prm_model", "ref"], ["advantages", "policy", "previous"]),  # GAE critic, reward KL
    (QWEN15, ["policy", "prm_model", "ref"], ["advantages", "policy", "previous"]),
])
def test_every_task_takes_only_the_inputs_its_config_reads(compiled, name, rollout_reads, ppo_reads):
    _, ir, _ = compiled[name]
    got = inputs_by_stage(ir)
    assert got["rollout-0"] == rollout_reads and got["rollout-3"] == rollout_reads
    assert got["ppo-0"] == ["advantages", "policy"]  # nothing to continue at k = 0
    assert got["ppo-3"] == ppo_reads
    # advantage never touches weights: the rollouts, and the KL state only where the reward has a KL term
    kl = name == PPO7  # advantage.kl_coef 0.01; the Qwen recipes put KL in the PPO loss
    assert got["advantage-0"] == ["rollouts"] and got["advantage-3"] == (["kl_state", "rollouts"] if kl else ["rollouts"])
    assert got["evaluate"] == ["baseline", "policy", "prm_model"]


@pytest.mark.parametrize("name", [QWEN7, PPO7, QWEN15])
def test_no_cached_task_has_the_run_id_among_its_cache_inputs(compiled, name):
    _, ir, platform = compiled[name]
    cached = 0
    for _, t, comp in tasks(ir):
        text = json.dumps(t.get("inputs", {}))
        if t.get("cachingOptions", {}).get("enableCache"):
            cached += 1
            # parameters and the container command are cache-key inputs (backend/src/v2/cacheutils/cache.go)
            assert "pipeline_job_uuid" not in text and "pipeline_job_name" not in text, t["taskInfo"]["name"]
            # the run id arrives from the pod's label, which is not
            env = platform[comp["executorLabel"]]["fieldPathAsEnv"]
            assert {"name": kfp_shim.RUN_ID_ENV, "fieldPath": "metadata.labels['pipeline/runid']"} in env
    # sft, prm, and advantage and ppo of each of the 10 iterations (rollout is cached only with cache_sampling)
    assert cached == 2 + 2 * 10


@pytest.mark.parametrize("name, shapes, scratch", [
    # rollout = tensor parallel x engines per pod; evaluate 1; training stages the pool's count
    (QWEN7, {"rollout": 4, "evaluate": 1, "ppo": 4, "sft": 4, "prm": 4}, "35Gi"),  # 2 x 7.62e9 B = 14.2 GiB + 20
    (PPO7, {"rollout": 4, "evaluate": 1, "prm": 8}, "35Gi"),  # sft and ppo run as TrainJobs (CPU steps)
    (QWEN15, {"rollout": 1, "evaluate": 1, "ppo": 1, "sft": 1, "prm": 1}, "23Gi"),  # 2 x 1.54e9 B = 2.9 GiB + 20
])
def test_gpu_steps_get_their_own_gpu_count_shared_memory_and_scratch(compiled, name, shapes, scratch):
    _, ir, platform = compiled[name]
    seen = set()
    for _, t, comp in tasks(ir):
        stage = t["taskInfo"]["name"].split("-")[0].split(" ")[0]
        res = ir["deploymentSpec"]["executors"][comp["executorLabel"]]["container"].get("resources", {})
        gpus = int(res.get("accelerator", {}).get("resourceCount", 0))
        mounts = {m["mountPath"]: m for m in platform[comp["executorLabel"]].get("emptyDirMounts", [])}
        if stage in shapes:
            seen.add(stage)
            assert gpus == shapes[stage], t["taskInfo"]["name"]
            assert mounts["/dev/shm"] == {"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi",
                                          "volumeName": "dshm"}
            assert mounts["/scratch"]["sizeLimit"] == scratch
        else:
            assert gpus == 0 and "/dev/shm" not in mounts, t["taskInfo"]["name"]
    assert seen == set(shapes)


def test_evaluate_on_an_eight_gpu_pool_holds_one_gpu_and_its_share_of_cpu_and_memory(compiled):
    _, ir, _ = compiled[PPO7]
    res = ir["deploymentSpec"]["executors"]["exec-evaluate"]["container"]["resources"]
    assert res["resourceCpuLimit"] == "12" and res["resourceMemoryLimit"] == "125G"  # 96 cpu, 1000G over 8 GPUs


def test_a_plain_directory_cannot_be_imported_on_a_cluster(tmp_path):
    data = yaml.safe_load((CONFIGS / QWEN15).read_text())
    data["pipeline"]["sft_model"] = "/data/checkpoints/sft"
    spec = load_spec(None, data=data)
    with pytest.raises(ConfigError, match=r"pipeline.sft_model is '/data/checkpoints/sft': the KFP backend imports only s3://"):
        compile_to(spec, str(tmp_path / "p.yaml"))
    data["pipeline"]["sft_model"] = "/workspace/models/sft"  # on workspace_pvc: located in place, not imported
    compile_to(load_spec(None, data=data), str(tmp_path / "p.yaml"))
    ir = next(yaml.load_all((tmp_path / "p.yaml").read_text(), Loader=safe_loader()))
    assert "comp-locate" in ir["components"] and not any("importer" in k for k in ir["components"])


def test_a_per_run_workspace_is_declared_when_there_is_no_pvc(tmp_path):
    data = yaml.safe_load((CONFIGS / QWEN15).read_text())
    del data["pipeline"]["cluster"]["workspace_pvc"]
    data["pipeline"]["cluster"]["workspace_size"] = "300Gi"
    data["pipeline"]["cluster"]["workspace_storage_class"] = "standard-rwx"
    compile_to(load_spec(None, data=data), str(tmp_path / "p.yaml"))
    _, platform = yaml.load_all((tmp_path / "p.yaml").read_text(), Loader=safe_loader())
    ws = platform["platforms"]["kubernetes"]["pipelineConfig"]["workspace"]
    assert ws["size"] == "300Gi"
    assert ws["kubernetes"]["pvcSpecPatch"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "standard-rwx"}


# --- the plan against hand computations -----------------------------------------------------------

P7, P15 = 7.62e9, 1.54e9


def rows_of(compiled, name):
    spec, ir, _ = compiled[name]
    sizes = plan.sizes_of(spec, spec.pipeline.cluster.model_params)
    return spec, sizes, plan.walk(ir, sizes)


@pytest.mark.parametrize("name, P, models_per_rollout_pod, critic", [
    (QWEN7, P7, 3, False),   # policy + ref + PRM
    (PPO7, P7, 4, True),     # + critic
    (QWEN15, P15, 3, False),
])
def test_plan_bytes_per_iteration_match_a_hand_computation(compiled, name, P, models_per_rollout_pod, critic):
    spec, sizes, rows = rows_of(compiled, name)
    weights, adam = 2 * P, 12 * P
    assert sizes.weights == weights and sizes.optimizer == adam
    by = {r.name: r for r in rows}
    roll = by["rollout-3"]
    assert roll.pods == spec.pipeline.rollout_shards
    # one policy per engine (a TP group is one engine) read in place, plus the scoring models
    assert roll.workspace_read == models_per_rollout_pod * weights
    # through the object store only the locations: a few KB each
    assert roll.object_store_read == models_per_rollout_pod * plan.LOCATION_BYTES
    ppo = by.get("ppo-3") or by["ppo-3 (trainjob)"]
    models = 2 if critic else 1
    assert ppo.workspace_written == models * (weights + adam)
    assert ppo.workspace_read == weights + (weights if critic else 0) + models * adam
    # zero optimizer bytes through the object store: ppo reads two locations and the advantages
    assert ppo.object_store_read == 2 * plan.LOCATION_BYTES + sizes.advantages
    # advantage reads no model file: at most the 512-byte KL state beside the rollouts
    adv = by["advantage-3"]
    assert adv.object_store_read - spec.pipeline.rollout_shards * sizes.rollouts_per_shard < 1e6
    assert adv.workspace_read == 0
    # the run's storage: sft + prm weights, and every iteration's policy (+ critic) and Adam state
    assert plan.storage(spec, sizes) == 2 * weights + spec.pipeline.iterations * models * (weights + adam)


def test_plan_for_the_7b_recipe_reads_the_policy_once_per_engine_and_moves_no_optimizer_bytes(compiled):
    spec, sizes, rows = rows_of(compiled, QWEN7)
    it = plan.per_iteration(rows)
    object_store = sum(r.pods * r.object_store_read for r in it)
    # iteration 1: 4 rollout pods x 3 locations + advantage (4 rollout shards) + ppo (2 locations + advantages)
    hand = 4 * 3 * plan.LOCATION_BYTES + 4 * sizes.rollouts_per_shard + 2 * plan.LOCATION_BYTES + sizes.advantages
    assert object_store == pytest.approx(hand)
    assert object_store < 0.5e9  # was ~1.3 TB with the checkpoints as artifacts (docs/cluster-data-flow.md)
    text = plan.render(spec, P7, plan.parse_quantity("1Ti"))
    assert "workspace needed for the run: 1097 GB" in text  # 2 x 15.24 + 10 x (15.24 + 91.44)
    assert "warning: the workspace needs 1097 GB for this run and is 1100 GB" not in text
    assert "warning: the workspace needs 1097 GB" in plan.render(spec, P7, plan.parse_quantity("1000G"))


# --- locations ------------------------------------------------------------------------------------

def test_a_location_names_the_workspace_copy_and_a_missing_file_is_a_clear_error(tmp_path):
    out = tmp_path / "ws" / "ppo-0-abc"
    (out / "policy").mkdir(parents=True)
    (out / "policy" / "model.safetensors").write_bytes(b"x" * 100)
    (out / "kl_state.json").write_text('{"kl_coef": 0.1}')
    from prmflow.components.data import io
    io.write_json_atomic(out / "manifest.json", io.build_manifest(out, "ppo"))
    meta = kfp_shim.write_location(str(tmp_path / "artifact"), str(out), "policy")
    assert meta["where"] == str(out / "policy") and meta["bytes"] == 100
    assert kfp_shim.located(str(tmp_path / "artifact"), verify=True) == str(out / "policy")
    assert kfp_shim.located(str(tmp_path / "plain")) == str(tmp_path / "plain")  # an artifact holding its files
    (out / "policy" / "model.safetensors").write_bytes(b"x" * 99)
    with pytest.raises(DataError, match=r"model.safetensors.*is missing or not 100 bytes"):
        kfp_shim.located(str(tmp_path / "artifact"))


def test_the_workspace_path_depends_on_config_and_inputs_not_on_the_run():
    a = kfp_shim.workspace_output("/ws", "ppo-1", "ppo", {"lr": 1}, {"policy": "f1"})
    assert a == kfp_shim.workspace_output("/ws", "ppo-1", "ppo", {"lr": 1}, {"policy": "f1"})
    assert a != kfp_shim.workspace_output("/ws", "ppo-1", "ppo", {"lr": 2}, {"policy": "f1"})
    assert a != kfp_shim.workspace_output("/ws", "ppo-1", "ppo", {"lr": 1}, {"policy": "f2"})
