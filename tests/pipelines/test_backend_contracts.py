"""The compiled pipeline and its TrainJobs against the rules of every backend version we support.

KFP (2.15, 2.16, 2.17): every task that opens state on the workspace gets it mounted under the driver's
rule, and the per-run workspace's claim is one that version's compiler accepts (contracts/kfp.py).
Kubeflow Trainer (v2.2.0, v2.2.1, v2.3.0): every TrainJob a step submits passes that version's webhook
and the openAPIV3Schema of its CRD (contracts/trainer.py, tests/data/trainer/).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.pipelines import compat, trainjob
from prmflow.pipelines.contracts import KFP_VERSIONS
from prmflow.pipelines.contracts import kfp as kfp_rules
from prmflow.pipelines.contracts import trainer as trainer_rules
from prmflow.pipelines.pipeline import compile_to
from prmflow.pipelines.settings import load_spec, safe_loader

from .fake_k8s import FakeK8s, crd_schema, runtime_cr

ROOT = Path(__file__).resolve().parents[2]
TRAINER_TAGS = ("v2.2.0", "v2.2.1", "v2.3.0")
#: Every pipeline recipe in configs/ (compare.yaml without its variants: each variant is the same DAG).
RECIPES = sorted(p.relative_to(ROOT / "configs").as_posix() for p in [*(ROOT / "configs").glob("*.yaml"),
                                                                      *(ROOT / "configs" / "cluster").glob("*.yaml")]
                 if "pipeline" in (yaml.safe_load(p.read_text()) or {}))
QUICK = ["quickstart.yaml"]


def recipe(name: str, pvc: bool) -> dict:
    """The recipe's config for a cluster: on workspace_pvc, or on KFP's per-run workspace (a storage class
    named, TrainJobs off: they need the shared PVC)."""
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    data.pop("variants", None)
    cluster = data.setdefault("pipeline", {}).setdefault("cluster", {})
    if pvc:
        cluster["workspace_pvc"] = cluster.get("workspace_pvc") or "prmflow-rwx"
    else:
        cluster.pop("workspace_pvc", None)
        cluster.pop("trainer", None)
        cluster["workspace_storage_class"] = "rwx-class"
    return data


_compiled: dict[tuple[str, bool], list[dict]] = {}
_texts: dict[tuple[str, bool], str] = {}


def compiled(tmp_path_factory, name: str, pvc: bool) -> list[dict]:
    """The YAML documents of the recipe compiled for a cluster, once per session (read with PyYAML's
    pure-Python SafeLoader: the reference the C loader compile_to uses is checked against)."""
    if (name, pvc) not in _compiled:
        path = tmp_path_factory.mktemp("ir") / "p.yaml"
        compile_to(load_spec(None, data=recipe(name, pvc)), str(path))
        _texts[name, pvc] = path.read_text()
        _compiled[name, pvc] = [d for d in yaml.load_all(_texts[name, pvc], Loader=yaml.SafeLoader) if d]
    return _compiled[name, pvc]


def test_a_compiled_spec_reads_back_as_pyyamls_safe_loader_reads_it_and_as_safely(tmp_path_factory, monkeypatch):
    """compile_to, plan and submit read compiled specs with settings.safe_loader (libyaml's C loader where
    PyYAML has it): the documents the compat checks see are those of PyYAML's pure-Python SafeLoader, and a
    Python tag is refused, never run."""
    docs = compiled(tmp_path_factory, "cluster/ppo-7b-2x8.yaml", True)  # the largest recipe
    assert yaml.__with_libyaml__  # the CI image has libyaml: the fast loader is the one checked here
    assert [d for d in yaml.load_all(_texts["cluster/ppo-7b-2x8.yaml", True], Loader=safe_loader()) if d] == docs
    for hostile in ("!!python/object/apply:os.getcwd []", "x: !!python/name:os.system"):
        with pytest.raises(yaml.constructor.ConstructorError):
            yaml.load(hostile, Loader=safe_loader())  # a SafeLoader
    monkeypatch.setattr(yaml, "__with_libyaml__", False)  # PyYAML built without libyaml: its own SafeLoader
    assert safe_loader() is yaml.SafeLoader


def check_workspace_mounts(docs: list[dict]) -> None:
    needing = {t.name for t in compat.workspace_tasks(docs[0])}
    # not vacuous: the readers of the policy's location (rollout, evaluate) and the writers are among them
    assert {"rollout-0", "evaluate"} <= needing and any(n.startswith("ppo-0") for n in needing)
    for version in KFP_VERSIONS:
        assert compat.backend_errors(docs, version) == [], version


@pytest.mark.parametrize("pvc", [True, False], ids=["workspace_pvc", "per-run-workspace"])
@pytest.mark.parametrize("name", QUICK)
def test_every_task_that_opens_the_workspace_gets_it_under_each_kfp_version(tmp_path_factory, name, pvc):
    check_workspace_mounts(compiled(tmp_path_factory, name, pvc))


@pytest.mark.slow
@pytest.mark.parametrize("pvc", [True, False], ids=["workspace_pvc", "per-run-workspace"])
@pytest.mark.parametrize("name", [r for r in RECIPES if r not in QUICK])
def test_every_recipe_mounts_the_workspace_where_it_is_read_under_each_kfp_version(tmp_path_factory, name, pvc):
    check_workspace_mounts(compiled(tmp_path_factory, name, pvc))


def test_rollout_and_evaluate_name_the_per_run_workspace_so_the_driver_mounts_it(tmp_path_factory):
    """KFP mounts its per-run workspace only into a task whose parameters name it; rollout and evaluate open
    the policy's location there, so they carry the workspace parameter too."""
    docs = compiled(tmp_path_factory, "quickstart.yaml", False)
    by_name = {t.name: t for t in kfp_rules.executor_tasks(docs[0])}
    for name in ("rollout-0", "rollout-1", "evaluate"):
        assert kfp_rules.WORKSPACE_PLACEHOLDER in by_name[name].parameters["workspace"]
        assert kfp_rules.driver_mounts_workspace(by_name[name].parameters)
    assert not kfp_rules.driver_mounts_workspace(by_name["advantage-0"].parameters)  # reads no location


