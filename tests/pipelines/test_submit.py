"""`prmflow pipeline submit|upload` as a Kubeflow user runs them, against the fake KFP API server on
loopback (tests/pipelines/fake_kfp.py, which records every request): each credential path sends what
kfp.Client itself sends with that credential, a refusal says which credential to use, stage parameters
merge into the compiled config, a run is operated (pipeline root, service account, caching, --wait with
the failed task and its log tail), and a pipeline is uploaded with versions."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.pipelines.settings import safe_loader

from .fake_k8s import FakeK8s
from .fake_kfp import FakeKfp
from .test_compile_submit import CLUSTER_YAML, IMAGES, STORAGE, all_tasks

ROOT = Path(__file__).resolve().parents[2]
API = "/apis/v2beta1"


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The pipeline of test_compile_submit's cluster config, compiled once (ppo section: optim.lr 1e-6)."""
    tmp = tmp_path_factory.mktemp("package")
    (tmp / "p.yaml").write_text(CLUSTER_YAML)
    assert cli.main(["pipeline", "compile", "--config", str(tmp / "p.yaml"), "-o", str(tmp / "pipeline.yaml")]) == 0
    return tmp / "pipeline.yaml"


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch, tmp_path):
    """Nothing from this machine leaks in: no endpoint, token, kubeconfig or kfp context file."""
    import kfp

    for var in ("KF_PIPELINES_ENDPOINT", "PRMFLOW_KFP_TOKEN", "PRMFLOW_KFP_COOKIE", "KF_PIPELINES_SA_TOKEN_PATH",
                "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))


def submit(*args: str) -> int:
    return cli.main(["pipeline", "submit", *args])


def reference_headers(fake: FakeKfp, **client_args) -> dict:
    """The auth headers kfp.Client itself sends with `client_args` (one experiment listing, recorded)."""
    import kfp

    before = len(fake.requests)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kfp.Client(host=fake.url, namespace="team-a", **client_args).list_experiments()
    (req,) = fake.requests[before:]
    return {k: req["headers"].get(k) for k in ("authorization", "cookie")}


def sent_headers(requests: list[dict]) -> set[tuple]:
    return {(r["headers"].get("authorization"), r["headers"].get("cookie")) for r in requests}


# --- authentication ------------------------------------------------------------------------------

def test_a_token_is_sent_as_kfp_sends_it_and_the_run_is_filed_in_the_namespace(package, monkeypatch):
    with FakeKfp(tokens={"tok-alice": "alice"}) as fake:
        monkeypatch.setenv("PRMFLOW_KFP_TOKEN", "tok-alice")  # the env var path; --token does the same
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-a") == 0
        ours = list(fake.requests)
        ref = reference_headers(fake, existing_token="tok-alice")
    assert ref == {"authorization": "Bearer tok-alice", "cookie": None}
    assert sent_headers(ours) == {(ref["authorization"], ref["cookie"])}
    posts = [r for r in ours if r["method"] == "POST"]
    assert [r["path"] for r in posts] == [f"{API}/experiments", f"{API}/runs"]
    assert posts[0]["body"]["namespace"] == "team-a"
    # one read of healthz, for the server's KFP version (a namespace given: no multi-user probe besides)
    assert sum(r["path"].endswith("/healthz") for r in ours) == 1


def test_a_session_cookie_is_sent_as_kfp_sends_it(package):
    with FakeKfp(cookies={"authservice_session=s3ss10n": "alice"}) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-a",
                      "--cookie", "authservice_session=s3ss10n") == 0
        ours = list(fake.requests)
        ref = reference_headers(fake, cookies="authservice_session=s3ss10n")
    assert ref == {"authorization": None, "cookie": "authservice_session=s3ss10n"}
    assert sent_headers(ours) == {(None, "authservice_session=s3ss10n")}
    assert [r["path"] for r in ours if r["method"] == "POST"][-1] == f"{API}/runs"


def test_a_service_account_token_file_is_read_as_kfp_reads_it(package, tmp_path):
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    token = tmp_path / "token"
    token.write_text("sa-token-of-the-pod\n")
    with FakeKfp(tokens={"sa-token-of-the-pod": "system:serviceaccount:team-a:default-editor"}) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-a",
                      "--sa-token", str(token)) == 0
        ours = list(fake.requests)
        ref = reference_headers(fake, credentials=ServiceAccountTokenVolumeCredentials(path=str(token)))
    assert ref["authorization"] == "Bearer sa-token-of-the-pod"
    assert sent_headers(ours) == {(ref["authorization"], None)}


