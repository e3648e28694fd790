"""`prmflow pipeline run-local`: the real DAG through kfp.local (subprocesses, no docker), tiny budgets.

Every stage runs for real (SFT, PRM on the SFT backbone, two RL iterations of two rollout shards,
advantage, PPO, evaluate); the MLflow store it leaves behind is what a user would open in the UI.
"""

import builtins
import logging
import os
import re
import sys
import time

import pytest
import yaml

from tiny_pipeline import tiny_pipeline
from prmflow import cli

TINY = tiny_pipeline(
    pipeline={"experiment": "run-local-test"},
    # 8 rollouts per iteration in two minibatches: the second update's approx_kl measures the first one's step
    ppo={"minibatch_size": 4, "micro_batch_size": 4},
)


def _assert_weights_moved(before_dir: str, after_dir: str) -> None:
    from pathlib import Path

    from safetensors.torch import load_file

    before, after = load_file(Path(before_dir) / "model.safetensors"), load_file(Path(after_dir) / "model.safetensors")
    assert before.keys() == after.keys()
    moved = [name for name in before if not (before[name] == after[name]).all()]
    # two PPO iterations with a nonzero learning rate move every trained matrix (nothing here is frozen)
    assert len(moved) >= len(before) // 2, f"only {len(moved)} of {len(before)} tensors changed"


