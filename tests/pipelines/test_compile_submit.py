"""The compiled pipeline spec, submission to a (fake) KFP API server, images and stage re-runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.pipelines import commands, step
from prmflow.pipelines.settings import load_spec, safe_loader

from .fake_kfp import FakeKfp

ROOT = Path(__file__).resolve().parents[2]
CPU_IMAGE = "registry.example.com/ml/prmflow-cpu@sha256:" + "c" * 64
GPU_IMAGE = "registry.example.com/ml/prmflow-gpu@sha256:" + "9" * 64
IMAGES = f"--set=images.cpu={CPU_IMAGE} --set=images.gpu={GPU_IMAGE}".split()  # for the configs/cluster recipes
#: A config without workspace_pvc runs on KFP's per-run workspace, which KFP < 2.17 refuses without a storage class.
STORAGE = ["--set=cluster.workspace_storage_class=standard-rwx"]
CLUSTER_YAML = f"""
pipeline:
  iterations: 3
  rollout_shards: 4
  images: {{cpu: "{CPU_IMAGE}", gpu: "{GPU_IMAGE}", pull_secrets: [regcred]}}
  cluster:
    retries: 3
    backoff: 90s
    mlflow_secret: mlflow-creds
    object_store_secret: s3-creds
    workspace_pvc: prmflow-workspace
    gpu_pool:
      node_selector: {{cloud.google.com/gke-nodepool: a100-pool}}
      tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
      accelerator_type: nvidia.com/gpu
      accelerator_count: 2
      memory: 80G
    cpu_pool:
      node_selector: {{cloud.google.com/gke-nodepool: cpu-pool}}
ppo:
  optim:
    lr: 1.0e-6
"""
GPU_STAGES = ("sft", "prm", "rollout", "ppo")


def compile_spec(tmp_path, text=CLUSTER_YAML, monkeypatch=None):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(text)
    out = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out)]) == 0
    docs = list(yaml.load_all(out.read_text(), Loader=safe_loader()))
    spec, platform = docs[0], (docs[1] if len(docs) > 1 else {})
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"], out.read_text()


def executor_of(spec, stage):
    """exec-<stage> names of the component's executors (KFP suffixes repeats: exec-rollout-2...)."""
    return sorted(e for e in spec["deploymentSpec"]["executors"] if re.fullmatch(f"exec-{stage}(-\\d+)?", e))


def all_tasks(spec):
    tasks = dict(spec["root"]["dag"]["tasks"])
    for comp in spec["components"].values():
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    return tasks