def in_a_pod(tmp_path, monkeypatch) -> None:
    """This process as a pod in namespace team-a sees itself: the service env, the service account, the
    projected pipelines token (projected-pipelines-token)."""
    import kfp
    from kubernetes.config import incluster_config

    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("kube-api-token")  # the pod's Kubernetes API token (not what KFP gets)
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (sa / "namespace").write_text("team-a")
    (tmp_path / "pipelines-token").write_text("projected-pipelines-token")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "pipelines-token"))
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(sa / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(sa / "ca.crt"))
    monkeypatch.setattr(kfp.Client, "_NAMESPACE_PATH", str(sa / "namespace"))


def test_inside_a_pod_no_host_is_needed(package, tmp_path, monkeypatch):
    """kfp's in-cluster path: the in-cluster service address, the pod's projected pipelines token, and on a
    multi-user install the pod's own namespace. The fake stands where ml-pipeline.kubeflow:8888 would be."""
    import kfp

    in_a_pod(tmp_path, monkeypatch)
    with FakeKfp(tokens={"projected-pipelines-token": "system:serviceaccount:team-a:default-editor"}) as fake:
        monkeypatch.setattr(kfp.Client, "_IN_CLUSTER_DNS_NAME", fake.url.removeprefix("http://"))
        assert submit("--package", str(package)) == 0
    assert sent_headers(fake.requests) == {("Bearer projected-pipelines-token", None)}
    assert fake.requests[0]["path"] == f"{API}/healthz"  # kfp asks whether KFP is multi-user ...
    (exp,) = [r for r in fake.requests if r["method"] == "POST" and r["path"] == f"{API}/experiments"]
    assert exp["body"]["namespace"] == "team-a"  # ... and files the run in the pod's namespace


def test_inside_a_pod_a_token_or_token_file_without_host_reaches_the_in_cluster_service(package, tmp_path, monkeypatch):
    """kfp 2.17 sends a --token given without --host to http://localhost, and replaces a --sa-token FILE with the
    pod's default projected token (contracts/kfp_client.py): both must reach the in-cluster service, with
    the credential the user named."""
    import kfp

    in_a_pod(tmp_path, monkeypatch)
    (tmp_path / "other-token").write_text("token-of-the-file")
    with FakeKfp(tokens={"tok-alice": "alice", "token-of-the-file": "system:serviceaccount:team-a:runner",
                         "projected-pipelines-token": "system:serviceaccount:team-a:default-editor"}) as fake:
        monkeypatch.setattr(kfp.Client, "_IN_CLUSTER_DNS_NAME", fake.url.removeprefix("http://"))
        assert submit("--package", str(package), "--token", "tok-alice", "--namespace", "team-a") == 0
        assert sent_headers(fake.requests) == {("Bearer tok-alice", None)}
        fake.requests.clear()
        assert submit("--package", str(package), "--sa-token", str(tmp_path / "other-token"), "--namespace", "team-a") == 0
        assert sent_headers(fake.requests) == {("Bearer token-of-the-file", None)}
    assert len(fake.runs) == 2


def test_a_kfp_namespace_is_not_taken_for_the_users_namespace(package, tmp_path, monkeypatch, capsys):
    """--kfp-namespace names where KFP is deployed; kfp 2.17 makes any value but 'kubeflow' the user's namespace
    too. Inside a pod the run is still filed in the pod's namespace; outside, a multi-user KFP still asks for
    --namespace."""
    import kfp

    with FakeKfp(cookies={"authservice_session=s3ss10n": "alice"}) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--cookie", "authservice_session=s3ss10n",
                      "--kfp-namespace", "kf-system") == 2
        assert fake.runs == {}
    assert "is a multi-user install: pass --namespace YOUR_PROFILE_NAMESPACE" in capsys.readouterr().err
    in_a_pod(tmp_path, monkeypatch)
    with FakeKfp(tokens={"projected-pipelines-token": "system:serviceaccount:team-a:default-editor"}) as fake:
        monkeypatch.setattr(kfp.Client, "_IN_CLUSTER_DNS_NAME", fake.url.removeprefix("http://"))
        assert submit("--package", str(package), "--kfp-namespace", "kf-system") == 0
    (exp,) = [r for r in fake.requests if r["method"] == "POST" and r["path"] == f"{API}/experiments"]
    assert exp["body"]["namespace"] == "team-a"


def test_a_multi_user_kfp_asks_for_the_namespace(package, capsys):
    with FakeKfp(cookies={"authservice_session=s3ss10n": "alice"}) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--cookie", "authservice_session=s3ss10n") == 2
    assert "is a multi-user install: pass --namespace YOUR_PROFILE_NAMESPACE" in capsys.readouterr().err
    assert [r["path"] for r in fake.requests] == [f"{API}/healthz"] * 2  # kfp's probe, then ours; no run