@pytest.mark.timeout(900)
def test_run_local_runs_the_whole_dag_and_records_one_parent_run(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # kfp.local writes its local_outputs there
    # the task subprocesses must import this checkout and stay on one thread each (2-core CI)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))

    # another pipeline logging to the same store, whose parent run is the experiment's newest: the closing table
    # and the compare link must still be this run's own
    other = MlflowClient(store)
    other_parent = other.create_run(other.create_experiment("run-local-test"), start_time=int(time.time() * 1000) + 86_400_000,
                                    tags={"prmflow.role": "pipeline", "prmflow.pipeline_run_id": "another-pipeline"},
                                    run_name="another-pipeline").info
    for k in (0, 1):
        other.create_run(other_parent.experiment_id, run_name=f"ppo-iter{k}",
                         tags={"mlflow.parentRunId": other_parent.run_id, "prmflow.stage": "ppo"})

    handlers, printer = logging.getLogger().handlers[:], builtins.print
    assert cli.main(["pipeline", "run-local", "--config", str(cfg), "--root", str(tmp_path / "root"),
                     "--param", f"tracking_uri={store}"]) == 0
    # kfp.local swapped the root logger's handlers; a later record must not go to its (closed) stream;
    # and its per-task indenting print (undone out of order by the shards' threads) is gone
    assert logging.getLogger().handlers == handlers and builtins.print is printer

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("run-local-test")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
            if other_parent.run_id not in (r.info.run_id, r.data.tags.get("mlflow.parentRunId"))]
    parents = [r for r in runs if r.data.tags.get("prmflow.role") == "pipeline"]
    assert len(parents) == 1, [r.data.tags for r in runs]
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1  # every stage run hangs under the one parent
    names = sorted(r.info.run_name for r in children)
    expected = ["evaluate", "prm", "sft"]
    for k in (0, 1):
        expected += [f"rollout-iter{k} shard 0/2", f"rollout-iter{k} shard 1/2", f"advantage-iter{k}", f"ppo-iter{k}"]
    assert names == sorted(expected)
    assert all(r.info.status == "FINISHED" for r in children)
    by_name = {r.info.run_name: r for r in children}
    # the stages got the pipeline's settings and their inputs from the upstream artifacts
    assert by_name["sft"].data.params["max_steps"] == "12"
    # weights are read in place from the workspace (ROOT/workspace stands in for the RWX volume): the
    # SFT policy as the PRM's backbone, ppo-0's policy by the next iteration's rollouts; the KFP
    # artifacts of those models are locations of a few hundred bytes, not the weights
    workspace = str(tmp_path / "root" / "workspace")
    assert by_name["prm"].data.params["backbone"].startswith(f"{workspace}/sft-")
    for shard in ("0/2", "1/2"):
        assert re.fullmatch(rf"{workspace}/ppo-0-[0-9a-f]{{16}}/policy",
                            by_name[f"rollout-iter1 shard {shard}"].data.params["policy"])
    artifacts = [p for p in (tmp_path / "root").glob("prmflow-*/ppo*/updated") if p.is_dir()]
    assert len(artifacts) == 2 and all(sorted(f.name for f in a.iterdir()) == ["location.json"] for a in artifacts)
    assert all(f.stat().st_size < 4096 for a in artifacts for f in a.iterdir())
    assert by_name["ppo-iter1"].data.params["iteration"] == "1"
    assert {"train/policy_loss", "train/clip_frac"} <= set(by_name["ppo-iter0"].data.metrics)
    # RL did something, not only plumbing: the advantages were not all equal (all-zero advantages give PPO no
    # gradient), the policy moved away from the one that sampled (approx_kl > 0), and the evaluated policy's
    # weights differ from the SFT policy that PPO started from
    for k in (0, 1):
        assert by_name[f"advantage-iter{k}"].data.metrics["advantage/advantage_std"] > 0
        kl = [m.value for m in client.get_metric_history(by_name[f"ppo-iter{k}"].info.run_id, "train/approx_kl")]
        # the first update's approx_kl is float noise (~1e-14: the policy has not moved yet); the second one's
        # is the first step's (~1e-6 at lr 1e-4)
        assert len(kl) >= 2 and max(kl) > 1e-9, kl
    _assert_weights_moved(by_name["ppo-iter0"].data.params["policy"], by_name["evaluate"].data.params["policy"])
    # the parent carries the whole configuration and the evaluation headline
    assert parent.data.params["sft.max_steps"] == "12"
    assert "final/accuracy" in parent.data.metrics and "eval/accuracy" not in parent.data.metrics
    assert parent.data.metrics["sft/eval_accuracy"] == by_name["sft"].data.metrics["sft/eval_accuracy"]
    assert "prm/eval_step_auc" in parent.data.metrics and "eval/step_auc" not in parent.data.metrics
    # the console is quiet: kfp.local's executor JSON and the tasks' own output went to the log file
    out = capsys.readouterr().out
    before_table = out.split(f"MLflow run {parent.info.run_id}")[0]
    assert "executor" not in before_table.lower() and len(before_table.splitlines()) <= 3, before_table
    assert re.search(r"^pipeline finished in \d+ s", out, re.M), out  # not indented by kfp.local's print
    assert not (tmp_path / "root" / ".kfp-workspace").exists()  # kfp.local's own workspace is not left behind
    log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "root" / "run-local.log").read_text())  # kfp colors the status
    assert log.count("finished with status SUCCESS") >= len(expected) and "rollout: " in log
    # the closing table: one row per stage/iteration, numbers as MLflow has them
    table = out.split(f"MLflow run {parent.info.run_id}")[1]
    rows = {line.split("  ")[0].strip(): line.split()[-4:] for line in table.splitlines()[2:] if line.strip()}
    assert {"sft", "iter 0", "iter 1", "sft (same prompts)", "final"} <= set(rows)
    assert rows["final"][0] == f"{parent.data.metrics['final/accuracy']:.3f}"
    shards = [r for r in children if r.info.run_name.startswith("rollout-iter1 ")]
    reward = sum(r.data.metrics["rollout/reward_mean"] * r.data.metrics["rollout/samples"] for r in shards) / sum(
        r.data.metrics["rollout/samples"] for r in shards)
    assert rows["iter 1"][1] == f"{reward:.3f}"  # the batch mean over both shards
    assert client.get_metric_history(parent.info.run_id, "pipeline/reward_mean")[-1].value == pytest.approx(reward)
    # the compare link lists this run's two ppo runs, not the other pipeline's
    link = re.search(r"compare the 2 RL iterations \(their ppo runs\) side by side: (\S+)", out)
    assert link, out
    assert all(by_name[f"ppo-iter{k}"].info.run_id in link.group(1) for k in (0, 1)) and other_parent.run_id not in out