@pytest.mark.parametrize("key, value", [("workspace_size", "lots"), ("workspace_size", "2TiB"), ("workspace_size", "-2Ti"),
                                        ("workspace_size", "100m"), ("shm_size", "16 GB"), ("scratch_size", "0")])
def test_a_size_kubernetes_or_kfp_would_refuse_is_refused_at_compile_naming_the_key(tmp_path, capsys, key, value):
    """A cluster size that is no positive Kubernetes quantity (the API server refuses the pod or the claim), or a
    workspace size KFP's compiler refuses ('100m': its SDK's own rule), is one error line naming the key: no
    traceback, nothing written."""
    data = recipe("quickstart.yaml", pvc=False)
    data["pipeline"]["images"] = {"cpu": "registry.example.com/c:1", "gpu": "registry.example.com/g:1"}
    data["pipeline"]["cluster"][key] = value
    cfg, out = tmp_path / "p.yaml", tmp_path / "compiled.yaml"
    cfg.write_text(yaml.safe_dump(data))
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"pipeline.cluster.{key}" in err and "Traceback" not in err
    assert not out.exists()


def test_the_plan_reads_sizes_as_kubernetes_does():
    from prmflow.pipelines import plan

    assert plan.parse_quantity("200Gi") == 200 * 2**30 and plan.parse_quantity("1.5T") == 1.5e12
    assert plan.parse_quantity("500M") == 5e8 and plan.parse_quantity("lots") == 0.0 == plan.parse_quantity("")


def test_a_per_run_workspace_without_a_storage_class_is_refused_before_kfp_2_17(tmp_path, capsys):
    """KFP 2.15/2.16's compiler refuses, at run creation, a workspace claim without a storage class; compile
    refuses it first, naming the key, and writes nothing. 2.17 takes the cluster's default class."""
    data = recipe("quickstart.yaml", pvc=False)
    del data["pipeline"]["cluster"]["workspace_storage_class"]
    data["pipeline"]["images"] = {"cpu": "registry.example.com/c:1", "gpu": "registry.example.com/g:1"}
    cfg, out = tmp_path / "p.yaml", tmp_path / "compiled.yaml"
    cfg.write_text(yaml.safe_dump(data))
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Kubeflow Pipelines 2.15" in err and "must specify storageClassName" in err
    assert "pipeline.cluster.workspace_storage_class" in err and "pipeline.cluster.kfp_version" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [cfg]
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(out), "--set", "cluster.kfp_version=2.17"]) == 0
    docs = list(yaml.load_all(out.read_text(), Loader=safe_loader()))
    patch = docs[1]["platforms"]["kubernetes"]["pipelineConfig"]["workspace"]["kubernetes"]["pvcSpecPatch"]
    assert patch == {"accessModes": ["ReadWriteMany"]}
    # the same package, read against each version's compiler rule
    assert [bool(compat.backend_errors(docs, v)) for v in KFP_VERSIONS] == [True, True, False]
    assert compat.backend_errors(docs, "2.16", server_default_class=True) == []  # the API server's template names one


# --- TrainJobs against each Trainer version ---------------------------------------------------------------

