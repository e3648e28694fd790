"""`pipeline plan`'s time: the longest path through the compiled DAG, per schedule (plan.critical_path).

Checked two ways: against every path of the compiled DAG enumerated one by one, and against the recurrence
that defines each schedule (when rollout, advantage, ppo and prm-update k may start), written here from
the schedule's definition, not from the spec.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from prmflow.errors import ConfigError
from prmflow.pipelines import plan
from prmflow.pipelines.pipeline import compiled_docs
from prmflow.pipelines.settings import load_spec

from .test_schedule_dag import BASE

SECONDS = [  # distinct per stage; in the second, prm-update is the slow link of the loop
    {"init-tracking": 3, "sft": 50, "prm": 70, "rollout": 19, "advantage": 2, "ppo": 11, "prm-update": 5,
     "evaluate": 17, "finish-tracking": 1},
    {"init-tracking": 3, "sft": 50, "prm": 70, "rollout": 7, "advantage": 2, "ppo": 5, "prm-update": 19,
     "evaluate": 17, "finish-tracking": 1},
]


def spec_at(schedule: str, iterations: int):
    spec = load_spec(None, data=yaml.safe_load(BASE))
    return plan.with_schedule(spec, schedule, iterations)


def ir_of(schedule: str, iterations: int) -> dict:
    return compiled_docs(spec_at(schedule, iterations), iterations)[0]


def by_recurrence(schedule: str, n: int, d: dict) -> float:
    """The run's end from the schedule's definition: rollout k starts once the policy, critic and PRM it reads
    exist (ppo and prm-update k-1, or k-2 off by one; the SFT policy and the trained PRM before that);
    advantage k needs rollout k and ppo k-1's KL state, ppo k advantage k and ppo k-1, prm-update k rollout k
    and prm-update k-1; evaluate the last policy and PRM; finish-tracking the end of everything."""
    lag = {"serial": 0, "off_by_one": 1}[schedule]
    trained = d["init-tracking"] + d["sft"] + d["prm"]
    ppo, upd = {}, {}
    for k in range(n):
        j = k - 1 - lag
        rollout = (max(ppo[j], upd[j]) if j >= 0 else trained) + d["rollout"]
        advantage = max(rollout, ppo.get(k - 1, 0)) + d["advantage"]
        ppo[k] = max(advantage, ppo.get(k - 1, 0)) + d["ppo"]
        upd[k] = max(rollout, upd.get(k - 1, 0)) + d["prm-update"]
    return max(ppo[n - 1], upd[n - 1]) + d["evaluate"] + d["finish-tracking"]


def by_enumeration(ir: dict, d: dict) -> float:
    """The longest of all paths through the DAG's executor tasks, every one listed: a task waits for what its
    own dependentTasks name and what each sub-DAG around it waits for, and a sub-DAG ends with its last task."""
    graph, _ = plan.task_graph(ir)
    parent = {c: t for t, node in graph.items() for c in node["children"]}

    def leaves(t):
        return [t] if not graph[t]["children"] else [x for c in graph[t]["children"] for x in leaves(c)]

    def waits_for(t):
        out, up = [], t
        while up in graph:
            out += [x for dep in graph[up]["deps"] for x in leaves(dep)]
            up = parent.get(up)
        return out

    executors = [t for t in graph if not graph[t]["children"]]
    paths = [[t] for t in executors if not waits_for(t)]
    complete = []
    while paths:  # extend every path by every task that waits for its last one
        path = paths.pop()
        nxt = [t for t in executors if path[-1] in waits_for(t)]
        complete += [path] if not nxt else []
        paths += [path + [t] for t in nxt]
    return max(sum(d[graph[t]["stage"]] for t in p) for p in complete)


@pytest.mark.parametrize("schedule, d", list(itertools.product(plan.SCHEDULES, SECONDS)))
def test_the_critical_path_is_the_longest_path_and_the_schedules_recurrence(schedule, d):
    ir = ir_of(schedule, 4)
    cp = plan.critical_path(ir, d.__getitem__, schedule)
    assert cp.total == by_enumeration(ir, d) == by_recurrence(schedule, 4, d)
    assert cp.iterations == 4


def test_off_by_one_takes_the_slowest_link_per_iteration_serial_the_sum():
    d = SECONDS[0]
    serial, overlapped = (plan.critical_path(ir_of(s, 5), d.__getitem__, s) for s in plan.SCHEDULES)
    # serial: rollout -> advantage -> ppo. Off by one, the slower of two cycles: ppo k-1 -> advantage k (its KL
    # state, advantage.kl_coef > 0) -> ppo k, one iteration; ppo k-1 -> rollout k+1 -> advantage -> ppo k+1, two
    r, a, p = d["rollout"], d["advantage"], d["ppo"]
    assert serial.period == r + a + p == 32
    assert overlapped.period == max(a + p, (r + a + p) / 2) == 16


def test_a_long_run_adds_whole_periods_to_what_a_short_compile_shows():
    spec = load_spec(None, data=yaml.safe_load(BASE))
    for (schedule, d), n in itertools.product(itertools.product(plan.SCHEDULES, SECONDS), (9, 10)):
        at_n = plan.with_schedule(spec, schedule, n)
        got = plan.modelled(at_n, d.__getitem__, schedule)
        full = plan.critical_path(compiled_docs(at_n, n)[0], d.__getitem__, schedule)
        assert (got.total, got.loop, got.period) == pytest.approx((full.total, full.loop, full.period)), schedule


def test_plan_prints_both_schedules_and_the_speedup_from_the_recipes_estimates():
    spec = load_spec(None, data=yaml.safe_load(BASE))
    assert plan.time_lines(spec)[0].startswith("time: no estimate for rollout, advantage, ppo")
    spec.pipeline.task_seconds = {"rollout": 120, "advantage": 30, "ppo": 210}
    lines = plan.time_lines(spec)
    text = "\n".join(lines)
    # serial 6 min an iteration (prm-update 10 s: off the path); off by one advantage + ppo, 4 min (advantage k
    # reads ppo k-1's KL state); without that, ppo alone, 3.5 min
    assert "serial" in lines[3] and "6.0 min" in lines[3] and "<- pipeline.schedule" in lines[3]
    assert "off_by_one" in lines[4] and "4.0 min" in lines[4]
    assert "overlap speedup: 1.50x per iteration" in text, text
    spec.stages["advantage"] = {**spec.stages["advantage"], "kl_coef": 0.0, "estimator": "grpo_process"}
    assert "3.5 min" in plan.time_lines(spec)[4]


def test_durations_from_a_finished_run_are_its_stage_runs_median_spans(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("timed")
    parent = client.create_run(exp, run_name="pipeline").info.run_id
    t0 = 1_700_000_000_000
    spans = {"rollout": [40, 44, 50, 60], "advantage": [5, 7], "ppo": [90, 100, 130], "prm_update": [30]}
    for stage, seconds in spans.items():
        for i, s in enumerate(seconds):
            r = client.create_run(exp, start_time=t0 + i, tags={"mlflow.parentRunId": parent, "prmflow.stage": stage})
            client.set_terminated(r.info.run_id, end_time=t0 + i + s * 1000)
    failed = client.create_run(exp, start_time=t0, tags={"mlflow.parentRunId": parent, "prmflow.stage": "ppo"})
    client.set_terminated(failed.info.run_id, status="FAILED", end_time=t0 + 10**7)  # a failed try is not timed
    other = client.create_run(exp, start_time=t0, tags={"prmflow.stage": "ppo"})  # another pipeline's
    client.set_terminated(other.info.run_id, end_time=t0 + 10**7)
    got = plan.measured_seconds(parent, store)
    assert got == {"rollout": 47.0, "advantage": 6.0, "ppo": 100.0, "prm-update": 30.0}
    spec = load_spec(None, data=yaml.safe_load(BASE))
    lines = plan.time_lines(spec, got, f"MLflow run {parent}")
    assert f"measured in MLflow run {parent}" in lines[0] and "rollout 47 s, advantage 6 s, ppo 100 s" in lines[1]
    serial = plan.critical_path(ir_of("serial", 3), lambda s: got.get(s, plan.BOOKKEEPING_SECONDS))
    assert f"{serial.period / 60:.1f} min" in lines[3]
    with pytest.raises(ConfigError, match="--durations-from nope: no such MLflow run"):
        plan.measured_seconds("nope", store)


ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["qwen2.5-math-1.5b-gsm8k-math.yaml", "qwen2.5-7b-gsm8k-math.yaml"]


def table_minutes(name: str) -> dict[str, float]:
    """{step: minutes} from the recipe's comment table's time column ('| rollout | ... | ~2 min |')."""
    rows = {}
    for line in (ROOT / "configs/cluster" / name).read_text().splitlines():
        m = re.match(r"#\s*\|\s*([a-z ]+?)\s*\|.*\|\s*~(\d+(?:\.\d+)?) min\s*\|\s*$", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    return rows


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipes_estimates_are_their_tables_and_serial_adds_them_up(name):
    from prmflow.pipelines.params import load_with_sets

    minutes = table_minutes(name)
    spec = load_with_sets(str(ROOT / "configs/cluster" / name), [])
    for stage in ("rollout", "advantage", "ppo"):
        assert spec.pipeline.task_seconds[stage] == 60 * minutes[stage], stage
    serial = plan.modelled(spec, lambda s: spec.pipeline.task_seconds.get(s, plan.BOOKKEEPING_SECONDS), "serial")
    assert serial.period == 60 * minutes["per iteration"]