def test_a_401_says_which_credentials_to_use(package, capsys):
    with FakeKfp(tokens={"tok-alice": "alice"}) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-a") == 2
        assert [r["method"] for r in fake.requests] == ["GET"]  # refused at the first call; no run
    err = capsys.readouterr().err
    assert "401" in err and "sent no credentials" in err and "no user identity" in err
    for way in ("--token TOKEN", "--cookie NAME=VALUE", "--sa-token", "leave out --host"):
        assert way in err, way


def test_a_login_page_instead_of_the_api_is_not_taken_for_a_run(package, capsys):
    """Without a session, Dex answers with a redirect to its login page; kfp.Client reads that HTML as an empty
    answer. The submission must fail saying so, not report a run that does not exist."""
    with FakeKfp(cookies={"authservice_session=s3ss10n": "alice"}, login_page=True) as fake:
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-a") == 2
        assert any(r["path"] == "/dex/auth" for r in fake.requests) and fake.runs == {}
    captured = capsys.readouterr()
    assert "answered the new run without an id: that was not the KFP API" in captured.err
    assert "--cookie NAME=VALUE" in captured.err and "submitted run" not in captured.out


def test_a_403_says_to_use_the_profile_namespace(package, capsys):
    with FakeKfp(tokens={"tok-alice": "alice"}) as fake:
        fake.namespaces["alice"] = {"team-a"}
        assert submit("--package", str(package), "--host", fake.url, "--namespace", "team-b", "--token", "tok-alice") == 2
    err = capsys.readouterr().err
    assert "403" in err and "namespace team-b" in err and "--namespace YOUR_PROFILE_NAMESPACE" in err
    assert "sent a bearer token" in err


# --- parameters that merge -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ppo_7b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ppo7b") / "ppo-7b-2x8.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(ROOT / "configs/cluster/ppo-7b-2x8.yaml"),
                     "-o", str(out), *IMAGES]) == 0
    return out


def test_param_merges_into_the_compiled_stage_config(ppo_7b, capsys):
    """The README's example on ppo-7b-2x8: lr changes, the recipe's ZeRO-2, the critic and the rest of ppo stay."""
    root = next(yaml.load_all(ppo_7b.read_text(), Loader=safe_loader()))["root"]
    compiled = root["inputDefinitions"]["parameters"]["ppo_config"]["defaultValue"]
    with FakeKfp() as fake:
        assert submit("--package", str(ppo_7b), "--host", fake.url, "--param", 'ppo_config={"optim": {"lr": 1e-6}}',
                      "--set", "sft.max_steps=50") == 0
    sent = fake.sent("POST")[-1]["body"]["runtime_config"]["parameters"]
    ppo = sent["ppo_config"]
    assert ppo["optim"] == {**compiled["optim"], "lr": 1e-6}
    assert ppo["engine"]["zero_stage"] == 2 and ppo["train_critic"] is True and ppo["critic_lr"] == 5e-6
    assert {k: v for k, v in ppo.items() if k != "optim"} == {k: v for k, v in compiled.items() if k != "optim"}
    assert sent["sft_config"]["max_steps"] == 50 and sent["sft_config"]["engine"]["zero_stage"] == 2
    assert set(sent) == {"ppo_config", "sft_config", "chain_id"}  # the stages nobody changed keep their compiled default


def test_dry_run_prints_every_stage_effective_config_and_sends_nothing(ppo_7b, capsys):
    assert submit("--package", str(ppo_7b), "--set", "ppo.optim.lr=2e-6", "--dry-run") == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out.rsplit("dry run:", 1)[0])
    configs = shown["effective stage configs"]
    assert set(configs) == {"sft", "prm", "rollout", "advantage", "ppo", "evaluate"}
    assert configs["ppo"]["optim"]["lr"] == 2e-6 and configs["ppo"]["engine"]["zero_stage"] == 2
    assert configs["ppo"]["train_critic"] is True
    assert configs["advantage"]["estimator"] == "gae" and configs["advantage"]["lam"] == 0.95
    assert configs["rollout"]["vllm"]["tensor_parallel_size"] == 4
    assert configs["ppo"]["clip_eps_low"] == 0.2 and configs["ppo"]["clip_eps_high"] == 0.28  # a default, the recipe's
    assert "nothing submitted" in out
    # what is sent is typed as the stage reads it: not '2e-6' (a string to YAML 1.1) nor the compiled 2.0 (KFP's Struct)
    sent = shown["arguments sent"]["ppo_config"]
    assert type(sent["optim"]["lr"]) is float and sent["optim"]["lr"] == 2e-6
    assert type(sent["engine"]["zero_stage"]) is int and type(sent["epochs"]) is int


