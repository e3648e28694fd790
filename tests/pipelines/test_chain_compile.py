"""`pipeline compile --set pipeline.iterations=300` of each cluster recipe: a chain of runs (pipelines/chain.py)
whose every package fits one run on Kubeflow Pipelines 2.15, 2.16 and 2.17 with size.py's margin kept
free, measured here on the files written (size.py's model of the Workflow and its node status), and
whose runs cover the 300 iterations once each, in order. Two iterations more per run would not fit
(the size model is linear and may be conservative by one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prmflow import cli
from prmflow.pipelines import chain, size
from prmflow.pipelines.contracts import KFP_VERSIONS
from prmflow.pipelines.settings import safe_loader

from .test_compile_submit import IMAGES

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "cluster").glob("*.yaml"))


def fits(docs: list[dict], version: str) -> bool:
    m, lim = size.measure(docs, version), size.limits(version)
    keep = 1 - size.MARGIN
    return (m.spec <= keep * lim["spec"][0] and m.spec + m.compressed <= keep * lim["stored"][0]
            and m.component_arg <= keep * lim["component_arg"][0])


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=[] if "1.5b" in r.name else [pytest.mark.slow], id=r.stem)
                                    for r in RECIPES])
def test_300_iterations_compile_to_a_chain_whose_every_package_fits_every_kfp_version(recipe, tmp_path, capsys):
    out = tmp_path / "pipeline.yaml"
    assert cli.main(["pipeline", "compile", "--config", str(recipe), *IMAGES, "--set=iterations=300", "-o", str(out)]) == 0
    manifest = yaml.safe_load((tmp_path / "pipeline.chain.yaml").read_text())
    runs = manifest["runs"]
    assert [i for r in runs for i in range(r["first_iteration"], r["first_iteration"] + r["iterations"])] == list(range(300))
    per_run = manifest["run_iterations"]
    assert len(runs) == -(-300 // per_run) and {r["iterations"] for r in runs[:-1]} == {per_run}
    packages = {r["package"] for r in runs}
    assert packages == {"pipeline.yaml", "pipeline.next.yaml", "pipeline.last.yaml"}
    for name in packages:
        docs = [d for d in yaml.load_all((tmp_path / name).read_text(), Loader=safe_loader()) if d]
        for version in KFP_VERSIONS:
            assert fits(docs, version), (name, version)
    # two iterations more in a run would outgrow a limit on some version: K is the most a run holds, up to the linear
    # size model's rounding (it is conservative by one for the agent recipe: K + 1 measured still fits)
    from prmflow.pipelines.commands import load_config
    from prmflow.pipelines.pipeline import compiled_docs

    spec = load_config(str(recipe), [s.removeprefix("--set=") for s in IMAGES] + ["iterations=300"])
    wider = {shape: compiled_docs(spec, per_run + 2, chain.shape_at(shape, per_run + 2)) for shape in chain.SHAPES}
    assert not all(fits(docs, v) for docs in wider.values() for v in KFP_VERSIONS)  # the binding shape may be any
    assert f"a chain of {len(runs)} runs of at most {per_run}" in capsys.readouterr().out


def test_chain_next_submits_only_after_the_whole_run_succeeded_and_never_from_the_cache(tmp_path):
    """chain-next (the step that submits the next run) sits inside the exit handler after the run's last ppo, so a
    failed or stopped run submits nothing; it is never a cache hit (a resubmitted run must submit again); its pod
    carries the label of Kubeflow's PodDefault that projects the pipelines token; `chain` comes from the run."""
    from .test_compile_submit import CLUSTER_YAML

    cfg = yaml.safe_load(CLUSTER_YAML)
    cfg["pipeline"].update(iterations=4, run_iterations=2, rollout_shards=1)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["pipeline", "compile", "--config", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "p.yaml")]) == 0
    spec, platform = [d for d in yaml.load_all((tmp_path / "p.yaml").read_text(), Loader=safe_loader()) if d]
    handler = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    (name, task), = [(n, t) for n, t in handler.items() if t["componentRef"]["name"] == "comp-chain-next"]
    last_ppo = max((n for n, t in handler.items() if t["componentRef"]["name"].startswith("comp-ppo")),
                   key=lambda n: int(n.rsplit("-", 1)[1]) if n[-1].isdigit() else 1)
    assert last_ppo in task["dependentTasks"] and task.get("triggerPolicy") is None  # only when all before succeeded
    assert not task.get("cachingOptions", {}).get("enableCache")
    assert task["inputs"]["parameters"]["chain"] == {"componentInputParameter": "pipelinechannel--chain"}
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    labels = executor[spec["components"][task["componentRef"]["name"]]["executorLabel"]]["podMetadata"]["labels"]
    assert labels == {chain.TOKEN_POD_LABEL: "true"}
