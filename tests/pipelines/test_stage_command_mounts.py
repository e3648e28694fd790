"""The `docker run` line of `prmflow stage-command` gives the container everything the stage reads.

A container sees only its mounts: a link in a mounted directory that points at a host path nobody
mounted dangles there. The advantage stage's input on a pipeline run is such a directory (the
gathered rollout shards, each entry a link to a shard's own directory), and the old line mounted it
whole: in the image the stage failed with "'/inputs/input' has no manifest.json". The check here
reads the line as a container engine would (mounts, longest prefix first) and follows every link
inside the container's view, for every stage of a real `pipeline run-local` run.
"""

from __future__ import annotations

import contextlib
import io as stdio
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiny_pipeline import tiny_pipeline
from prmflow import cli
from prmflow.components.advantage import stage as advantage
from prmflow.components import config
from prmflow.components.data import schema
from prmflow.pipelines import kfp_shim
from prmflow.errors import DataError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "advantage"))
from advantage_reference import random_rollouts  # noqa: E402


class ContainerView:
    """Paths as a container started with these `-v HOST:CONTAINER[:ro]` mounts sees them."""

    def __init__(self, argv: list[str]):
        # the engine resolves a mount's source on the host; inside it, links are the container's business
        volumes = (argv[i + 1].split(":") for i, a in enumerate(argv) if a == "-v")
        self.mounts = sorted(((c, Path(h).resolve()) for h, c, *_ in volumes), key=lambda m: -len(m[0]))

    def host(self, path: str) -> Path | None:
        """The host file behind container path `path` (links followed inside the container), None if none."""
        parts = [p for p in path.split("/") if p]
        seen = 0
        resolved = "/"
        while parts:
            resolved = os.path.join(resolved, parts.pop(0))
            where = self._mounted(resolved)
            if where is None:
                if not any(c.startswith(resolved.rstrip("/") + "/") for c, _ in self.mounts):
                    return None  # not mounted and no mount below it: the image's own files, not ours
                continue  # a directory the engine creates to hold a mount point
            if where.is_symlink():
                seen += 1
                if seen > 40:
                    return None
                target = os.readlink(where)
                base = "/" if os.path.isabs(target) else os.path.dirname(resolved)
                parts = [p for p in os.path.normpath(os.path.join(base, target)).split("/") if p] + parts
                resolved = "/"
            elif not where.exists():
                return None
        return self._mounted(resolved)

    def exists(self, path: str) -> bool:
        """`path` is there in the container: a mounted file or directory, or one the engine makes for a mount point."""
        host = self.host(path)
        return (host is not None and host.exists()) or any(c.startswith(path.rstrip("/") + "/") for c, _ in self.mounts)

    def _mounted(self, path: str) -> Path | None:
        for c, h in self.mounts:
            if path == c or path.startswith(c.rstrip("/") + "/"):
                return h / os.path.relpath(path, c) if path != c else h
        return None

    def dangling(self) -> list[str]:
        """Every entry under every mount that does not resolve inside the container."""
        bad = []
        for c, h in self.mounts:
            trees = [(h, c)]
            while trees:
                host, cont = trees.pop()
                if self.host(cont) is None:
                    bad.append(f"{cont} (host {host})")
                elif host.is_dir() and not host.is_symlink():
                    trees += [(host / n, f"{cont}/{n}") for n in os.listdir(host)]
        return bad


def printed_line(argv: list[str]) -> list[str]:
    buf = stdio.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return shlex.split(buf.getvalue())  # one line, unless a value holds a newline (chat_template)


def test_a_dangling_shard_link_is_named_not_reported_as_a_missing_manifest(tmp_path):
    shards = [tmp_path / f"rollout-{i}" for i in range(2)]
    for i, d in enumerate(shards):
        schema.write_dataset(d, random_rollouts(np.random.default_rng(i)), "rollouts")
    gathered = kfp_shim.gather_shards([str(d) for d in shards], str(tmp_path / "advantages.inputs"))
    os.rename(shards[1], tmp_path / "moved")  # what a container without that mount sees
    cfg = config.load(advantage.Config, overrides={"input": gathered, "output": str(tmp_path / "adv"),
                                                   "tracking.enabled": "false"})
    with pytest.raises(DataError) as e:
        advantage.run(cfg)
    assert f"'{gathered}/shard-00001' links to '{shards[1]}', which does not exist here" in str(e.value)
    assert "not mounted" in str(e.value) and not (tmp_path / "adv").exists()


def test_the_view_finds_a_link_to_an_unmounted_host_path(tmp_path):
    """The checker itself: the old line (gathered directory mounted whole) is caught, the new one is not."""
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "manifest.json").write_text("{}")
    (tmp_path / "gathered").mkdir()
    (tmp_path / "gathered" / "shard-00000").symlink_to(tmp_path / "shard")
    old = ContainerView(["-v", f"{tmp_path / 'gathered'}:/inputs/input:ro"])
    assert old.dangling() == [f"/inputs/input/shard-00000 (host {tmp_path / 'gathered' / 'shard-00000'})"]
    new = ContainerView(["-v", f"{tmp_path / 'shard'}:/inputs/input/shard-00000:ro"])
    assert new.dangling() == [] and new.host("/inputs/input/shard-00000/manifest.json").is_file()


TINY = tiny_pipeline(
    pipeline={"iterations": 1, "experiment": "mounts-test"}, sft={"max_steps": 4}, prm={"max_steps": 2},
    rollout={"sampling": {"max_new_tokens": 8}}, evaluate={"sampling": {"max_new_tokens": 8}},
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_stage_of_a_local_run_sees_all_its_inputs_in_the_container(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    assert cli.main(["pipeline", "run-local", "--config", str(cfg), "--root", str(tmp_path / "root"),
                     "--param", f"tracking_uri={store}"]) == 0
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("mounts-test").experiment_id])
    children = [r for r in runs if r.data.tags.get("prmflow.stage")]
    assert {r.data.tags["prmflow.stage"] for r in children} == {"sft", "prm", "rollout", "advantage", "ppo", "evaluate"}
    for run in children:
        stage = run.data.tags["prmflow.stage"]
        argv = printed_line(["stage-command", stage, "--run-id", run.info.run_id, "--tracking-uri", store,
                             "--output", str(tmp_path / "rerun" / stage), "--fetch", str(tmp_path / "cache")])
        view = ContainerView(argv)
        assert view.dangling() == [], (stage, argv)
        # every input the stage is told about is there in the container
        for i, a in enumerate(argv):
            if a == "--set" and argv[i + 1].split("=", 1)[1].startswith("/inputs/"):
                key, value = argv[i + 1].split("=", 1)
                assert view.exists(value), (stage, key, value)
        if stage == "advantage":  # the gathered shards: one mount each, each a finished rollouts hand-off
            assert sum(a.endswith(":ro") and ":/inputs/input/shard-" in a for a in argv) == 2
            for shard in ("shard-00000", "shard-00001"):
                assert view.host(f"/inputs/input/{shard}/manifest.json").is_file()
        if stage in ("rollout", "ppo", "evaluate"):
            assert "/inputs/policy" in " ".join(argv), argv
