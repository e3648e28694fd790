"""Preemption: when asked to stop, a training stage saves its resume checkpoint and exits 128 + signal.

Kubernetes stops a pod (node drain, spot/preemptible GPU reclaimed, a cancelled run) by sending
SIGTERM to the container's main process, waiting `terminationGracePeriodSeconds` (30 s unless the
pod says otherwise) and then sending SIGKILL. A stage that only dies loses everything since its last
periodic checkpoint; a stage that listens saves where it is and the next run continues from there:

    with preemption.Preemption() as stop:          # installs the handler, restores the old one after
        while step < max_steps:
            ...one optimizer step...
            if stop.requested:
                checkpoint.save(...)                 # the resume checkpoint, as at save_every
                raise preemption.stopped("sft", step, where, stop.signum)   # says where; exits 143 (SIGTERM), 130 (SIGINT)

The handler only sets a flag: nothing is written from signal context, and the training step in
progress finishes normally, so the checkpoint is the same one a periodic save would have written
(resume stays bit-for-bit). The grace period must cover the rest of one optimizer step plus one
checkpoint save; raise `terminationGracePeriodSeconds` for big models. 143 = 128 + SIGTERM is the
status a process stopped by SIGTERM reports, so KFP and Kubernetes read it as "terminated", and a
retry policy restarts the step. SIGINT (Ctrl-C) is handled the same way once and exits 130 (128 +
SIGINT, what a shell reports for a program stopped by Ctrl-C); a second Ctrl-C interrupts at once.
Repeated SIGTERMs are ignored while the checkpoint is written.

N ranks (runtime/distributed.py): the SIGTERM goes to the torchrun agent (the stage's own launcher or
an outside torchrun), which passes it to every rank and kills them 30 s later. A rank may see it a
step later than another, so the loops ask `distributed.any_rank(stop.requested)` after every step:
all ranks save the same step's checkpoint (a collective save) and exit 143 together.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

#: Exit status of a stage stopped by SIGTERM after saving its checkpoint (128 + 15).
EXIT_CODE = 128 + signal.SIGTERM


def exit_code(signum: int | None) -> int:
    """The status a process stopped by `signum` reports: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum) if signum else EXIT_CODE


class Preempted(SystemExit):
    """Raised after the resume checkpoint is saved; exits the process with 128 + the signal that asked
    (143 for SIGTERM, the default; 130 for Ctrl-C).

    A SystemExit, so it passes through `except Exception` (and the CLI's PrmflowError handler)
    and atomic-output blocks clean up on the way out.
    """

    def __init__(self, stage: str, step: int, checkpoint: str = "", signum: int | None = signal.SIGTERM):
        super().__init__(exit_code(signum))
        self.stage, self.step, self.checkpoint = stage, step, checkpoint
        self.signum = int(signum) if signum else int(signal.SIGTERM)

    def __str__(self) -> str:
        return (f"{self.stage}: stopped after step {self.step} on request ({signal.Signals(self.signum).name}); "
                f"the resume checkpoint is in '{self.checkpoint}'. Run the same command again to continue.")


def stopped(stage: str, step: int, checkpoint: str, signum: int | None) -> Preempted:
    """The Preempted to raise once the resume checkpoint is saved, after telling the user where it is.

    Said once, on stderr, and not logged as well: the CLI shows WARNING logs on stderr, so a logged copy
    printed the same sentence twice; under torchrun by rank 0 only (the launcher prints every rank's stderr)."""
    stop = Preempted(stage, step, checkpoint, signum)
    if os.environ.get("RANK", "0") == "0":  # every launcher sets RANK (distributed.rank; it imports this module)
        print(stop, file=sys.stderr, flush=True)
    return stop


class Preemption:
    """Catches SIGTERM (and a first SIGINT) while active and records that a stop was asked for.

    Outside the main thread signal handlers cannot be installed: then it never reports a request,
    and the process keeps the default behaviour (killed by SIGTERM, resumed from the last save).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """A stop was asked for: save the resume checkpoint and raise Preempted."""
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the save
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()
            # os.write is safe here; logging and print may not be (re-entrant buffered I/O)
            os.write(2, f"prmflow: received {signal.Signals(signum).name}; saving a resume checkpoint after the "
                        f"current step, then exiting with status {exit_code(signum)}.\n".encode())

    def install(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: preemption signals are not handled here")
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.uninstall()
        return False


#: A Preemption that is never installed: for loops run without one (tests, library calls).
NEVER = Preemption(signals=())
