"""A chain of runs on a cluster (pipelines/chain.py): `pipeline submit` uploads the later runs' packages and
starts the first run; each run's chain-next step submits the next one from inside the cluster with the
pod's projected pipelines token, no laptop involved.

The fake KFP API server (fake_kfp.py) enforces what the real one does with such a request: a token it
accepts (the projected token of audience pipelines.kubeflow.org, not the pod's Kubernetes API token:
kubeflow/pipelines@2.15.0 backend/src/apiserver/auth/authenticator_token_review.go:99-105, common/
const.go:54), the run filed in its experiment's namespace and created only by an identity allowed there
(run_server.go:142-157), and a pipeline_version_reference naming a version of that pipeline
(resource/resource_manager.go:1056-1064). kfp.Client's in-cluster path (kfp 2.17.0 kfp/client/
client.py:131, 301-311; kfp/client/__init__.py:25-26) finds the fake where ml-pipeline.kubeflow would be.
"""

from __future__ import annotations

import json

import pytest
import yaml

from prmflow.errors import PrmflowError
from prmflow.pipelines import chain
from prmflow.pipelines.settings import safe_loader

from .fake_kfp import FakeKfp
from .test_compile_submit import CLUSTER_YAML
from .test_submit import API, in_a_pod, no_ambient_credentials, submit  # noqa: F401 - the fixture, autouse

POD = "system:serviceaccount:team-a:default-editor"


def chain_config(tmp_path):
    cfg = yaml.safe_load(CLUSTER_YAML)
    cfg["pipeline"].update(iterations=5, run_iterations=2, rollout_shards=1)
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def uploaded_spec(fake: FakeKfp, version_id: str) -> dict:
    """The pipeline spec of the uploaded version `version_id` (the multipart body the client sent)."""
    version = next(v for v in fake.versions if v["pipeline_version_id"] == version_id)
    for r in fake.sent("POST"):
        if r["path"].startswith(f"{API}/pipelines/upload_version") and r["query"]["name"][0] == version["display_name"]:
            return next(yaml.load_all(r["body"]["uploadfile"][1], Loader=safe_loader()))
    raise AssertionError(f"version {version_id} was not uploaded")


def components_run(spec: dict) -> set[str]:
    """The components a compiled pipeline spec's tasks run (in every DAG: the exit handler's, the loops')."""
    dags = [spec["root"].get("dag", {})] + [c.get("dag", {}) for c in spec.get("components", {}).values()]
    return {t["componentRef"]["name"] for dag in dags for t in dag.get("tasks", {}).values()}