def rendered_trainjobs(docs: list[dict], tmp_path: Path, monkeypatch) -> list[dict]:
    """Every TrainJob the compiled spec's trainjob steps would submit, built as the step builds it."""
    specs = []
    for ex in docs[0]["deploymentSpec"]["executors"].values():
        env = {e["name"]: e.get("value") for e in ex.get("container", {}).get("env", [])}
        if trainjob.ENV in env:
            specs.append(trainjob.TrainJobSpec(**json.loads(env[trainjob.ENV])))
    bodies = []
    with FakeK8s() as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
        for spec in specs:
            client = trainjob.client_for(spec)
            runtime = client.get_runtime(spec.runtime)
            bodies.append(trainjob.trainjob_body(client, runtime, spec, "prmflow-ppo-it0-0123456789", "ppo",
                                                 [*trainjob.LAUNCHER, "prmflow", "ppo", "--config", "/w/c.yaml"], "run-1"))
    return bodies


def admitted(body: dict, tag: str) -> list[str]:
    return (trainer_rules.schema_errors(body, crd_schema(tag))
            + trainer_rules.webhook_errors(body, runtime_cr("torch-distributed"), tag))


def test_every_trainjob_passes_each_trainer_versions_webhook_and_crd_schema(tmp_path, monkeypatch):
    from .test_trainjob import CLUSTER_YAML

    data = yaml.safe_load(CLUSTER_YAML.format(workspace="/workspace"))  # secrets, pull secrets, a service account
    data["pipeline"]["cluster"]["trainer"].update(sft="trainjob", prm="trainjob")
    compile_to(load_spec(None, data=data), str(tmp_path / "p.yaml"))
    docs = list(yaml.load_all((tmp_path / "p.yaml").read_text(), Loader=safe_loader()))
    bodies = rendered_trainjobs(docs, tmp_path, monkeypatch)
    assert len(bodies) == 4  # sft, prm, ppo-0, ppo-1
    for body in bodies:
        assert any("secretKeyRef" in e.get("valueFrom", {}) for e in body["spec"]["trainer"]["env"])
        for tag in TRAINER_TAGS:
            assert admitted(body, tag) == [], tag
        # the shape before the fix (secret env on the node container in a runtime patch) is refused by each
        old = copy.deepcopy(body)
        node = old["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        node["template"]["spec"]["template"]["spec"]["containers"][0]["env"] = old["spec"]["trainer"].pop("env")
        for tag in TRAINER_TAGS:
            assert any("must not have envs for the dataset-initializer, model-initializer, node containers" in e
                       for e in admitted(old, tag)), tag


def test_the_trainjob_crd_refuses_a_name_that_is_not_a_dns_label_and_two_env_vars_of_one_name(tmp_path, monkeypatch):
    """Trainer's CRD (contracts/trainer.py NAME_RULE, ENV_LIST_MAP): metadata.name must be an RFC 1035 label of
    at most 63 characters (CEL), spec.trainer.env is a list map keyed by name. Every version's schema, as
    shipped, says so through the same checks the fake API server runs; prmflow's own names pass."""
    from .test_trainjob import CLUSTER_YAML

    data = yaml.safe_load(CLUSTER_YAML.format(workspace="/workspace"))
    compile_to(load_spec(None, data=data), str(tmp_path / "p.yaml"))
    body = rendered_trainjobs(list(yaml.load_all((tmp_path / "p.yaml").read_text(), Loader=safe_loader())),
                              tmp_path, monkeypatch)[0]
    names = {trainjob.job_name("a" * 200, stage, it) for stage in ("sft", "prm", "ppo") for it in (None, 0, 9, 123)}
    for tag in TRAINER_TAGS:
        for name in names:
            assert admitted({**body, "metadata": {**body["metadata"], "name": name}}, tag) == [], (tag, name)
        for name, why in (("prmflow-PPO-it0", "RFC 1035"), ("prmflow_ppo", "RFC 1035"), ("0prmflow", "RFC 1035"),
                          ("prmflow-", "RFC 1035"), ("p" * 64, "no more than 63")):
            errors = admitted({**body, "metadata": {**body["metadata"], "name": name}}, tag)
            assert any(why in e for e in errors), (tag, name, errors)
        twice = copy.deepcopy(body)
        twice["spec"]["trainer"]["env"].append({"name": twice["spec"]["trainer"]["env"][0]["name"], "value": "x"})
        assert any("spec.trainer.env[" in e and "Duplicate value" in e for e in admitted(twice, tag)), tag


@pytest.mark.slow
def test_the_multi_node_recipe_trainjobs_pass_each_trainer_version(tmp_path_factory, tmp_path, monkeypatch):
    bodies = rendered_trainjobs(compiled(tmp_path_factory, "cluster/ppo-7b-2x8.yaml", True), tmp_path, monkeypatch)
    assert len(bodies) == 11  # sft and ppo-0..9
    for body in bodies:
        for tag in TRAINER_TAGS:
            assert admitted(body, tag) == [], tag


def test_plan_takes_set_like_compile_and_refuses_what_the_target_kfp_would(capsys):
    """`pipeline plan` reads --set as compile and submit do, and checks the same target version: the
    quickstart on KFP's per-run workspace has no storage class, which 2.15 refuses and 2.17 takes."""
    args = ["pipeline", "plan", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model-params", "1e6",
            "--set", "rollout_shards=3"]
    assert cli.main(args) == 2
    assert "would not run on Kubeflow Pipelines 2.15" in capsys.readouterr().err
    assert cli.main([*args, "--set", "cluster.kfp_version=2.17", "--set", "rollout.n_samples=8"]) == 0
    out = capsys.readouterr().out
    assert "x 3 rollout shards" in out and "rollout-k" in out


def test_submit_reads_the_servers_kfp_version_and_refuses_what_it_would_refuse(tmp_path, capsys):
    """A package compiled for 2.17 (no storage class) is refused by submit on a 2.16.1 API server, naming the
    keys, before any experiment or run is created; a 2.17.0 server gets it."""
    from .fake_kfp import FakeKfp
    from .test_compile_submit import IMAGES

    package = tmp_path / "p.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(ROOT / "configs" / "quickstart.yaml"), "-o", str(package),
                     *IMAGES, "--set", "cluster.kfp_version=2.17"]) == 0
    for version, code in (("2.16.1", 2), ("2.17.0", 0)):
        with FakeKfp(version=version) as server:
            assert cli.main(["pipeline", "submit", "--host", server.url, "--package", str(package)]) == code
        posted = [r["path"] for r in server.sent("POST")]
        if code:
            err = capsys.readouterr().err
            assert "Kubeflow Pipelines 2.16.1" in err and "KFP at" in err and "is 2.16.1" in err
            assert "pipeline.cluster.workspace_storage_class" in err and posted == []
        else:
            assert posted == ["/apis/v2beta1/experiments", "/apis/v2beta1/runs"]