@pytest.mark.slow  # ~100 s on 2 cores; the test above keeps the whole DAG in the quick suite
@pytest.mark.timeout(900)
def test_compare_runs_each_variant_on_one_shared_warm_up(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    cfg = {**TINY, "pipeline": {"iterations": 1, "rollout_shards": 1, "experiment": "compare-test"},
           "variants": {"outcome-only": {"advantage": {"estimator": "grpo"}},
                        "grpo_process": {"advantage": {"estimator": "grpo_process"}}}}
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # variant order matters
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))

    assert cli.main(["pipeline", "compare", "--config", str(tmp_path / "compare.yaml"), "--root",
                     str(tmp_path / "runs"), "--param", f"tracking_uri={store}"]) == 0

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("compare-test")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {r.info.run_name: r for r in runs if r.data.tags.get("prmflow.role") == "pipeline"}
    assert set(parents) == {"outcome-only", "grpo_process"}
    stages = {name: sorted(r.data.tags.get("prmflow.stage") for r in runs
                           if r.data.tags.get("mlflow.parentRunId") == p.info.run_id) for name, p in parents.items()}
    assert stages["outcome-only"] == ["advantage", "evaluate", "ppo", "prm", "rollout", "sft"]
    assert stages["grpo_process"] == ["advantage", "evaluate", "ppo", "rollout"]  # SFT and PRM imported
    assert parents["grpo_process"].data.params["advantage.estimator"] == "grpo_process"
    assert parents["outcome-only"].data.params["advantage.estimator"] == "grpo"
    # both evaluations scored the same SFT policy on the same prompts
    base = {n: p.data.metrics["final/baseline_accuracy"] for n, p in parents.items()}
    assert base["outcome-only"] == base["grpo_process"]
    table = (tmp_path / "runs" / "comparison.txt").read_text()
    assert "outcome-only" in table and "grpo_process" in table and "PRM best-of-k" in table


def test_a_run_that_stops_before_its_pipeline_leaves_no_kfp_workspace_in_tmp(tmp_path, monkeypatch, capsys):
    """kfp.local.init makes a workspace directory; left to kfp.local it is a new /tmp/kfp-workspace-* that only a
    started pipeline removes, so every run stopped before that (here: the DAG cannot be built) leaked one."""
    import tempfile

    from prmflow.errors import ConfigError
    from prmflow.pipelines import pipeline

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where kfp.local's mkdtemp would put it

    def stopped(*args, **kwargs):
        raise ConfigError("stopped while building the DAG")

    monkeypatch.setattr(pipeline, "build", stopped)
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    root = tmp_path / "root"
    assert cli.main(["pipeline", "run-local", "--config", str(cfg), "--root", str(root),
                     "--param", f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]) != 0
    assert "stopped while building the DAG" in capsys.readouterr().err
    assert list(scratch.iterdir()) == []
    assert not (root / ".kfp-workspace").exists()


def test_run_local_does_not_retry_a_failed_stage():
    """The cluster's retry policy (for a preempted pod: 2 retries, 120 s backoff doubling) made a run-local whose sft
    pointed at a policy that is not there wait 6 minutes before it failed; on one machine a retry only waits."""
    from google.protobuf import json_format

    from prmflow.pipelines.pipeline import build
    from prmflow.pipelines.settings import load_spec

    def retried(workspace):
        spec = json_format.MessageToDict(build(load_spec("tiny", None, TINY), workspace=workspace, run_id="r").pipeline_spec)
        dags = [spec["root"].get("dag", {})] + [c.get("dag", {}) for c in spec.get("components", {}).values()]
        return sorted(name for dag in dags for name, task in dag.get("tasks", {}).items() if "retryPolicy" in task)

    assert "sft" in retried(None)  # compiled for a cluster: retried
    assert retried("/run-local/workspace") == []


def test_a_failed_task_is_one_error_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """kfp.local raises RuntimeError when a task fails: it reached the terminal as a 40-line traceback."""
    from types import SimpleNamespace

    from prmflow.pipelines import chain_packages, pipeline

    def failing(**arguments):
        raise RuntimeError("Pipeline 'prmflow' finished with status FAILURE. Inner task failed: 'sft' inside 'exit-handler-1'.")

    inputs = {"tracking_uri": SimpleNamespace(default="")}
    monkeypatch.setattr(pipeline, "build", lambda *a, **k: type("Pipeline", (), {"component_spec": SimpleNamespace(inputs=inputs),
                                                                                  "__call__": staticmethod(failing)})())
    monkeypatch.setattr(chain_packages, "per_run", lambda spec: spec.pipeline.iterations)  # no compile of the stand-in
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    assert cli.main(["pipeline", "run-local", "--config", str(cfg), "--root", str(tmp_path / "root"),
                     "--param", f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]) == 1
    assert "prmflow pipeline: error: run-local: a task failed; its error is above." in capsys.readouterr().err