def test_every_stage_is_in_the_dag_unrolled_per_iteration(tmp_path):
    spec, _, _ = compile_spec(tmp_path)
    names = [t["taskInfo"]["name"] for t in all_tasks(spec).values()]
    for stage in ("init-tracking", "sft", "prm"):
        assert names.count(stage) == 1, stage
    for k in range(3):
        assert f"advantage-{k}" in names and f"ppo-{k}" in names and f"rollout-{k}" in names
    assert names.count("finish-tracking") == 1
    loops = [t for t in all_tasks(spec).values() if "parameterIterator" in t]
    assert len(loops) == 3
    assert all(json.loads(t["parameterIterator"]["items"]["raw"]) == [0, 1, 2, 3] for t in loops)
    exit_tasks = [t for t in all_tasks(spec).values()
                  if t.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"]
    assert [t["taskInfo"]["name"] for t in exit_tasks] == ["finish-tracking"]


def test_kfp_wires_the_graph_without_walking_the_callers_stack(monkeypatch):
    """KFP calls inspect.stack() in every task setting; under pytest-xdist or `python -m` each frame of the
    caller's without a file behind it costs a scan of sys.modules (10-14 s a compile in the test suite).
    build() wires the graph on a fresh thread, so KFP's walk never reaches the caller's frames."""
    import inspect

    from prmflow.pipelines.pipeline import build

    seen: list[set[str]] = []
    real = inspect.stack

    def stack(*args, **kwargs):
        frames = real(*args, **kwargs)
        seen.append({f.function for f in frames})
        return frames

    monkeypatch.setattr(inspect, "stack", stack)
    graph = build(load_spec(None, data=yaml.safe_load(CLUSTER_YAML)))
    assert graph.name == "prmflow"
    assert len(seen) > 50 and all("prmflow_pipeline" in names for names in seen)  # KFP did walk, from the wiring
    assert not [names for names in seen if "test_kfp_wires_the_graph_without_walking_the_callers_stack" in names]


def test_gpu_stages_get_accelerators_node_pool_and_tolerations_advantage_does_not(tmp_path):
    spec, platform, _ = compile_spec(tmp_path)
    for stage in GPU_STAGES:
        for ex in executor_of(spec, stage):
            res = spec["deploymentSpec"]["executors"][ex]["container"]["resources"]
            want = 1 if stage == "rollout" else 2  # rollout: tensor parallel 1 x 1 engine per pod (cluster.gpus)
            assert res["accelerator"]["resourceType"] == "nvidia.com/gpu" and int(res["accelerator"]["resourceCount"]) == want
            assert platform[ex]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "a100-pool"}
            assert platform[ex]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            assert platform[ex]["pvcMount"][0]["mountPath"] == "/workspace"
    for ex in executor_of(spec, "advantage"):
        assert "accelerator" not in spec["deploymentSpec"]["executors"][ex]["container"].get("resources", {})
        assert platform[ex]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}
        assert "tolerations" not in platform[ex]
    assert spec["deploymentSpec"]["executors"]["exec-advantage"]["container"]["image"] == CPU_IMAGE
    assert spec["deploymentSpec"]["executors"]["exec-ppo"]["container"]["image"] == GPU_IMAGE
    for ex, body in spec["deploymentSpec"]["executors"].items():  # every pod pulls with the configured secret
        if "container" in body:
            assert [s["secretName"] for s in platform[ex]["imagePullSecret"]] == ["regcred"], ex


def test_steps_start_the_stage_without_installing_kfp(tmp_path):
    """The images carry prmflow and its pinned kfp: a step runs the installed `prmflow pipeline step` (KFP's
    executor on the installed function) straight away: no pip install at every pod start, which needs an index
    the cluster may not reach, and no Python source in the spec. Every step it names is one it knows."""
    spec, _, _ = compile_spec(tmp_path)
    executors = {name: ex["container"] for name, ex in spec["deploymentSpec"]["executors"].items() if "container" in ex}
    assert executors
    for name, container in executors.items():
        assert container["command"] == ["prmflow", "pipeline", "step"], name
        assert container["args"][:2] == ["--executor_input", "{{$}}"], name
        assert container["args"][3] in step.step_functions(), name
        assert not re.search(r"\bpip\b|\bdef\b", json.dumps(container)), name


