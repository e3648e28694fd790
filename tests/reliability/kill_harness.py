"""Kill-and-resume harness: run a stage as `python -m prmflow.cli <stage> ...`, kill it at random
moments, start it again with the same arguments, and check what a user and a downstream stage see.

For every seed of a `StageCase`:
  1. a seeded RNG picks 1..max_kills kills, each one a signal from `case.signals` fired at a
     random time (a fraction of the uninterrupted run's duration), or the moment a file matching
     one of `case.kill_events` appears (mid-checkpoint, mid-commit), or, for the first kill of two
     seeds in three of a stage with a resume checkpoint, a random delay after its first checkpoint
     appears (so the restart resumes, however fast or slow the shared machine is today);
  2. while the stage runs, a reader polls the output path: whenever it exists it must be a whole,
     committed output (`case.read` passes: manifest present, checksums match, data readable);
  3. after every kill: SIGKILL -> exit -9; SIGTERM -> exit 143 within `case.grace_s` with its resume
     checkpoint on disk (or 0 if it had finished, or -15 if the signal beat the handler's install);
     the output is absent or whole;
  4. the last start runs to the end (exit 0), leaves no temporaries or work directory behind, and
     `case.compare(reference, output)` holds: equal to an uninterrupted run of the same argv.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.01


@dataclass
class StageCase:
    """One stage under the harness. `argv(run_dir, inputs)` gives the CLI args after `prmflow`;
    the output must be `run_dir / output`."""

    name: str
    argv: Callable[[Path, Path], list[str]]
    read: Callable[[Path], None]
    """What a downstream reader does with a committed output; raises if it is not whole."""
    compare: Callable[[Path, Path], None]
    """Assert that the output (2nd) equals the uninterrupted reference (1st); say how they differ."""
    prepare: Callable[[Path], None] | None = None
    """Write shared inputs (rollouts, datasets) into the inputs directory, once per session."""
    output: str = "out"
    signals: tuple[int, ...] = (signal.SIGKILL,)
    """Signals to send: add SIGTERM where the stage checkpoints on it (runtime/preemption.py)."""
    kill_events: tuple[str, ...] = ()
    """Globs relative to the run dir: a kill fires as soon as one matches (e.g. '.out.work/.latest.tmp-*')."""
    checkpoint: str | None = None
    """Glob relative to the run dir that must exist after a stage exits 143 (its resume checkpoint)."""
    changed_argv: tuple[str, ...] = ()
    """Flags appended to argv that change the result (the idempotence test expects a refusal)."""
    max_kills: int = 3
    ci_seeds: int = 2
    """Seeds in CI; PRMFLOW_KILL_SEEDS=N runs N per stage instead (the full run uses >= 20)."""
    timeout_s: float = 600.0
    grace_s: float = 30.0
    """Kubernetes' default terminationGracePeriodSeconds: SIGTERM to exit must fit in it."""


@dataclass
class Attempt:
    rc: int
    seconds: float
    signal: int | None = None
    trigger: str = ""
    exit_after_signal_s: float | None = None
    outputs_read: int = 0
    resumed: bool = False
    """The stage said it continued from a resume checkpoint ("resuming from ..." on stdout)."""
    checkpoint_at_s: float | None = None
    """Seconds after the start when `case.checkpoint` first existed (the first periodic save)."""
    commit_at_s: float | None = None
    """Seconds after the start when the output's temporary sibling, or the output, first existed (training is over)."""


