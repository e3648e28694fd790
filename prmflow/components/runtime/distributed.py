"""Data-parallel ranks: who this process is, the few collectives the stages need, and the launch.

A training stage (sft, prm, ppo) runs as N ranks when `engine.nproc_per_node` asks for more than one
(0 = one per visible GPU, 1 on a CPU machine). The user starts it as always (`prmflow sft ...`, the
KFP component, `stage.run(cfg)`): `launch` re-executes the stage through torchrun's own Python entry
point (`torch.distributed.run`, its elastic agent and c10d rendezvous on this node), with the config
written to a file; the ranks see torchrun's environment (`under_launcher`) and do not launch again. Under an outside torchrun (a
Kubeflow TrainJob, or a user's `torchrun --nproc-per-node N prmflow sft ...`) nothing is re-launched.

What the ranks share (the rules the stages follow):
- every rank reads the whole input and forms the same global batches in the same order; each rank
  takes its `shard` of every micro-batch, and every loss is normalized by the count of the whole
  global step (which every rank can compute from the shared data, no collective needed);
- only rank 0 (`is_main`) writes outputs, manifests and checkpoints' shared files, and tracks in
  MLflow; decisions that touch the file system are taken on rank 0 and broadcast (`on_main`);
- a stop request (SIGTERM) is agreed on by all ranks (`any_rank`) so they checkpoint at the same step;
- a rank that dies is noticed by torchrun's agent, which stops the others; a rank that hangs is
  stopped by the process-group timeout (`engine.collective_timeout_s`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from ...errors import ConfigError, PrmflowError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankFailedError(PrmflowError):
    """A rank of a multi-process stage failed (its own error is printed above torchrun's summary)."""


def _dist():
    """torch.distributed when this process is in a process group, else None. Looked up, not imported:
    no group can exist before something imported it, and the stages that never train (advantage)
    then start without torch (~1.5 s of imports)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Ranks in this job: the process group's size, else the launcher's WORLD_SIZE, else 1."""
    d = _dist()
    return d.get_world_size() if d else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one rank that writes outputs and tracks."""
    return rank() == 0


def under_launcher() -> bool:
    """Started as a rank by torchrun (a TrainJob, a user's torchrun, or `launch`), or by another launcher
    of several ranks. Not LOCAL_RANK alone: a one-process run sets it for DeepSpeed (`init`), and a
    later stage run in the same process must still be able to launch its ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(timeout_s: float) -> None:
    """Join the process group (gloo on CPU, nccl on GPUs) with collectives that fail after `timeout_s`
    instead of waiting forever for a rank that died or hangs. One process needs no launcher."""
    import deepspeed
    import torch

    if _dist() is not None:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False,
                               timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def leave_group_at_exit():
    """Around the whole of a rank's stage: leave the process group (`destroy_process_group`) when the stage
    returns, or exits through a preemption that all ranks agreed on, before the interpreter shuts down.

    A rank that exits with its gloo group still alive can abort (SIGABRT, "terminate called without an
    active exception") while the interpreter tears down the group's worker threads: seen once in CI, a
    ZeRO-3 ppo rank after its work was done, which failed the whole run. PyTorch asks every trainer
    process to call destroy_process_group at the end. Not after other errors: a rank that failed alone
    may have peers inside a collective, where leaving can hang (the launcher stops them instead). Only
    under a launcher: a one-process run, e.g. several stages in one Python process, keeps its group.

    Seen again after that (CI, same test, rank 1 after its work was done): destroying the
    group does not wait for work already queued on it. A gloo worker thread that finishes a collective
    nobody waited for (ZeRO-3's parameter prefetches, on DeepSpeed's own copy of the world group) drops
    the last reference to its tensors; once the interpreter is finalizing, taking the GIL for that ends
    the thread inside C++ and aborts the process (pytorch/pytorch#179291). So each rank first passes a
    barrier on every group it is in: gloo's barrier completes only after all work queued before it on
    that group, and no rank starts to leave while another still works."""
    try:
        yield
    except SystemExit:  # preemption.Preempted: every rank saved the same step and exits 143 together
        _leave()
        raise
    _leave()


def _leave() -> None:
    d = _dist()
    if d is not None and under_launcher():
        for group in _groups(d):
            d.barrier(group=group)
        d.destroy_process_group()


def _groups(d: Any) -> list:
    """Every process group this rank is in, the world group first (torch keeps the others in a private
    registry, `_world.pg_map`; without it, the world group alone)."""
    registry = getattr(getattr(d.distributed_c10d, "_world", None), "pg_map", {})
    world = d.group.WORLD
    return [world] + [g for g in list(registry) if g is not world and d.get_rank(g) >= 0]


def barrier() -> None:
    d = _dist()
    if d and d.get_world_size() > 1:
        d.barrier()


def on_main(fn: Callable[[], T]) -> T:
    """`fn()` run on rank 0 only, its result (or its error) handed to every rank.

    For decisions that read or repair the file system (is the output complete, which resume
    checkpoint): one rank decides, so the ranks cannot disagree or race on a rename.
    """
    d = _dist()
    if not d or d.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    if d.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except PrmflowError as e:
            box[0] = ("error", e)
            d.broadcast_object_list(box, src=0)
            raise
    d.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (e.g. a SIGTERM that reached one rank first)."""
    d = _dist()
    if not d or d.get_world_size() == 1:
        return bool(flag)
    import torch

    t = torch.tensor([1.0 if flag else 0.0], device=_device(d))
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return bool(t.item() > 0)


def sum_ranks(value: float) -> float:
    """`value` summed over the ranks (a statistic each rank computed on its share of the batch)."""
    d = _dist()
    if not d or d.get_world_size() == 1:
        return value
    import torch

    t = torch.tensor([value], dtype=torch.float64, device=_device(d))
    d.all_reduce(t)
    return float(t.item())


def min_ranks(value: float) -> float:
    """The smallest `value` over the ranks."""
    d = _dist()
    if not d or d.get_world_size() == 1:
        return value
    import torch

    t = torch.tensor([value], dtype=torch.float64, device=_device(d))
    d.all_reduce(t, op=d.ReduceOp.MIN)
    return float(t.item())


def gather_objects(value: T) -> list[T]:
    """Every rank's `value` (picklable: CPU tensors, dicts), in rank order, on every rank; [value] in one process."""
    d = _dist()
    if not d or d.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, value)
    return out


def _device(d) -> torch.device:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if d.get_backend() == "nccl" else torch.device("cpu")


def shard(items: Sequence[T], index: int | None = None, count: int | None = None) -> list[T]:
    """This rank's contiguous part of `items` (the first len % count ranks get one more), so the
    ranks' parts, in rank order, are `items` again."""
    index = rank() if index is None else index
    count = world_size() if count is None else count
    base, extra = divmod(len(items), count)
    start = index * base + min(index, extra)
    return list(items[start:start + base + (1 if index < extra else 0)])


def check_divides(micro_batch_size: int, key: str = "micro_batch_size") -> None:
    """Every rank needs at least one example of every micro-batch."""
    n = world_size()
    if micro_batch_size < n:
        raise ConfigError(f"{key} is {micro_batch_size}, fewer than the {n} ranks that share each micro-batch; "
                          f"raise {key} to at least {n} or lower engine.nproc_per_node.")


# --- launch -----------------------------------------------------------------------------------

def nproc(requested: int, backend: str) -> int:
    """The number of ranks `engine.nproc_per_node` asks for: 0 = one per visible GPU (1 without GPUs,
    and 1 for the one-process torch backend)."""
    if requested < 0:
        raise ConfigError(f"engine.nproc_per_node is {requested}; use 0 (auto: one rank per GPU) or a count.")
    if requested == 0:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() and backend == "deepspeed" else 1
    if requested > 1 and backend != "deepspeed":
        raise ConfigError(f"engine.nproc_per_node={requested} needs engine.backend=deepspeed; the torch backend "
                          f"is one process.")
    return requested


def should_launch(engine_cfg) -> int:
    """How many ranks to start from this process: 0 when already a rank (or one process is asked for)."""
    if under_launcher():
        return 0
    n = nproc(engine_cfg.nproc_per_node, engine_cfg.backend)
    return n if n > 1 else 0


def _how(failure: Any) -> str:
    return (f"exited with status {failure.exitcode}" if failure.exitcode >= 0
            else f"was killed by signal {-failure.exitcode}")


def _root_failure(e: Any) -> tuple[int, Any]:
    """The failed rank to name first: one killed by SIGKILL (the OOM killer, an operator, a lost node:
    nothing inside a rank sends it) before the ranks that then failed because a peer vanished (gloo's
    "Connection reset by peer"), which can exit before the agent sees the killed one; else the earliest."""
    import signal

    killed = [(r, f) for r, f in sorted(e.failures.items()) if f.exitcode == -signal.SIGKILL]
    return killed[0] if killed else e.get_first_failure()


def launch(stage: str, cfg: Any, n: int) -> None:
    """Run `prmflow <stage>` with `cfg` as `n` ranks through torchrun's elastic agent on this node
    (`torch.distributed.run`, standalone c10d rendezvous) and wait for them.

    The agent stops every rank when one fails and forwards SIGTERM to all of them. A failure is a
    RankFailedError naming the first rank that failed and its exit status (the process exits with that
    status: 2 for a user error, 143 for a preempted stage that saved its checkpoint).
    """
    import yaml
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with tempfile.TemporaryDirectory(prefix=f"prmflow-{stage}-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump({stage: dataclasses.asdict(cfg)}, sort_keys=False))
        args = torchrun.parse_args(["--standalone", "--nnodes", "1", "--nproc-per-node", str(n),
                                    "--max-restarts", "0", "--monitor-interval", "0.5",
                                    "--module", "prmflow.cli", stage, "--config", str(config_file)])
        print(f"{stage}: starting {n} ranks (engine.nproc_per_node) with torch.distributed.run", file=sys.stderr)
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            first, failure = _root_failure(e)
            code = failure.exitcode if failure.exitcode > 0 else 1
            also = "".join(f" (rank {r} {_how(f)} too)" for r, f in sorted(e.failures.items()) if r != first)
            err = RankFailedError(f"{stage}: rank {first} of {n} (pid {failure.pid}) {_how(failure)}{also}; "
                                  f"the other ranks were stopped and nothing was committed. Its error is above; "
                                  f"run the same command again to resume from the last checkpoint.")
            err.exit_code = code
            raise err from None
        except SignalException as e:  # SIGTERM/SIGINT to this process: torchrun passed it on to every rank
            from .preemption import exit_code

            print(f"{stage}: stopped by {e.sigval.name}; the ranks saved a resume checkpoint if they could. "
                  f"Run the same command again to continue.", file=sys.stderr)
            raise SystemExit(exit_code(e.sigval)) from None