def test_run_local_splits_the_cores_between_rollout_shards_that_run_at_once(tmp_path, monkeypatch):
    """kfp.local runs two ParallelFor iterations at once: each rollout shard gets half the cores (at least 1),
    set as the task's OMP_NUM_THREADS; a compiled pipeline (a cluster: a pod per shard) sets none."""
    import os

    cores = len(os.sched_getaffinity(0))
    assert commands.local_shard_threads(2, environ={}) == max(1, cores // 2)
    assert commands.local_shard_threads(4, environ={}) == max(1, cores // 2)  # still two at a time
    assert commands.local_shard_threads(1, environ={}) is None  # one shard runs alone: torch's default
    assert commands.local_shard_threads(2, environ={"OMP_NUM_THREADS": "3"}) is None  # the user's setting wins
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert commands.local_shard_threads(2, environ={}) == 1

    from kfp import compiler

    from prmflow.pipelines.pipeline import build

    spec = load_spec(None, data=yaml.safe_load(CLUSTER_YAML))
    for threads, expected in ((3, [{"name": "OMP_NUM_THREADS", "value": "3"}]), (None, None)):
        out = tmp_path / f"local-{threads}.yaml"
        compiler.Compiler().compile(build(spec, shard_threads=threads), package_path=str(out))
        executors = list(yaml.load_all(out.read_text(), Loader=safe_loader()))[0]["deploymentSpec"]["executors"]
        for name, ex in executors.items():
            # (GPU steps also point TMPDIR at their /scratch emptyDir: not the subject here)
            env = [e for e in ex.get("container", {}).get("env", []) if e["name"] != "TMPDIR"] or None
            assert env == (expected if re.fullmatch(r"exec-rollout(-\d+)?", name) else None), (name, env)


def test_secrets_only_by_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2-secret-value")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-xyz")
    spec, platform, text = compile_spec(tmp_path)
    assert "hunter2-secret-value" not in text and "aws-secret-value-xyz" not in text
    refs = platform["exec-ppo"]["secretAsEnv"]
    assert {r["secretName"] for r in refs} == {"mlflow-creds", "s3-creds"}
    keys = {kv["envVar"] for r in refs for kv in r["keyToEnv"]}
    assert {"MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"} <= keys


def test_caching_and_retries_as_configured(tmp_path):
    spec, _, _ = compile_spec(tmp_path)
    by_name = {t["taskInfo"]["name"]: t for t in all_tasks(spec).values()}
    assert by_name["sft"]["cachingOptions"]["enableCache"] is True
    assert by_name["advantage-0"]["cachingOptions"]["enableCache"] is True
    assert by_name["rollout-1"]["cachingOptions"].get("enableCache", False) is False  # sampling
    assert by_name["init-tracking"]["cachingOptions"].get("enableCache", False) is False
    for name in ("sft", "prm", "rollout-0", "ppo-2"):
        retry = by_name[name]["retryPolicy"]
        assert retry["maxRetryCount"] == 3 and retry["backoffDuration"] == "90s" and retry["backoffFactor"] == 2
    assert "retryPolicy" not in by_name["advantage-0"]
    off, _, _ = compile_spec(tmp_path, CLUSTER_YAML.replace("retries: 3", "retries: 3\n    cache: false"))
    assert not any(t.get("cachingOptions", {}).get("enableCache") for t in all_tasks(off).values())


def test_stage_sections_become_grouped_pipeline_parameters(tmp_path):
    spec, _, _ = compile_spec(tmp_path)
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"sft_config", "prm_config", "rollout_config", "advantage_config", "ppo_config", "tracking_uri"} <= set(params)
    # as written, with the LR schedule's span filled in from pipeline.iterations (a Struct's numbers are floats)
    assert params["ppo_config"]["defaultValue"] == {"optim": {"lr": 1e-6}, "rl_iterations": 3.0}


