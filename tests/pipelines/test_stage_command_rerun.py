"""Re-running a cluster stage on a laptop: `prmflow stage-command STAGE --run-id ID` against a real S3 API.

The object store is moto's S3 server on loopback (a faithful S3 implementation; the one fake here,
since no cloud store can be reached). The stage run is recorded the way a KFP pod records it: the
component's own code (`kfp_shim.run_stage`) runs the advantage stage on the launcher's local copies of
its artifacts, which sit under `/s3/<bucket>/<key>` in a pod and under `<tmp>/pod/s3/<bucket>/<key>`
here (`datasets.KFP_MOUNTS` is pointed there); the pod's copies are then deleted, as they are when a
pod ends, so only the bucket and the MLflow store remain.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from prmflow import cli
from prmflow.components.advantage import stage as advantage
from prmflow.components.data import io, schema
from prmflow.pipelines import kfp_shim
from prmflow.tracking import handoffs as datasets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "advantage"))
from advantage_reference import random_rollouts  # noqa: E402

BUCKET = "kfp-artifacts"
RUN_ROOT = "prmflow/run-7/"


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on a free loopback port, its bucket, and the environment a user would set."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    import urllib.request

    # moto's state lives in the process, not the server: start every test from an empty store
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": f"http://{host}:{port}"}, skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def record_cluster_run(tmp_path: Path, monkeypatch, fs) -> tuple[str, str, Path]:
    """Two rollout shards in the bucket, the advantage step of a KFP pod run on them; returns
    (MLflow store, run id, a copy of the output it wrote)."""
    mount = tmp_path / "pod" / "s3"  # the pod's /s3
    monkeypatch.setattr(datasets, "KFP_MOUNTS", {f"{mount}/": "s3://"})
    shards = []
    for i in range(2):
        key = f"{RUN_ROOT}rollout-{i}/rollouts"
        schema.write_dataset(mount / BUCKET / key, random_rollouts(np.random.default_rng(i)), "rollouts")
        fs.put(str(mount / BUCKET / key) + "/", f"{BUCKET}/{key}/", recursive=True)
        shards.append(str(mount / BUCKET / key))
    out = mount / BUCKET / RUN_ROOT / "advantage/advantages"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # what the advantage component does in its pod (prmflow/pipelines/kfp_components.py)
    gathered = kfp_shim.gather_shards(shards, str(tmp_path / "pod" / "tmp" / "advantages.inputs"))
    config = {"estimator": "gae", "gamma": 0.9, "lam": 0.8, "kl_coef": 0.05}  # not the defaults: the re-run must use them
    kfp_shim.run_stage("advantage", advantage, config, {"input": gathered, "output": str(out)},
                       "run-7", store, "cluster", iteration=0)
    fs.put(str(out) + "/", f"{BUCKET}/{RUN_ROOT}advantage/advantages/", recursive=True)
    original = shutil.copytree(out, tmp_path / "original")
    shutil.rmtree(tmp_path / "pod")  # the pod is gone: its local copies with it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("cluster").experiment_id])
    return store, run.info.run_id, original


def test_the_run_records_its_hand_offs_as_s3_datasets_with_manifest_digests(tmp_path, monkeypatch, s3):
    from mlflow.tracking import MlflowClient

    store, run_id, original = record_cluster_run(tmp_path, monkeypatch, s3)
    run = MlflowClient(store).get_run(run_id)
    found = {(d.dataset.source, d.dataset.digest): {t.key: t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    manifest = io.read_manifest(original)
    expected_out = io.fingerprint([original])[str(original)][:32]  # the same manifest, as the bucket holds it
    assert found[(f'{{"uri": "s3://{BUCKET}/{RUN_ROOT}advantage/advantages"}}', expected_out)][
        "mlflow.data.context"] == "output"
    for i in range(2):
        uri = f"s3://{BUCKET}/{RUN_ROOT}rollout-{i}/rollouts"
        tags = [t for (src, _), t in found.items() if uri in src]
        assert tags == [{"mlflow.data.context": "training", "prmflow.key": "input", "prmflow.shard": f"shard-0000{i}"}]
    (out,) = [d.dataset for d in run.inputs.dataset_inputs if "advantages" in d.dataset.source]
    assert '"num_rows": %d' % manifest["rows"] in out.profile and '"name": "advantages"' in out.schema


def test_stage_command_fetches_verifies_and_reruns_to_the_same_output(tmp_path, monkeypatch, s3, capfd):
    store, run_id, original = record_cluster_run(tmp_path, monkeypatch, s3)
    cache, rerun = tmp_path / "cache", tmp_path / "rerun"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    capfd.readouterr()
    assert cli.main(["stage-command", "advantage", "--run-id", run_id, "--tracking-uri", store, "--fetch", str(cache),
                     "--output", str(rerun), "--run", "--no-container"]) == 0
    assert pq.read_table(sorted(rerun.glob("advantages/*.parquet"))).equals(pq.read_table(sorted(original.glob("*.parquet"))))
    # it says where the output is and that it is the recorded one (the digest the run logged for its output)
    digest = io.fingerprint([original])[str(original)][:32]
    assert (f"advantage: the re-run wrote '{rerun / 'advantages'}'; it matches the recorded run's output file for file "
            f"(digest {digest})") in capfd.readouterr().out
    # the container line mounts the fetched copies (one per shard, no links to follow) and the output
    capsys_line = _line(["stage-command", "advantage", "--run-id", run_id, "--tracking-uri", store, "--fetch", str(cache),
                         "--output", str(rerun), "--engine", "podman"])
    argv = shlex.split(capsys_line)
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert argv[:3] == ["podman", "run", "--rm"]
    assert mounts == [f"{cache}/s3/{BUCKET}/{RUN_ROOT}rollout-0/rollouts:/inputs/input/shard-00000:ro",
                      f"{cache}/s3/{BUCKET}/{RUN_ROOT}rollout-1/rollouts:/inputs/input/shard-00001:ro",
                      f"{rerun}:/outputs"]
    assert all(a in argv for a in ("input=/inputs/input", "output=/outputs/advantages", "estimator=gae", "kl_coef=0.05"))


def _line(argv: list[str]) -> str:
    import contextlib
    import io as stdio

    buf = stdio.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return buf.getvalue().strip()


def test_a_tampered_input_is_refused_naming_the_file(tmp_path, monkeypatch, s3, capsys):
    store, run_id, _ = record_cluster_run(tmp_path, monkeypatch, s3)
    shard = f"{BUCKET}/{RUN_ROOT}rollout-1/rollouts/part-00000.parquet"
    data = bytearray(s3.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    s3.pipe_file(shard, bytes(data))
    cache, rerun = tmp_path / "cache", tmp_path / "rerun"
    assert cli.main(["stage-command", "advantage", "--run-id", run_id, "--tracking-uri", store, "--fetch", str(cache),
                     "--output", str(rerun), "--run", "--no-container"]) != 0
    err = capsys.readouterr().err
    assert f"'s3://{shard}' does not match the sha256 in its manifest" in err and "shard-00001" in err
    assert not rerun.exists()  # nothing ran
    assert not (cache / "s3" / shard).exists()  # the cache never holds an unchecked file
    # a manifest rewritten to match the tampered file is refused too: it is not the one the run read
    import hashlib
    import json

    manifest_key = f"{BUCKET}/{RUN_ROOT}rollout-1/rollouts/manifest.json"
    manifest = json.loads(s3.cat_file(manifest_key))
    manifest["files"]["part-00000.parquet"] = hashlib.sha256(bytes(data)).hexdigest()
    s3.pipe_file(manifest_key, json.dumps(manifest).encode())
    assert cli.main(["stage-command", "advantage", "--run-id", run_id, "--tracking-uri", store, "--fetch",
                     str(tmp_path / "cache2"), "--output", str(rerun)]) != 0
    assert f"'s3://{BUCKET}/{RUN_ROOT}rollout-1/rollouts/manifest.json' does not match the digest MLflow recorded" in (
        capsys.readouterr().err)


def test_the_stage_run_is_found_from_the_kfp_run_id(tmp_path, monkeypatch, s3, capsys):
    store, run_id, _ = record_cluster_run(tmp_path, monkeypatch, s3)
    common = ["--tracking-uri", store, "--fetch", str(tmp_path / "cache"), "--output", str(tmp_path / "rerun")]
    by_kfp = _line(["stage-command", "advantage", "--kfp-run-id", "run-7", "--iteration", "0", *common])
    assert by_kfp == _line(["stage-command", "advantage", "--run-id", run_id, *common])
    capsys.readouterr()
    assert cli.main(["stage-command", "advantage", "--kfp-run-id", "run-8", *common]) == 2
    assert "No 'advantage' run of KFP run run-8" in capsys.readouterr().err


@pytest.mark.parametrize("uri", ["s3://bucket/prmflow/run-7/advantage/advantages", "gs://bucket/a/rollouts",
                                 "minio://mlpipeline/v2/artifacts/prmflow/run-7/ppo/updated"])
def test_a_launcher_path_is_recorded_as_the_uri_kfp_copied_it_from(uri):
    from kfp.dsl import Artifact

    # the reference is KFP's own mapping (what its launcher does in the pod), run backwards
    assert datasets.handoff_uri(Artifact(uri=uri).path) == uri
    assert datasets.handoff_uri("/tmp/outputs/kfp-local/advantages") == "/tmp/outputs/kfp-local/advantages"


def test_a_failed_stage_run_keeps_its_inputs_and_can_be_re_run(tmp_path, capsys):
    """The run to re-run is usually one that failed: its inputs are recorded when it starts, no output when it fails."""
    from mlflow.tracking import MlflowClient

    from prmflow.components import config
    from prmflow.errors import DataError

    rollouts = tmp_path / "rollouts"
    schema.write_dataset(rollouts, random_rollouts(np.random.default_rng(0), equal_groups=6), "rollouts")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config.load(advantage.Config, overrides={  # every group has one reward: dropping them leaves nothing
        "input": str(rollouts), "output": str(tmp_path / "adv"), "estimator": "grpo", "zero_variance": "drop",
        "tracking.uri": store, "tracking.experiment": "failed"})
    with pytest.raises(DataError, match="zero_variance=drop"):
        advantage.run(cfg)
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("failed").experiment_id])
    assert run.info.status == "FAILED"
    assert [(d.dataset.name, {t.key: t.value for t in d.tags}["mlflow.data.context"]) for d in run.inputs.dataset_inputs] == [
        ("rollouts", "training")]
    common = ["stage-command", "advantage", "--run-id", run.info.run_id, "--tracking-uri", store,
              "--output", str(tmp_path / "rerun"), "--fetch", str(tmp_path / "cache")]
    capsys.readouterr()
    line = _line(common)
    assert f"-v {rollouts}:/inputs/input:ro" in line and "--set zero_variance=drop" in line
    # no --image: the line names the placeholder default, and stderr says so (stdout stays the line alone)
    assert line.splitlines() == [line] and "registry.invalid/prmflow-cpu" in line
    err = capsys.readouterr().err
    assert "'registry.invalid/prmflow-cpu:set-pipeline.images.cpu' is a placeholder" in err and "--image" in err
    # --run refuses it before starting a pull that could only fail
    assert cli.main([*common, "--run"]) == 2
    out, err = capsys.readouterr()
    assert "is a placeholder, not a pullable image" in err and "run --rm" not in out
    assert "placeholder" not in (_line([*common, "--image", "ghcr.io/me/prmflow-cpu:1"]) + capsys.readouterr().err)


def test_an_input_without_a_manifest_is_checked_by_its_files(tmp_path, monkeypatch):
    """A base model imported from elsewhere has no manifest: its files' sha256 (names and sizes past HASH_LIMIT)."""
    from prmflow.errors import DataError
    from prmflow.pipelines import fetch

    base = tmp_path / "base-model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"\x01" * 64)
    whole = datasets.describe("policy", base, "training")
    monkeypatch.setattr(datasets, "HASH_LIMIT", 32)
    sized = datasets.describe("policy", base, "training")
    assert (whole.kind, sized.kind) == ("directory", "directory-by-size")
    fetch.verify_local(whole, base), fetch.verify_local(sized, base)
    (base / "model.safetensors").write_bytes(b"\x02" * 64)  # same size, other bytes
    with pytest.raises(DataError, match="does not match the digest MLflow recorded"):
        fetch.verify_local(whole, base)
    fetch.verify_local(sized, base)  # what a by-size record cannot see
    (base / "model.safetensors").write_bytes(b"\x02" * 65)
    with pytest.raises(DataError, match=f"'{base}' does not match the digest MLflow recorded"):
        fetch.verify_local(sized, base)
