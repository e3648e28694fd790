"""How big a run grows on the cluster (pipelines/size.py, contracts/argo.py), and the refusals built on it.

The model of the compiled layout is checked against KFP's own compiled workflows (tests/pipelines/data/
kfp-2.17.0, copied from kubeflow/pipelines@2.17.0 test_data); the limits are Argo's, etcd's and Linux's,
each cited in contracts/argo.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.pipelines import kfp_components as components, pipeline, size
from prmflow.pipelines.contracts import argo as rules
from prmflow.pipelines.params import load_with_sets
from prmflow.pipelines.settings import safe_loader

from .fake_kfp import FakeKfp
from .test_compile_submit import CLUSTER_YAML, IMAGES

DATA = Path(__file__).parent / "data" / "kfp-2.17.0"
ROOT = Path(__file__).resolve().parents[2]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=safe_loader()) if d]


@pytest.mark.parametrize("pipeline", ["pipeline_with_exit_handler", "pipeline_with_loops"])
def test_the_spec_model_matches_what_kfps_argo_compiler_writes(pipeline):
    """The Workflow KFP 2.17's compiler wrote for its own test pipelines, as JSON (what etcd and Argo's size
    check count), against the model of it built from the pipeline spec alone: within 3 %."""
    real = len(json.dumps(yaml.safe_load((DATA / f"{pipeline}.argo.yaml").read_text()), separators=(",", ":")))
    modelled = size.spec_bytes(_docs(DATA / f"{pipeline}.ir.yaml"))
    assert abs(modelled - real) / real < 0.03, (modelled, real)


def test_component_specs_and_implementations_are_stored_once_per_container():
    """KFP stores a component spec and its implementation once per distinct container (hashComponentContainer):
    the loops pipeline's three print-text tasks share one. The model stores the same arguments (its hashes are
    of Python's JSON, not Go's proto marshalling: compared by kind), and the same per-DAG templates."""
    real = yaml.safe_load((DATA / "pipeline_with_loops.argo.yaml").read_text())["spec"]
    modelled = size.argo_spec(_docs(DATA / "pipeline_with_loops.ir.yaml"))["spec"]

    def kinds(spec):
        return sorted(re.sub(r"-[0-9a-f]{64}$", "-HASH", p["name"]) for p in spec["arguments"]["parameters"])

    assert kinds(modelled) == kinds(real)
    assert kinds(real).count("implementations-HASH") == 3  # five container tasks, three distinct containers
    system = {"system-container-driver", "system-container-executor", "system-container-impl", "system-dag-driver"}
    real_names = sorted(t["name"] for t in real["templates"] if t["name"] not in system)
    assert sorted(t["name"] for t in modelled["templates"]) == real_names


def _cluster_spec(tmp_path, iterations: int, kfp: str = "2.15"):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(CLUSTER_YAML)
    return load_with_sets(str(cfg), [f"pipeline.iterations={iterations}", f"cluster.kfp_version={kfp}"])


def test_sizes_grow_linearly_so_two_compiles_predict_a_longer_run(tmp_path):
    """The capacity (measured at 2 and 4 iterations) predicts the modelled sizes at 12 within 3 %."""
    spec = _cluster_spec(tmp_path, 12)
    for kfp in ("2.15", "2.17"):
        cap = pipeline.run_capacity(spec, kfp)
        real = size.measure(pipeline.compiled_docs(spec, 12), kfp)
        predicted = cap.at(12)
        for part, value in (("spec", real.spec), ("stored_compressed", real.spec + real.compressed),
                            ("component_arg", real.component_arg), ("nodes", real.nodes)):
            assert abs(predicted[part] - value) / value < 0.03, (kfp, part, predicted[part], value)


def test_every_template_retries_on_kfp_2_17_so_its_nodes_store_their_inputs_twice(tmp_path):
    """KFP 2.17's controller config gives every template a retryStrategy (a Retry parent per node, with the
    inputs and outputs again); 2.15 and 2.16 only the tasks that set a retry policy."""
    docs = pipeline.compiled_docs(_cluster_spec(tmp_path, 2), 2)
    kinds = {v: [n["type"] for n in size.node_status(docs, v).values()] for v in ("2.15", "2.17")}
    assert kinds["2.17"].count("Retry") == len(kinds["2.17"]) // 2
    gpu_pods = kinds["2.15"].count("Retry")  # the GPU tasks' executors (cluster.retries: 3)
    assert 0 < gpu_pods < kinds["2.15"].count("Pod")
    assert size.measure(docs, "2.17").nodes > 1.5 * size.measure(docs, "2.15").nodes


def test_argo_keeps_raw_nodes_while_they_fit_and_compresses_them_after():
    """packer.go: the nodes stay as JSON while the whole workflow fits MAX_WORKFLOW_SIZE; past it, only the
    gzipped and base64-encoded nodes count."""
    small = size.RunSize("2.15", spec=100_000, nodes=500_000, compressed=40_000, component_arg=0)
    large = size.RunSize("2.15", spec=100_000, nodes=2_000_000, compressed=140_000, component_arg=0)
    assert small.stored == 600_000
    assert large.stored == 240_000
    assert rules.MAX_WORKFLOW_SIZE == 1 << 20


def test_the_largest_run_is_the_last_count_within_every_limit(tmp_path):
    """max_iterations is the largest n whose modelled parts all stay within (1 - margin) x their limits:
    n fits, n + 1 does not, by the same linear model; the refusal names pipeline.iterations and the count."""
    spec = _cluster_spec(tmp_path, 2)
    cap = pipeline.run_capacity(spec, "2.15")
    n, binding = cap.max_iterations()
    limit = size.limits("2.15")[binding][0] * (1 - size.MARGIN)
    part = {"stored": "stored_compressed"}.get(binding, binding)
    assert cap.at(n)[part] <= limit < cap.at(n + 1)[part]
    assert size.too_long(cap, n) is None
    refusal = size.too_long(cap, n + 1)
    assert f"pipeline.iterations is {n + 1}" in refusal and f"at most {n}" in refusal and "1024 KiB" in refusal


def test_compile_refuses_a_run_the_cluster_would_stop_and_writes_nothing(tmp_path, capsys):
    """One run (pipeline.run_iterations = iterations) past the modelled limit: exit 2, an error naming
    pipeline.iterations and the limit, no file. (Left to itself, compile makes such a run a chain: test_chain_compile.)"""
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(CLUSTER_YAML)
    n, _ = pipeline.run_capacity(_cluster_spec(tmp_path, 2), "2.15").max_iterations()
    out = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "--set", f"pipeline.iterations={n + 1}",
                     "--set", f"pipeline.run_iterations={n + 1}", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"pipeline.iterations is {n + 1}" in err and f"at most {n}" in err and "packer.go" in err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "--set", f"pipeline.iterations={n}",
                     "-o", str(out)]) == 0


def test_plan_prints_how_many_iterations_one_run_holds_on_each_version(capsys):
    """`plan` of a cluster recipe: the target version's count with the margin, and the other versions'."""
    recipe = ROOT / "configs" / "cluster" / "qwen2.5-math-1.5b-gsm8k-math.yaml"
    assert cli.main(["pipeline", "plan", "--config", str(recipe), *IMAGES]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "one run holds at most" in line]
    assert [line.split("KFP ")[1][:4] for line in lines] == ["2.15", "2.16", "2.17"]
    assert lines[0].startswith("run size:") and f"{size.MARGIN:.0%} of each limit kept free" in lines[0]


def test_a_step_run_by_the_installed_prmflow_writes_what_the_lightweight_component_writes(tmp_path):
    """`prmflow pipeline step` (a cluster step's command) and the lightweight component's own command (KFP ships
    the function's source and runs it with python3 -m kfp.dsl.executor_main: what run-local and the spec did
    before) on the same executor input: the same output metadata and the same location file."""
    model = tmp_path / "weights"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)

    def executor_input(out: Path) -> dict:
        return {"inputs": {"parameterValues": {"path": str(model)}},
                "outputs": {"artifacts": {"model": {"artifacts": [{"name": "m", "type": {"schemaTitle": "system.Model",
                            "schemaVersion": "0.0.1"}, "uri": str(out / "model"), "metadata": {}}]}},
                            "outputFile": str(out / "output_metadata.json")}}

    container, lightweight = tmp_path / "container", tmp_path / "lightweight"
    assert cli.main(["pipeline", "step", "--executor_input", json.dumps(executor_input(container)),
                     "--function_to_execute", "locate"]) == 0
    spec = pipeline.step_component(components.locate, "unused-image", local=True).component_spec.implementation.container
    args = [json.dumps(executor_input(lightweight)) if a == "{{$}}" else a for a in spec.args]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([*spec.command, *args], check=True, env=env, capture_output=True)

    def outputs(out: Path) -> tuple[str, str]:
        return ((out / "output_metadata.json").read_text().replace(str(out), "OUT"),
                (out / "model" / "location.json").read_text())

    assert outputs(container) == outputs(lightweight)
    assert json.loads(outputs(container)[1])["where"] == str(model)


def test_a_step_the_image_does_not_know_is_refused_by_name(capsys):
    assert cli.main(["pipeline", "step", "--executor_input", "{}", "--function_to_execute", "nope"]) == 2
    assert "'nope' is no prmflow step" in capsys.readouterr().err


def test_submit_checks_a_package_against_the_servers_own_version(tmp_path, capsys):
    """A package compiled for 2.15 with more iterations than one 2.17 run holds: a 2.15 server takes it, a 2.17
    server's run is not created (Retry nodes on every template make 2.17's status larger)."""
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(CLUSTER_YAML)
    spec = _cluster_spec(tmp_path, 2)
    fits = {v: pipeline.run_capacity(spec, v).max_iterations()[0] for v in ("2.15", "2.17")}
    n = fits["2.17"] + 1
    assert n <= fits["2.15"]
    package = tmp_path / "compiled.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "--set", f"pipeline.iterations={n}",
                     "--set", f"pipeline.run_iterations={n}", "-o", str(package)]) == 0  # one run, as 2.15 holds it
    for version, code in (("2.15.0", 0), ("2.17.0", 2)):
        with FakeKfp(version=version) as server:
            assert cli.main(["pipeline", "submit", "--host", server.url, "--package", str(package)]) == code
        assert len(server.runs) == (1 if code == 0 else 0)
    err = capsys.readouterr().err
    assert "KFP at" in err and "is 2.17.0" in err and "pipeline.iterations" in err and "packer.go" in err
