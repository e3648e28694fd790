"""pipeline.schedule: off_by_one, read from the compiled spec.

Rollout k+1 samples with policy k (what ppo k-1 wrote) while ppo k trains on rollout k: it waits for
ppo k-1, never for ppo k; rollouts 0 and 1 both sample with the SFT policy. The rollout reads the critic of
the policy it samples with and the PRM of update k-1, so prm-update k does not hold it either. Serial is
the same test with no lag.
"""

from __future__ import annotations

import pytest
import yaml

from prmflow.errors import ConfigError
from prmflow.pipelines import plan
from prmflow.pipelines.settings import load_spec

from .test_compile_submit import compile_spec
from .test_prm_update_dag import UPDATE_YAML, by_name, producer, source, upstream

ITERATIONS = 4
BASE = UPDATE_YAML.replace("  iterations: 3\n", f"  iterations: {ITERATIONS}\n").replace(
    "ppo:\n  optim:\n", "ppo:\n  train_critic: true\n  rollout_correction: token_truncate\n"
                        "  recompute_old_logprobs: true\n  optim:\n") + "advantage:\n  estimator: gae\n  kl_coef: 0.01\n"
SCHEDULES = {"serial": 0, "off_by_one": 1}


def with_schedule(schedule: str) -> str:
    return BASE.replace("  prm_update: true\n", f"  prm_update: true\n  schedule: {schedule}\n")


@pytest.fixture(scope="module", params=list(SCHEDULES))
def compiled(request, tmp_path_factory):
    ir, _, _ = compile_spec(tmp_path_factory.mktemp(request.param), with_schedule(request.param))
    return request.param, ir


def test_the_rollout_samples_with_the_policy_critic_and_prm_lag_iterations_behind(compiled):
    schedule, ir = compiled
    lag = SCHEDULES[schedule]
    for k in range(ITERATIONS):
        j = k - 1 - lag  # the ppo whose policy rollout k samples with (policy j+1), -1: none yet
        assert producer(ir, f"rollout-{k}", "policy") == (f"ppo-{j}" if j >= 0 else "sft"), (schedule, k)
        assert producer(ir, f"rollout-{k}", "critic") == (f"ppo-{j}" if j >= 0 else "sft"), (schedule, k)
        assert producer(ir, f"rollout-{k}", "prm_model") == (f"prm-update-{j}" if j >= 0 else "prm"), (schedule, k)
        # ppo k trains the newest policy, continuing ppo k-1's critic and moments, on rollout k
        assert producer(ir, f"ppo-{k}", "policy") == (f"ppo-{k - 1}" if k else "sft")
        assert producer(ir, f"advantage-{k}", "rollouts") == f"rollout-{k}"
        assert producer(ir, f"prm-update-{k}", "rollouts") == f"rollout-{k}"
        task = by_name(ir)[f"rollout-{k}"][0]  # the global iteration: its prompts and its metrics' step
        assert task["inputs"]["parameters"]["iteration"]["runtimeValue"]["constant"] == k
    assert producer(ir, "evaluate", "policy") == f"ppo-{ITERATIONS - 1}"
    assert producer(ir, "evaluate", "prm_model") == f"prm-update-{ITERATIONS - 1}"


def test_off_by_one_the_next_rollout_waits_for_neither_this_ppo_nor_this_prm_update(compiled):
    schedule, ir = compiled
    for k in range(ITERATIONS - 1):
        before = upstream(ir, f"rollout-{k + 1}")
        if schedule == "serial":
            assert {f"ppo-{k}", f"prm-update-{k}"} <= before
            continue
        assert f"ppo-{k}" not in before and f"prm-update-{k}" not in before and f"advantage-{k}" not in before, k
        assert (f"ppo-{k - 1}" in before) == (k > 0) and (f"prm-update-{k - 1}" in before) == (k > 0), k
        # advantage k reads ppo k-1's KL state (advantage.kl_coef > 0): it waits for ppo k-1 only
        assert {n for n in upstream(ir, f"advantage-{k + 1}") if n.startswith("ppo-")} == {f"ppo-{j}" for j in range(k + 1)}


@pytest.mark.parametrize("drop, named", [
    ("  rollout_correction: token_truncate\n", "ppo.rollout_correction: token_truncate"),
    ("  recompute_old_logprobs: true\n", "ppo.recompute_old_logprobs: true"),
])
def test_off_by_one_without_the_correction_is_refused_naming_the_key(tmp_path, drop, named):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(with_schedule("off_by_one").replace(drop, ""))
    with pytest.raises(ConfigError, match=f"pipeline.schedule is off_by_one: .*Set {named}, or pipeline.schedule: serial"):
        plan.compiled(load_spec(cfg))
    cfg.write_text(with_schedule("serial").replace(drop, ""))  # serial needs neither
    assert plan.compiled(load_spec(cfg))["root"]


def test_an_unknown_schedule_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="schedule"):
        load_spec(None, data=yaml.safe_load(with_schedule("async")))



@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_chain_boundary_samples_as_one_run_does(tmp_path, schedule):
    """2 runs x 2 iterations: the second run's rollouts sample with what rollouts 2 and 3 of one 4-iteration run
    sample with. Off by one, its first rollout reads the policy, critic and PRM one update older than the newest,
    which the first run's chain-next recorded (its ppo 0 and prm-update 0); serial, the newest."""
    from prmflow import cli
    from prmflow.pipelines.settings import safe_loader

    cfg = yaml.safe_load(with_schedule(schedule))
    cfg["pipeline"].update(iterations=4, run_iterations=2, rollout_shards=1)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["pipeline", "compile", "--config", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "p.yaml")]) == 0
    first, last = (next(d for d in yaml.load_all((tmp_path / f).read_text(), Loader=safe_loader()) if d)
                   for f in ("p.yaml", "p.last.yaml"))
    newest = {"policy": ("ppo-1", "updated"), "critic": ("ppo-1", "critic"), "prm_model": ("prm-update-1", "updated_prm")}
    older = {"policy": ("ppo-0", "updated"), "critic": ("ppo-0", "critic"), "prm_model": ("prm-update-0", "updated_prm")}
    for piece in newest:
        assert source(first, "chain-next", piece) == newest[piece]
        if schedule == "off_by_one":  # global iterations 2 and 3: policy 1 (recorded) and policy 2 (the newest)
            assert source(first, "chain-next", f"sampled_{piece}") == older[piece]
            assert source(last, "rollout-0", piece) == ("chain-resume", f"sampled_{piece}")
            assert source(last, "rollout-1", piece) == ("chain-resume", piece)
        else:  # policy 2 (recorded) and policy 3 (this run's ppo 0)
            assert f"sampled_{piece}" not in by_name(first)["chain-next"][0]["inputs"]["artifacts"]
            assert source(last, "rollout-0", piece) == ("chain-resume", piece)
            assert source(last, "rollout-1", piece) == older[piece]
    assert source(last, "ppo-0", "policy") == ("chain-resume", "policy")  # ppo trains the newest either way