def test_submit_starts_the_chain_and_each_run_submits_the_next_from_inside_the_cluster(tmp_path, monkeypatch, capsys):
    import kfp

    with FakeKfp(tokens={"alice-token": "alice", "projected-pipelines-token": POD}) as fake:
        fake.namespaces = {"alice": {"team-a"}, POD: {"team-a"}}
        assert submit("--config", str(chain_config(tmp_path)), "--host", fake.url, "--token", "alice-token",
                      "--namespace", "team-a", "--run-name", "long", "--param", 'ppo_config={"optim": {"lr": 2e-6}}') == 0
        (first,) = fake.runs.values()
        params = first["runtime_config"]["parameters"]
        assert params["first_iteration"] == 0 and first["display_name"] == "long [1/3: iterations 0..1]"
        cont = json.loads(params["chain"])
        # 5 iterations of at most 2: runs [0,2), [2,4), [4,5): a `next` and a `last` package, uploaded as versions
        assert set(cont["versions"]) == {"next", "last"} and (cont["total"], cont["per_run"]) == (5, 2)
        assert "comp-evaluate" not in components_run(uploaded_spec(fake, cont["versions"]["next"]))
        assert {"comp-evaluate", "comp-chain-resume"} <= components_run(uploaded_spec(fake, cont["versions"]["last"]))
        assert {"comp-sft", "comp-chain-next"} <= components_run(first["pipeline_spec"]["pipeline_spec"])

        # run 1's chain-next step, in a pod of team-a: no host, no flag; kfp finds the service and the token
        in_a_pod(tmp_path, monkeypatch)
        monkeypatch.setattr(kfp.Client, "_IN_CLUSTER_DNS_NAME", fake.url.removeprefix("http://"))
        fake.requests.clear()
        second = fake.runs[chain.submit_next(params["chain"], 2, params["chain_id"])]
        assert {r["headers"].get("authorization") for r in fake.requests} == {"Bearer projected-pipelines-token"}
        assert second["pipeline_version_reference"] == {"pipeline_id": cont["pipeline_id"],
                                                         "pipeline_version_id": cont["versions"]["next"]}
        assert second["experiment_id"] == cont["experiment_id"] and second["display_name"] == "long [2/3: iterations 2..3]"
        sent = second["runtime_config"]["parameters"]
        assert (sent["first_iteration"], sent["chain"], sent["chain_id"]) == (2, params["chain"], params["chain_id"])
        # every run of the chain gets the first one's arguments (a --param given at submission, too)
        assert sent["ppo_config"] == params["ppo_config"] and sent["ppo_config"]["optim"]["lr"] == 2e-6
        third = fake.runs[chain.submit_next(params["chain"], 4, params["chain_id"])]
        assert third["pipeline_version_reference"]["pipeline_version_id"] == cont["versions"]["last"]

        # a pod whose service account may not create runs in the namespace: the server's 403, said as such
        fake.namespaces[POD] = {"team-b"}
        with pytest.raises(PrmflowError, match="403.*team-a"):
            chain.submit_next(params["chain"], 2, params["chain_id"])
    assert len(fake.runs) == 3


def test_submitting_the_same_chain_again_reuses_its_uploaded_versions(tmp_path):
    with FakeKfp() as fake:
        cfg = str(chain_config(tmp_path))
        assert submit("--config", cfg, "--host", fake.url) == 0
        assert submit("--config", cfg, "--host", fake.url) == 0
        a, b = (r["runtime_config"]["parameters"] for r in fake.runs.values())
    assert json.loads(a["chain"])["versions"] == json.loads(b["chain"])["versions"]
    assert a["chain_id"] == b["chain_id"]  # the same chain: its MLflow parent run is reused
    assert len(fake.pipelines) == 1 and len(fake.versions) == 3  # the pipeline's first upload + next + last


def test_a_continuation_naming_a_version_the_server_lacks_fails_with_its_error(tmp_path, monkeypatch):
    import kfp

    with FakeKfp(tokens={"projected-pipelines-token": POD}) as fake:
        in_a_pod(tmp_path, monkeypatch)
        monkeypatch.setattr(kfp.Client, "_IN_CLUSTER_DNS_NAME", fake.url.removeprefix("http://"))
        cont = chain.Continuation(pipeline_id="pipe-9", versions={"next": "ver-gone", "last": "ver-gone"},
                                  experiment_id="exp-1", total=6, per_run=2, arguments={}, namespace="team-a")
        with pytest.raises(PrmflowError, match="ver-gone"):
            chain.submit_next(cont.to_json(), 2, "chain-x")
        assert fake.runs == {}


def test_a_chain_resubmitted_from_a_later_run_starts_there(tmp_path, capsys):
    """--from-iteration N: the run that begins at N (chain-resume reads its predecessors' state from the
    workspace), not run 1, whose sampled steps (uncached) would run again; N must begin a run."""
    with FakeKfp() as fake:
        cfg = str(chain_config(tmp_path))
        assert submit("--config", cfg, "--host", fake.url, "--from-iteration", "3") == 2
        assert "begin at iterations 0, 2, 4" in capsys.readouterr().err and fake.runs == {}
        assert submit("--config", cfg, "--host", fake.url, "--from-iteration", "2", "--no-caching") == 0
        (run,) = fake.runs.values()
    assert run["runtime_config"]["parameters"]["first_iteration"] == 2
    assert run["display_name"] == "prmflow [2/3: iterations 2..3]"
    ran = components_run(run["pipeline_spec"]["pipeline_spec"])
    assert "comp-chain-resume" in ran and "comp-sft" not in ran and "comp-evaluate" not in ran