def test_dry_run_shows_the_compiled_in_prm_update_section(tmp_path, capsys):
    """pipeline.prm_update: the prm-update section is compiled into its tasks, not a run parameter; the dry
    run still shows what those tasks will run with (the config's keys over the stage's defaults)."""
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["pipeline"]["prm_update"] = True
    cfg["prm-update"] = {"max_steps": 80, "labels": "shared_prefix"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["pipeline", "compile", "--config", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "p.yaml"),
                     *IMAGES, *STORAGE]) == 0
    capsys.readouterr()
    assert submit("--package", str(tmp_path / "p.yaml"), "--dry-run") == 0
    shown = yaml.safe_load(capsys.readouterr().out.rsplit("dry run:", 1)[0])
    upd = shown["compiled-in stage configs (compile again to change)"]["prm-update"]
    assert upd["max_steps"] == 80 and upd["labels"] == "shared_prefix" and upd["replay_share"] == 0.25  # a default
    assert "prm-update" not in shown["effective stage configs"]


@pytest.mark.parametrize("change,named", [
    (["--param", 'ppo_config={"optim": {"lrr": 1e-6}}'], "[ppo]: 'optim.lrr' is not a config key"),
    (["--set", "ppo.critic_lrr=1"], "[ppo]: 'critic_lrr' is not a config key"),
    (["--param", "ppo_confg={}"], "--param ppo_confg: the pipeline has no such parameter"),
    (["--param", "ppo_config=1e-6"], "--param ppo_config: expected a JSON object of ppo config keys"),
])
def test_a_key_that_does_not_exist_is_an_error_naming_stage_and_key(package, change, named, capsys):
    with FakeKfp() as fake:
        assert submit("--package", str(package), "--host", fake.url, *change) == 2
    assert named in capsys.readouterr().err
    assert fake.requests == []


# --- operating a run ---------------------------------------------------------------------------------

def test_pipeline_root_service_account_and_caching_reach_the_run(package):
    compiled = next(yaml.load_all(package.read_text(), Loader=safe_loader()))
    assert any(t.get("cachingOptions", {}).get("enableCache") for t in all_tasks(compiled).values())
    with FakeKfp() as fake:
        assert submit("--package", str(package), "--host", fake.url, "--pipeline-root", "s3://ml-bucket/prmflow",
                      "--service-account", "prmflow-runner", "--no-caching", "--run-name", "lr-sweep-1") == 0
    run = fake.sent("POST")[-1]["body"]
    assert run["service_account"] == "prmflow-runner" and run["display_name"] == "lr-sweep-1"
    assert run["runtime_config"]["pipeline_root"] == "s3://ml-bucket/prmflow"
    tasks = all_tasks(run["pipeline_spec"]["pipeline_spec"])
    assert len(tasks) > 10 and not any(t.get("cachingOptions", {}).get("enableCache") for t in tasks.values())