def test_typo_in_a_stage_section_fails_at_compile_time(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("ppo:\n  lrr: 0.1\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "[ppo]: 'lrr' is not a config key. Did you mean 'optim.lr'?" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("text,says", [
    ("sft:\n  max_steps: 3\n   lr: 2\n",
     "is not valid YAML: mapping values are not allowed here\n  in \"{cfg}\", line 3, column 6"),
    ("sft:\n  max_steps: [1\n", "is not valid YAML"),
    ("sft: 3\n", "section 'sft' must be a mapping of its keys"),
    ("pipeline: [iterations, 2]\n", "section 'pipeline' must be a mapping of its keys"),
    (b"\xff\xfe", "is not a YAML text file"),
    (None, "is a directory; pass the YAML file itself to --config"),
    # a section written twice: YAML keeps the last and the first (here sft's max_steps) was dropped without a word
    ("sft:\n  max_steps: 3\nppo:\n  epochs: 1\nsft:\n  lora_r: 4\n",
     "key 'sft' is written twice in one mapping (first on line 1)"),
    ("ppo:\n  epochs: 1\n  optim: {lr: 1.0e-5, lr: 3.0e-5}\n", "key 'lr' is written twice in one mapping (first on line 3)"),
])
def test_a_pipeline_yaml_that_does_not_parse_is_one_line_naming_the_file(tmp_path, capsys, text, says):
    """An indentation slip in a pipeline YAML was a yaml.ScannerError traceback (exit 1) from compile, plan,
    run-local and compare, and a section that is not a mapping an AttributeError."""
    cfg = tmp_path / "p.yaml"
    if text is None:
        cfg.mkdir()
    else:
        cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    commands = [["compile", "-o", str(tmp_path / "x.yaml")], ["plan"], ["compare", "--root", str(tmp_path / "runs")]]
    for argv in commands[:2] if "section" in says else commands:  # compare asks for its variants: first
        assert cli.main(["pipeline", argv[0], "--config", str(cfg), *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert says.format(cfg=cfg) in err and str(cfg) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_a_stage_set_value_that_is_not_yaml_is_named_by_its_key(tmp_path, capsys):
    """`--set sft.max_steps=[1` (a bracket left open) was a yaml.ParserError traceback; a stage's own --set reads
    such a value as text and names the key it does not fit, and so does the pipeline's."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("sft:\n  max_steps: 3\n  optim: {warmup_steps: 0}\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "--set", "sft.max_steps=[1",
                     "-o", str(tmp_path / "x.yaml")]) == 2
    assert "--set [sft]: key 'max_steps' must be int, got '[1'." in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_a_prompt_prefix_that_differs_between_stages_fails_at_compile_time(tmp_path, capsys):
    """The policy would be trained on one prompt and rolled out or tested on another."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("sft:\n  arithmetic: {prompt_prefix: ''}\nrollout:\n  arithmetic: {prompt_prefix: ''}\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "arithmetic.prompt_prefix differs between stages" in err
    assert "[sft] ''" in err and "[prm] 'Compute left to right: '" in err and "[evaluate] 'Compute left to right: '" in err
    assert not (tmp_path / "x.yaml").exists()
    same = "\n".join(f"{s}:\n  arithmetic: {{prompt_prefix: ''}}" for s in ("sft", "prm", "rollout", "evaluate"))
    cfg.write_text(same + "\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "x.yaml"), *IMAGES, *STORAGE]) == 0
    spec = next(yaml.load_all((tmp_path / "x.yaml").read_text(), Loader=safe_loader()))
    sections = spec["root"]["inputDefinitions"]["parameters"]
    assert sections["rollout_config"]["defaultValue"]["arithmetic"] == {"prompt_prefix": ""}
    cfg.write_text(same + "\nppo:\n  ptx_coef: 0.1\n")  # ppo's SFT (ptx) loss trains on arithmetic prompts too
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "y.yaml")]) == 2
    assert "[ppo] 'Compute left to right: '" in capsys.readouterr().err


