"""`run-local` of the tiny pipeline with pipeline.schedule: off_by_one: the real stages through kfp.local.

Rollouts 0 and 1 sample with the SFT policy, rollout 2 with ppo 0's; ppo 1 trains policy 1 on samples of
policy 0, so its recomputed old log-probs part from the rollout's (the staleness, `ppo/old_logprob_gap_*`)
and the importance weights pi_1 / pi_0 it logs (`ppo/is_*`) are not 1; ppo 0's samples are its own policy's.
"""

import os
import re
import sys

import pytest
import yaml

from tiny_pipeline import tiny_pipeline
from prmflow import cli

OFF_BY_ONE = tiny_pipeline(
    pipeline={"experiment": "schedule-test", "iterations": 3, "rollout_shards": 1, "schedule": "off_by_one"},
    ppo={"minibatch_size": 4, "micro_batch_size": 4, "optim": {"lr": 1e-3, "warmup_steps": 1},
         "rollout_correction": "token_truncate", "recompute_old_logprobs": True},
)


@pytest.mark.slow  # ~3 min on 2 cores
@pytest.mark.timeout(900)
def test_off_by_one_runs_locally_with_stale_samples_weighted(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(OFF_BY_ONE))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    assert cli.main(["pipeline", "run-local", "--config", str(cfg), "--root", str(tmp_path / "root"),
                     "--param", f"tracking_uri={store}"]) == 0

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("schedule-test").experiment_id], max_results=100)
    by_name = {r.info.run_name: r for r in runs}
    ws = str(tmp_path / "root" / "workspace")
    for k, sampled_with in ((0, "sft"), (1, "sft"), (2, "ppo-0")):
        sampled = by_name[f"rollout-iter{k}"].data.params["policy"]
        assert re.fullmatch(rf"{ws}/{sampled_with}-[0-9a-f]{{16}}(/policy)?", sampled), k
        assert by_name[f"rollout-iter{k}"].data.params["iteration"] == str(k)
    for k, trains in ((1, "ppo-0"), (2, "ppo-1")):
        assert re.fullmatch(rf"{ws}/{trains}-[0-9a-f]{{16}}/policy", by_name[f"ppo-iter{k}"].data.params["policy"]), k
    m = {k: by_name[f"ppo-iter{k}"].data.metrics for k in range(3)}
    assert all({"ppo/is_weight_mean", "ppo/is_weight_raw_max", "ppo/old_logprob_gap_mean"} <= set(m[k]) for k in m)
    # ppo 0 trains the policy that sampled: the rollout's float32 log-probs and its own agree up to summation order
    assert m[0]["ppo/old_logprob_gap_max"] < 1e-4 and m[0]["ppo/is_weight_raw_max"] < 1 + 1e-4
    # ppo 1 and 2 train a policy one update newer than the sampler's
    for k in (1, 2):
        assert m[k]["ppo/old_logprob_gap_mean"] > 1e-3, (k, m[k])
        assert m[k]["ppo/is_weight_raw_max"] > 1 + 1e-3, (k, m[k])
    final = [r for r in runs if r.data.tags.get("prmflow.role") == "pipeline"][0]
    assert final.info.status == "FINISHED" and "final/accuracy" in final.data.metrics