def test_wait_reports_the_failed_task_with_its_log_tail(package, tmp_path, monkeypatch, capsys):
    pod = "prmflow-ppo-1-x7k2p-system-container-impl-1234"
    details = {"task_details": [
        {"display_name": "sft", "state": "SUCCEEDED", "pod_name": "prmflow-sft-impl-1",
         "start_time": "2026-11-25T10:00:00Z"},
        {"display_name": "ppo-1 (trainjob)", "state": "FAILED", "start_time": "2026-11-25T11:00:00Z",
         "error": {"code": 2, "message": "failed to execute component: exit status 1"},
         "child_tasks": [{"pod_name": pod}]}]}
    log = "".join(f"step {i}\n" for i in range(100)) + "TrainJobError: TrainJob 'prmflow-ppo-it1-ab' failed: OOMKilled\n"
    with FakeKfp(run_states=["PENDING", "RUNNING", "FAILED"], run_details=details) as fake, \
            FakeK8s(pod_logs={pod: log}) as k8s:
        monkeypatch.setenv("KUBECONFIG", str(k8s.kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
        code = submit("--package", str(package), "--host", fake.url, "--namespace", "team-a", "--wait", "--poll", "0",
                      "--log-lines", "5", "--ui-host", "https://kubeflow.example.com/pipeline")
    assert code == 1
    captured = capsys.readouterr()
    assert "run-42: PENDING" in captured.out and "run-42: RUNNING" in captured.out
    assert "https://kubeflow.example.com/pipeline/#/runs/details/run-42" in captured.out
    err = captured.err
    assert "task ppo-1 (trainjob) FAILED: failed to execute component: exit status 1" in err
    assert "task sft" not in err
    tail = [line.removeprefix("    | ") for line in err.splitlines() if line.startswith("    | ")]
    assert tail == ["step 96", "step 97", "step 98", "step 99",
                    "TrainJobError: TrainJob 'prmflow-ppo-it1-ab' failed: OOMKilled"]
    (read,) = [r for r in k8s.requests if r["path"].split("?")[0].endswith("/log")]
    assert read["path"] == f"/api/v1/namespaces/team-a/pods/{pod}/log?container=main&tailLines=5"


def test_wait_returns_zero_when_the_run_succeeds(package, capsys):
    with FakeKfp() as fake:
        assert submit("--package", str(package), "--host", fake.url, "--wait", "--poll", "0") == 0
    out = capsys.readouterr().out
    assert out.index("run-42: PENDING") < out.index("run-42: RUNNING") < out.index("run-42: SUCCEEDED")


def test_upload_creates_the_pipeline_then_versions_of_it(package, capsys):
    with FakeKfp() as fake:
        upload = ["pipeline", "upload", "--package", str(package), "--host", fake.url]
        assert cli.main(upload) == 0
        assert cli.main([*upload, "--version", "lr-1e-6"]) == 0
        assert cli.main([*upload, "--version", "lr-1e-6"]) == 2  # a version name is used once
    posts = fake.sent("POST")
    assert [r["path"] for r in posts] == [f"{API}/pipelines/upload", f"{API}/pipelines/upload_version",
                                          f"{API}/pipelines/upload_version"]
    assert posts[0]["query"]["name"] == ["prmflow"]
    assert posts[1]["query"] == {"name": ["lr-1e-6"], "pipelineid": ["pipe-1"]}
    uploaded = next(yaml.load_all(posts[1]["body"]["uploadfile"][1], Loader=safe_loader()))
    assert uploaded["pipelineInfo"]["name"] == "prmflow"
    assert [v["display_name"] for v in fake.versions] == ["prmflow", "lr-1e-6"]
    err = capsys.readouterr().err
    assert "version lr-1e-6 already exists" in err


# --- images --------------------------------------------------------------------------------------

def test_placeholder_images_fail_compile_with_what_to_do(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("\n".join(line for line in CLUSTER_YAML.splitlines() if not line.startswith("  images:")))
    assert "images:" not in yaml.safe_load(cfg.read_text())["pipeline"]
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "pipeline.images.cpu, pipeline.images.gpu are still the placeholder" in err
    assert "images/build.sh cpu REGISTRY/prmflow-cpu:TAG --push" in err
    assert not (tmp_path / "x.yaml").exists()
    assert cli.main(["pipeline", "compile", "--config", str(cfg), "-o", str(tmp_path / "x.yaml"), *IMAGES]) == 0
    spec = yaml.load_all((tmp_path / "x.yaml").read_text(), Loader=safe_loader())
    images = {e["container"]["image"] for e in next(spec)["deploymentSpec"]["executors"].values() if "container" in e}
    assert images == {arg.split("=", 2)[2] for arg in IMAGES}


# --- docs ----------------------------------------------------------------------------------------

def test_the_submitting_page_tables_match_the_config():
    """docs/submitting.md's key tables are generated from the config docstrings, like the stage READMEs."""
    from prmflow import docs
    from prmflow.pipelines.settings import ImagesConfig, TrainerConfig

    path = ROOT / "docs" / "submitting.md"
    text = path.read_text()
    for name, cls in (("pipeline.images", ImagesConfig), ("pipeline.cluster.trainer", TrainerConfig)):
        assert text == docs.with_table(text, name, docs.config_table(cls), where=str(path)), \
            f"{path}: the {name} table is out of date; run `python -m prmflow.docs` to regenerate it"


def test_run_local_merges_stage_params_too(tmp_path, capsys):
    """run-local takes --param as submit does: merged and checked before any task runs."""
    code = cli.main(["pipeline", "run-local", "--config", str(ROOT / "configs/pipeline-local.yaml"), "--root",
                     str(tmp_path / "root"), "--param", 'ppo_config={"optim": {"lrr": 1e-6}}'])
    assert code == 2
    assert "--param ppo_config [ppo]: 'optim.lrr' is not a config key" in capsys.readouterr().err
    assert not list((tmp_path / "root").rglob("executor_output.json"))  # no task ran