def test_submit_uploads_the_package_and_parameters(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(CLUSTER_YAML)
    with FakeKfp() as kfp_server:
        code = cli.main(["pipeline", "submit", "--host", kfp_server.url, "--config", str(cfg), "--experiment", "prm-rl",
                         "--run-name", "try-1", "--param", 'ppo_config={"epochs": 2}', "--param", "tracking_uri=http://mlflow:5000"])
    assert code == 0
    posts = [r for r in kfp_server.requests if r["method"] == "POST"]
    assert [r["path"] for r in posts] == ["/apis/v2beta1/experiments", "/apis/v2beta1/runs"]
    assert posts[0]["body"]["display_name"] == "prm-rl"
    run = posts[1]["body"]
    assert run["display_name"] == "try-1" and run["experiment_id"] == "exp-1"
    # merged into the compiled ppo section (optim.lr 1e-6 and the filled rl_iterations stay; KFP alone would have replaced
    # the whole dict)
    sent = dict(run["runtime_config"]["parameters"])
    assert sent.pop("chain_id").startswith("chain-")  # its MLflow parent run, reused when submitted again (chain.py)
    assert sent == {"ppo_config": {"optim": {"lr": 1e-6}, "epochs": 2, "rl_iterations": 3}, "tracking_uri": "http://mlflow:5000"}
    uploaded = run["pipeline_spec"]["pipeline_spec"]  # KFP sends {pipeline_spec, platform_spec}
    assert uploaded["pipelineInfo"]["name"] == "prmflow"
    platform = run["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert platform["exec-ppo"]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "a100-pool"}
    assert set(uploaded["root"]["inputDefinitions"]["parameters"]) >= {"sft_config", "ppo_config"}
    assert "exec-ppo" in uploaded["deploymentSpec"]["executors"]


# --- images -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_hadolint_passes(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "images" / dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_are_pinned_by_digest_in_one_place():
    bases = dict(line.split("=", 1) for line in (ROOT / "images/bases.env").read_text().splitlines()
                 if line and not line.startswith("#"))
    assert set(bases) == {"CPU_BASE_IMAGE", "GPU_BASE_IMAGE"}
    assert all(re.search(r"@sha256:[0-9a-f]{64}$", v) for v in bases.values())
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        froms = [ln for ln in (ROOT / "images" / name).read_text().splitlines() if ln.startswith("FROM")]
        # the one image pulled is the pinned base; `scratch` (an empty stage holding the optional local
        # wheels) pulls nothing
        assert [ln for ln in froms if not ln.startswith("FROM scratch ")] == ["FROM ${BASE_IMAGE}"], froms


def test_image_entrypoint_runs_a_stage(tmp_path):
    """Run the CPU image's ENTRYPOINT + a stage command, as `docker run IMAGE advantage ...` would."""
    text = (ROOT / "images/Dockerfile.cpu").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    exe = shutil.which(entrypoint[0]) or str(Path(sys.executable).parent / entrypoint[0])
    out = tmp_path / "policy"
    result = subprocess.run([exe, *entrypoint[1:], "sft", "--max_steps", "2", "--optim.warmup_steps", "0", "--num_prompts", "64",
                             "--eval_size", "4", "--eval_max_new_tokens", "8", "--engine.backend", "torch",
                             "--tracking.enabled", "false", "--output", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "manifest.json").is_file() and (out / "config.json").is_file()
    assert "held-out accuracy" in result.stdout


def test_stage_command_mounts_inputs_of_a_logged_run(tmp_path, sqlite_store, capsys):
    from prmflow.components import config
    from prmflow.components.sft import stage

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=?", "response": f"answer: {i + 1}", "answer": i + 1})
                              for i in range(40)))
    cfg = config.load(stage.Config, overrides={"task": str(data), "eval_size": 4, "max_steps": 2, "optim.warmup_steps": 0,
                                               "micro_batch_size": 8, "engine.backend": "torch", "output": str(tmp_path / "sft"),
                                               "tracking.uri": sqlite_store, "eval_max_new_tokens": 4})
    stage.run(cfg)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(sqlite_store)
    (run,) = client.search_runs([client.get_experiment_by_name("prmflow").experiment_id])
    capsys.readouterr()
    assert cli.main(["stage-command", "sft", "--run-id", run.info.run_id, "--tracking-uri", sqlite_store,
                     "--output", str(tmp_path / "again")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("docker run --rm ")
    assert f"-v {data}:/inputs/task:ro" in line and f"-v {tmp_path / 'again'}:/outputs" in line
    assert "--set task=/inputs/task" in line and "--set output=/outputs/sft" in line and "--set max_steps=2" in line
    assert cli.main(["stage-command", "ppo", "--run-id", run.info.run_id, "--tracking-uri", sqlite_store]) == 2


def test_prm_trains_on_the_sft_policy_and_imported_models_replace_their_stages(tmp_path):
    spec, _, _ = compile_spec(tmp_path)
    tasks = {t["taskInfo"]["name"]: t for t in all_tasks(spec).values()}
    base = tasks["prm"]["inputs"]["artifacts"]["base"]["taskOutputArtifact"]
    assert base == {"outputArtifactKey": "policy", "producerTask": "sft"}

    text = CLUSTER_YAML.replace("pipeline:\n", "pipeline:\n  sft_model: s3://models/sft-7b\n  prm_model: s3://models/prm-7b\n", 1)
    spec, _, _ = compile_spec(tmp_path, text)
    names = [t["taskInfo"]["name"] for t in all_tasks(spec).values()]
    assert "sft" not in names and "prm" not in names
    importers = {e["importer"]["artifactUri"]["constant"] for e in spec["deploymentSpec"]["executors"].values()
                 if "importer" in e}
    assert importers == {"s3://models/sft-7b", "s3://models/prm-7b"}
    # every rollout still waits for the parent MLflow run, which nothing upstream of it creates now
    # (KFP hoists the rollout's dependency onto its ParallelFor)
    loops = [t for t in all_tasks(spec).values() if "parameterIterator" in t]
    assert len(loops) == 3 and all("init-tracking" in t.get("dependentTasks", []) for t in loops)


def test_evaluate_on_vllm_gets_the_gpus_its_engine_takes_or_compile_refuses(tmp_path, capsys):
    spec, _, _ = compile_spec(tmp_path, CLUSTER_YAML + "evaluate:\n  sampler: vllm\n")
    res = spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"]["resources"]
    assert int(res["accelerator"]["resourceCount"]) == 1 and spec["deploymentSpec"]["executors"]["exec-evaluate"][
        "container"]["image"] == GPU_IMAGE  # the image with vLLM
    cfg = tmp_path / "two.yaml"
    cfg.write_text(CLUSTER_YAML + "evaluate:\n  sampler: vllm\n  vllm: {tensor_parallel_size: 2}\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "two-compiled.yaml")]) == 2
    assert "pipeline.cluster.gpus.evaluate is 1" in capsys.readouterr().err and not (tmp_path / "two-compiled.yaml").exists()
    cfg.write_text(CLUSTER_YAML.replace("  cluster:\n", "  cluster:\n    gpus: {evaluate: 2}\n")
                   + "evaluate:\n  sampler: vllm\n  vllm: {tensor_parallel_size: 2}\n")
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "two-compiled.yaml")]) == 0


def test_compile_to_a_name_kfp_cannot_write_is_refused_and_the_file_there_is_kept(tmp_path, capsys):
    """KFP writes platform settings only to YAML: for `-o notes.json` it opened the path, then raised, and the
    clean-up removed what was there, a file of the user's."""
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(CLUSTER_YAML)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(notes)]) == 2
    err = capsys.readouterr().err
    assert "name the output .yaml or .yml" in err and "Traceback" not in err
    assert notes.read_text() == '{"mine": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "pipeline.yaml"]
    (tmp_path / "made.yaml").mkdir()  # a directory by that name, and a folder that is not there: one line each
    for out, says in ((tmp_path / "made.yaml", "made.yaml is a directory"),
                      (tmp_path / "nowhere" / "p.yaml", "which is not a directory")):
        assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made.yaml", "notes.json", "pipeline.yaml"]
    assert list((tmp_path / "made.yaml").iterdir()) == []