def test_a_server_that_does_not_state_its_version_refuses_the_run_as_its_compiler_does(tmp_path, capsys):
    """TAG_NAME unset: healthz says 'unknown', so submit can only check the compiled-in version; a KFP 2.16
    server's compiler then refuses the workspace at run creation, and submit reports its message."""
    from .fake_kfp import FakeKfp
    from .test_compile_submit import IMAGES

    package = tmp_path / "p.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(ROOT / "configs" / "quickstart.yaml"), "-o", str(package),
                     *IMAGES, "--set", "cluster.kfp_version=2.17"]) == 0
    with FakeKfp(version="2.16.1", tag_name="unknown") as server:
        assert cli.main(["pipeline", "submit", "--host", server.url, "--package", str(package)]) == 2
    assert server.runs == {}
    err = capsys.readouterr().err
    assert "does not state its version" in err and "workspace PVC spec must specify storageClassName" in err


def test_submit_asks_the_server_first_and_compiles_a_config_for_its_version(capsys):
    """`pipeline submit --config` with the default kfp_version (2.15): the server is asked for its version
    before any version's rules are applied. A dead host gets "cannot reach", not 2.15's storage-class refusal;
    a 2.17 server gets the quickstart (no storage class), which 2.17 takes; a 2.16 server refuses it by 2.16's
    rule, naming the key."""
    import socket

    from .fake_kfp import FakeKfp
    from .test_compile_submit import IMAGES

    args = ["pipeline", "submit", "--config", str(ROOT / "configs" / "quickstart.yaml"), *IMAGES]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert cli.main([*args, "--host", dead]) != 0
    err = capsys.readouterr().err
    assert "Cannot reach KFP" in err or "did not answer its health check" in err, err
    assert "storageClassName" not in err and "2.15" not in err
    with FakeKfp(version="2.17.0") as server:
        assert cli.main([*args, "--host", server.url]) == 0
    assert [r["path"] for r in server.sent("POST")] == ["/apis/v2beta1/experiments", "/apis/v2beta1/runs"]
    assert "checked for the server's Kubeflow Pipelines 2.17.0" in capsys.readouterr().err
    with FakeKfp(version="2.16.1") as server:
        assert cli.main([*args, "--host", server.url]) == 2
    assert server.sent("POST") == []
    err = capsys.readouterr().err
    assert "2.16" in err and "pipeline.cluster.workspace_storage_class" in err
