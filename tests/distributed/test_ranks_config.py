"""Fast checks of what decides the ranks: engine.nproc_per_node, the launch decision, the shards."""

from __future__ import annotations

import pytest

from prmflow.components.runtime import distributed
from prmflow.components.training.engine import EngineConfig
from prmflow.errors import ConfigError


def test_shards_are_the_micro_batch_in_order_and_cover_it():
    rows = list(range(7))
    parts = [distributed.shard(rows, r, 3) for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]  # contiguous, rank order, the first len % N get one more
    assert sum(parts, []) == rows


def test_auto_is_one_rank_on_cpu_and_torch_backend_is_one_process():
    assert distributed.nproc(0, "deepspeed") == 1  # no GPU here
    assert distributed.nproc(0, "torch") == 1
    assert distributed.nproc(3, "deepspeed") == 3
    with pytest.raises(ConfigError, match="engine.backend=deepspeed"):
        EngineConfig(backend="torch", nproc_per_node=2)
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        EngineConfig(collective_timeout_s=0)


def test_launches_only_outside_a_launcher(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(key, raising=False)
    assert distributed.should_launch(EngineConfig(nproc_per_node=2)) == 2
    assert distributed.should_launch(EngineConfig(nproc_per_node=1)) == 0
    # what a one-process DeepSpeed run leaves in the environment must not stop a later launch
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.should_launch(EngineConfig(nproc_per_node=2)) == 2
    # a rank started by torchrun (or a TrainJob) does not launch again
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert distributed.should_launch(EngineConfig(nproc_per_node=2)) == 0


def test_micro_batch_smaller_than_the_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    with pytest.raises(ConfigError, match="micro_batch_size is 2, fewer than the 4 ranks"):
        distributed.check_divides(2)


@pytest.mark.own_process
def test_a_rank_leaves_its_process_group_when_its_stage_ends_or_is_preempted(monkeypatch, tmp_path):
    """A rank that exits with its gloo group alive can abort at interpreter shutdown (SIGABRT, "terminate
    called without an active exception"; seen in CI after a ZeRO-3 ppo rank's work was done). The CLI runs
    each stage inside leave_group_at_exit: the group is destroyed after a normal end or an agreed
    preemption (exit 143); kept after another error (peers may be inside a collective, where leaving can
    hang) and outside a launcher (a one-process run keeps its group for the next stage in the process)."""
    import torch.distributed as dist

    from prmflow.components.runtime.preemption import Preempted

    def group():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        (tmp_path / "rendezvous").unlink(missing_ok=True)

    def ends(body):
        try:
            with distributed.leave_group_at_exit():
                body()
        except BaseException as e:
            return type(e).__name__
        return "returned"

    def preempted():
        raise Preempted("sft", 3, "checkpoint")

    def failed():
        raise ValueError("a rank's own error")

    assert not dist.is_initialized()  # a new process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for body, how, left in [(lambda: None, "returned", True), (preempted, "Preempted", True),
                            (failed, "ValueError", False)]:
        if not dist.is_initialized():
            group()
        assert ends(body) == how
        assert dist.is_initialized() is not left, how
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert ends(lambda: None) == "returned" and dist.is_initialized()


@pytest.mark.own_process
def test_a_leaving_rank_first_waits_on_every_group_it_is_in(monkeypatch, tmp_path):
    # DeepSpeed runs ZeRO-3's collectives on its own copy of the world group: a barrier on the world group
    # alone would not wait for work queued there, which a gloo thread may then finish during shutdown
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    world, mine, others = dist.group.WORLD, dist.new_group([0]), dist.new_group([0])
    waited = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda group=None: (waited.append(group), real_barrier(group=group)))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with distributed.leave_group_at_exit():
        pass
    assert waited[0] is world and len(waited) == 3, waited  # the world group, then each other one
    assert {id(g) for g in waited[1:]} == {id(mine), id(others)}, waited
    assert not dist.is_initialized()


def test_a_rank_killed_by_sigkill_is_named_before_a_peer_that_failed_because_it_vanished(monkeypatch, tmp_path):
    # rank 1 is SIGKILLed (the OOM killer); rank 0's gloo then reads "Connection reset by peer" and exits 1,
    # which torchrun's agent may record first: the error must still name rank 1, and rank 0 beside it
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    missing = str(tmp_path / "no-error-file.json")
    failures = {0: ProcessFailure(0, 101, 1, missing), 1: ProcessFailure(1, 102, -9, missing)}
    failures[0].timestamp, failures[1].timestamp = 1000, 1001  # rank 0's exit was seen first

    def run(args):
        raise ChildFailedError("prmflow.cli", failures)

    monkeypatch.setattr(torchrun, "run", run)
    with pytest.raises(distributed.RankFailedError) as e:
        distributed.launch("sft", EngineConfig(), 2)
    assert str(e.value).startswith("sft: rank 1 of 2 (pid 102) was killed by signal 9 (rank 0 exited with status 1 too)")
    assert e.value.exit_code == 1
    # with no SIGKILL among them, the first failure is named, as torchrun orders them
    failures[1] = ProcessFailure(1, 102, 2, missing)
    failures[1].timestamp = 1001
    with pytest.raises(distributed.RankFailedError) as e:
        distributed.launch("sft", EngineConfig(), 2)
    assert str(e.value).startswith("sft: rank 0 of 2 (pid 101) exited with status 1 (rank 1 exited with status 2 too)")