@dataclass
class SeedResult:
    case: str
    seed: int
    attempts: list[Attempt] = field(default_factory=list)
    matched: bool = False

    @property
    def kills(self) -> list[Attempt]:
        """Attempts that a signal actually ended (not those that finished first)."""
        return [a for a in self.attempts if a.signal is not None and a.rc != 0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seeds_for(case: StageCase) -> int:
    return int(os.environ.get("PRMFLOW_KILL_SEEDS", case.ci_seeds))


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # one thread: the same float summation order in every run (bit-for-bit), and no oversubscription
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def _check_output(case: StageCase, out: Path) -> int:
    """Read `out` as a downstream stage would, if it exists. Returns 1 if it was read."""
    if not out.exists():
        return 0
    try:
        case.read(out)
    except Exception as e:
        raise AssertionError(f"{case.name}: a reader found a partial or damaged output at {out}: {e!r}") from e
    return 1


def run_attempt(case: StageCase, argv: list[str], run_dir: Path, kill: tuple[str, object, int] | None,
                log_name: str) -> Attempt:
    """Start the stage; fire `kill` = (kind, what, signal) if it comes first: ('time', seconds), ('event', glob)
    or ('after', (glob, seconds)): that long after a file matching glob first appears."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = run_dir / case.output
    with open(logs / f"{log_name}.out", "wb") as so, open(logs / f"{log_name}.err", "wb") as se:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "prmflow.cli", *argv], cwd=run_dir, env=env(),
                                stdout=so, stderr=se, start_new_session=True)
        attempt = Attempt(rc=0, seconds=0.0)
        sent_at = None
        seen_output = False
        watch = (kill[1] if kill[0] == "event" else kill[1][0]) if kill and kill[0] in ("event", "after") else None
        before = _matches(run_dir, watch) if watch else {}
        seen_at = None
        try:
            while proc.poll() is None:
                now = time.monotonic() - t0
                if now > case.timeout_s:
                    raise AssertionError(f"{case.name}: {log_name} did not finish within {case.timeout_s} s")
                if case.checkpoint and attempt.checkpoint_at_s is None and any(run_dir.glob(case.checkpoint)):
                    attempt.checkpoint_at_s = now
                # the temporary sibling may live for less than a poll (a tiny model saves in milliseconds):
                # the output itself, once renamed into place, is the other sign that training is over
                if attempt.commit_at_s is None and (out.exists() or any(run_dir.glob(f".{case.output}.tmp-*"))):
                    attempt.commit_at_s = now
                if not seen_output and out.exists():  # once committed it never changes: read it once
                    attempt.outputs_read += _check_output(case, out)
                    seen_output = True
                if kill is not None and sent_at is None:
                    kind, what, sig = kill
                    # an event is a file that appears (or is replaced) during this attempt, not one left by the last
                    if kind == "time":
                        fire = now >= what
                    else:
                        if seen_at is None and _matches(run_dir, watch).items() - before.items():
                            seen_at = now
                        fire = seen_at is not None and now - seen_at >= (what[1] if kind == "after" else 0)
                    if fire:
                        proc.send_signal(sig)
                        sent_at = time.monotonic()
                        label = round(now, 2) if kind == "time" else what if kind == "event" else f"{what[0]}+{what[1]:.2f}s"
                        attempt.signal, attempt.trigger = sig, f"{kind}:{label}"
                if sent_at is not None and attempt.signal == signal.SIGTERM and time.monotonic() - sent_at > case.grace_s:
                    raise AssertionError(f"{case.name}: still running {case.grace_s} s after SIGTERM "
                                         f"(Kubernetes would SIGKILL it now); see {logs / log_name}.err")
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        attempt.rc = proc.returncode
        attempt.seconds = time.monotonic() - t0
        attempt.resumed = "resuming from" in (logs / f"{log_name}.out").read_text(errors="replace")
        if sent_at is not None:
            attempt.exit_after_signal_s = time.monotonic() - sent_at
    attempt.outputs_read += _check_output(case, out)
    return attempt


def _matches(run_dir: Path, pattern) -> dict[str, tuple[int, int]]:
    """{path: (inode, mtime)} of the files matching `pattern` now."""
    out = {}
    for p in run_dir.glob(str(pattern)):
        try:
            st = p.stat()
        except FileNotFoundError:  # renamed away between glob and stat
            continue
        out[str(p)] = (st.st_ino, st.st_mtime_ns)
    return out


def _expect_exit(case: StageCase, a: Attempt, run_dir: Path, log_name: str) -> None:
    err = (run_dir / "logs" / f"{log_name}.err").read_text(errors="replace")[-3000:]
    if a.rc == 0:
        return
    if a.signal == signal.SIGKILL:
        assert a.rc == -signal.SIGKILL, f"{case.name}: exit {a.rc} after SIGKILL\n{err}"
    elif a.signal == signal.SIGTERM:
        assert a.rc in (143, -signal.SIGTERM), f"{case.name}: exit {a.rc} after SIGTERM (want 143)\n{err}"
        # killed by the signal itself: only right if no handler saw it (before install, or after the stage ended)
        assert a.rc == 143 or "received SIGTERM" not in err, f"{case.name}: the handler saw SIGTERM, yet it died\n{err}"
        if a.rc == 143 and case.checkpoint and not any(run_dir.glob(case.checkpoint)):
            # only legitimate before any progress: nothing to save, the restart begins at step 0 anyway
            assert "after step 0" in err, f"{case.name}: exited 143 without a resume checkpoint\n{err}"
    else:
        raise AssertionError(f"{case.name}: {log_name} failed with exit {a.rc} and no kill\n{err}")


def leftovers(case: StageCase, run_dir: Path) -> list[str]:
    """Temporaries, resume state or fallback files a finished stage should not leave next to its output."""
    return sorted(p.name for p in run_dir.glob(f".{case.output}.*"))


def reference(case: StageCase, root: Path, inputs: Path) -> tuple[Path, float]:
    """An uninterrupted run: (run dir, seconds)."""
    run_dir = root / "reference"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    a = run_attempt(case, case.argv(run_dir, inputs), run_dir, None, "reference")
    _expect_exit(case, a, run_dir, "reference")
    if case.checkpoint:  # without both, _first_kill could not aim a kill between them and would test a restart
        assert a.checkpoint_at_s is not None and a.commit_at_s is not None, (
            f"{case.name}: the reference run's first checkpoint ({case.checkpoint}) or its commit was never seen "
            f"(checkpoint at {a.checkpoint_at_s} s, commit at {a.commit_at_s} s); see {run_dir / 'logs'}")
    (run_dir / "logs" / "reference.json").write_text(json.dumps({"seconds": a.seconds, "checkpoint_at_s": a.checkpoint_at_s,
                                                                 "commit_at_s": a.commit_at_s}))
    return run_dir, a.seconds


def _first_kill(case: StageCase, rng: random.Random, ref_dir: Path, ref_seconds: float, sig: int, seed: int) -> tuple:
    """The first kill of a seed. A training stage spends most of a tiny run starting up (imports, model
    load, and the one-time imports of the first save), so uniform times would mostly kill it before its first
    checkpoint or after its last step, and test a restart, not a resume: two seeds in three fire a random
    delay after the first checkpoint appears, within the time the reference run then trained before it
    began to commit its output. Seed 0 always does, so that even CI's one seed per stage resumes from a
    checkpoint at least once."""
    timing = json.loads((ref_dir / "logs" / "reference.json").read_text())
    first_ckpt, commit = timing.get("checkpoint_at_s"), timing.get("commit_at_s")
    if case.checkpoint and first_ckpt is not None and commit is not None and (seed == 0 or rng.random() < 2 / 3):
        return ("after", (case.checkpoint, rng.uniform(0, 0.9 * (commit - first_ckpt))), sig)
    return ("time", rng.uniform(0.1, 0.8) * ref_seconds, sig)


def _sooner(kill: tuple) -> tuple | None:
    """The same first kill, earlier: half the time into the run (down to 0.5 s), or half the delay after the
    checkpoint appeared, then right when it appears; None when it cannot come sooner."""
    trigger, when, sig = kill
    if trigger == "time":
        return (trigger, when / 2, sig) if when > 0.5 else None
    pattern, delay = when
    if delay == 0:
        return None
    return (trigger, (pattern, delay / 2 if delay > 0.05 else 0.0), sig)


def kill_and_resume(case: StageCase, root: Path, inputs: Path, seed: int, ref_dir: Path, ref_seconds: float) -> SeedResult:
    rng = random.Random(f"{case.name}/{seed}")
    run_dir = root / f"seed-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    argv = case.argv(run_dir, inputs)
    result = SeedResult(case.name, seed)
    planned = rng.randint(1, case.max_kills)
    for k in range(planned + 1):
        kill = None
        if k < planned:
            sig = rng.choice(case.signals)
            if case.kill_events and k > 0 and rng.random() < 0.5:
                kill = ("event", rng.choice(case.kill_events), sig)
            else:  # the first kill lands well inside the run, later ones anywhere up to its end
                kill = (_first_kill(case, rng, ref_dir, ref_seconds, sig, seed) if k == 0
                        else ("time", rng.uniform(0.1, 1.05) * ref_seconds, sig))
        name = f"attempt-{k}"
        a = run_attempt(case, argv, run_dir, kill, name)
        while k == 0 and (a.rc == 0 or (run_dir / case.output).exists()) and (sooner := _sooner(kill)) is not None:
            # the machine sped up and the run committed its output before its first kill landed (not sent, sent to
            # a process that was already done, or to one exiting after its commit, where SIGTERM's default action
            # ends it with -15): that tested nothing, so start the seed over, killing sooner
            shutil.rmtree(run_dir / case.output)
            kill = sooner
            a = run_attempt(case, argv, run_dir, kill, name)
        result.attempts.append(a)
        _expect_exit(case, a, run_dir, name)
        if a.rc == 0:
            break
    else:
        raise AssertionError(f"{case.name} seed {seed}: no attempt finished")
    assert result.attempts[-1].rc == 0
    left = leftovers(case, run_dir)
    assert not left, f"{case.name} seed {seed}: left behind {left} next to the output"
    case.compare(ref_dir / case.output, run_dir / case.output)
    result.matched = True
    return result


def summary(results: list[SeedResult]) -> dict:
    kills = [a for r in results for a in r.kills]
    by_signal = {signal.Signals(s).name: sum(a.signal == s for a in kills) for s in {a.signal for a in kills}}
    exits = sorted(a.exit_after_signal_s for a in kills if a.signal == signal.SIGTERM and a.rc == 143)
    return {
        "seeds": len(results), "matched": sum(r.matched for r in results), "kills": len(kills),
        "kills_by_signal": by_signal,
        "kills_by_trigger": {t: sum(a.trigger.startswith(t) for a in kills) for t in ("time", "event", "after")},
        "sigterm_checkpointed": sum(a.rc == 143 for a in kills),
        "sigterm_default_death": sum(a.rc == -signal.SIGTERM for a in kills),
        "sigterm_exit_s_max": round(exits[-1], 2) if exits else None,
        "finished_before_kill": sum(a.signal is not None and a.rc == 0 for r in results for a in r.attempts),
        "attempts_resumed_from_checkpoint": sum(a.resumed for r in results for a in r.attempts),
        "seeds_that_resumed": sum(any(a.resumed for a in r.attempts) for r in results),
        "output_reads": sum(a.outputs_read for r in results for a in r.attempts),
    }


def dump(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