def test_compile_without_o_keeps_a_config_named_pipeline_yaml(tmp_path, monkeypatch, capsys):
    """-o defaults to pipeline.yaml: `prmflow pipeline compile --config pipeline.yaml` replaced the user's config
    with the compiled spec. A file there that is not a compiled spec is kept; a spec compiled before is replaced."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipeline.yaml").write_text(CLUSTER_YAML)
    assert cli.main(["pipeline", "compile", "--config", "pipeline.yaml"]) == 2
    assert "pipeline.yaml exists and is not a compiled pipeline" in capsys.readouterr().err
    assert (tmp_path / "pipeline.yaml").read_text() == CLUSTER_YAML
    (tmp_path / "compiled.yaml").write_text("# PIPELINE DEFINITION\npipelineInfo: {name: old}\nroot: {}\n")  # an older compile
    assert cli.main(["pipeline", "compile", "--config", "pipeline.yaml", "-o", "compiled.yaml"]) == 0
    assert "pipelineInfo" in next(yaml.load_all((tmp_path / "compiled.yaml").read_text(), Loader=safe_loader()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compiled.yaml", "pipeline.yaml"]


def test_submit_given_a_config_as_package_says_so(tmp_path, capsys):
    """`pipeline submit --package my-cluster.yaml` (a config, not a compiled spec) was a KeyError traceback."""
    cfg = tmp_path / "my-cluster.yaml"
    cfg.write_text(CLUSTER_YAML)
    assert cli.main(["pipeline", "submit", "--package", str(cfg), "--dry-run"]) == 2
    assert f"--package {cfg} is not a compiled pipeline spec; give a pipeline config with --config" in capsys.readouterr().err


def test_a_misspelt_stage_in_set_suggests_the_stage(tmp_path, capsys):
    """`--set sfft.max_steps=3` was read as a pipeline: key: "'sfft.max_steps' is not a config key", no hint."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(CLUSTER_YAML)
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "--set", "sfft.max_steps=3",
                     "-o", str(tmp_path / "x.yaml")]) == 2
    assert "--set 'sfft.max_steps=3': 'sfft' is not a stage. Did you mean 'sft.max_steps'?" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
