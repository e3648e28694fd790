"""What `pipeline run-local` shows in the terminal: one line per finished task, a progress bar while a
task runs, and every byte kfp.local and the tasks print in a log file.

kfp.local prints each task's full executor input and output and streams the task's own output
(model load reports, per-step logs) through `print` and a logging handler on `sys.stdout`: hundreds
of lines per run. `task_log` swaps `sys.stdout` and `sys.stderr` for a writer that keeps all of it in
the log file and reads kfp.local's own "Executing task" / "finished with status" lines to drive the
console.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Iterator

from tqdm.auto import tqdm

from ..errors import PrmflowError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_START = re.compile(r"Executing task '([^']+)'")
_DONE = re.compile(r"Task '([^']+)' finished with status (\w+)")
# the last line of a Python traceback, as a task's executor prints it: "prmflow.errors.ModelLoadError: policy ..."
_RAISED = re.compile(r"^\s*((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)): (.+)$")


class TaskLog(io.TextIOBase):
    """A text stream that appends to `log` and reports kfp.local's task lines to `bar` (tqdm)."""

    def __init__(self, log: IO[str], bar: tqdm, console: IO[str]):
        self.log, self.bar, self.console = log, bar, console
        # kfp.local runs a ParallelFor's tasks on threads that print at once, and `print(x)` is two
        # writes (x, then the newline): each thread's text is put together into lines on its own, so
        # one thread's line never runs into another's (in the log, or where a task line is looked for)
        self.pending: dict[int, str] = {}
        # re-entrant: whatever tqdm itself prints to the (redirected) sys.stdout/stderr while the lock
        # is held comes back here
        self.lock = threading.RLock()
        # keyed by thread as well: a ParallelFor's shards share a task name, and each task's start and
        # finish lines come from the thread that runs it
        self.started: dict[tuple[int, str], float] = {}
        self.finished: list[tuple[str, str, float]] = []
        self.running: dict[int, str] = {}  # thread -> the task it runs
        self.raised: dict[str, str] = {}  # task -> the last exception line it printed

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self.lock:
            thread = threading.get_ident()
            *lines, rest = (self.pending.pop(thread, "") + s).split("\n")
            if rest:
                self.pending[thread] = rest
            for line in lines:
                self.log.write(line + "\n")
                self._line(_ANSI.sub("", line), thread)
        return len(s)

    def flush(self) -> None:
        self.log.flush()

    def drain(self) -> None:
        """Write out what the threads left without a closing newline."""
        with self.lock:
            for thread, rest in self.pending.items():
                self.log.write(rest + "\n")
                self._line(_ANSI.sub("", rest), thread)
            self.pending.clear()
            self.log.flush()

    def failures(self) -> list[tuple[str, str]]:
        """(task, the exception it raised, or '' if none was printed) for every task that did not succeed."""
        return [(name, self.raised.get(name, "")) for name, status, _ in self.finished if status != "SUCCESS"]

    def _line(self, line: str, thread: int) -> None:
        if m := _START.search(line):
            self.started[thread, m.group(1)] = time.monotonic()
            self.running[thread] = m.group(1)
            self.bar.set_description_str(f"running {m.group(1)}")
        elif (m := _RAISED.match(line)) and thread in self.running:
            self.raised[self.running[thread]] = f"{m.group(1)}: {m.group(2)}"
        elif m := _DONE.search(line):
            name, status = m.groups()
            self.running.pop(thread, None)
            now = time.monotonic()
            took = now - self.started.pop((thread, name), now)
            self.finished.append((name, status, took))
            mark = "ok" if status == "SUCCESS" else status
            # to the terminal: tqdm.write's default file is sys.stdout, which is this log while the pipeline runs
            self.bar.write(f"  {mark:<7} {name:<40} {took:6.0f} s", file=self.console)
            self.bar.update(1)


def check_root(root: Path, command: str = "pipeline run-local", flag: str = "--root") -> None:
    """Before any task runs: `root` (--root, where every artifact goes; `flag`) is a directory or can be
    made one. A file there is the user's: refused by name, never replaced or written into."""
    from ..components.data import io as io_lib
    from ..errors import OutputExistsError

    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise OutputExistsError(f"{command}: {flag} '{root}' is a file, not a directory; it is left as it is. "
                                f"Choose another {flag}.")
    io_lib.check_creatable(root, command, flag)


@contextlib.contextmanager
def task_log(log_path: Path, console: IO[str] | None = None) -> Iterator[TaskLog]:
    """Inside: everything printed goes to `log_path` (appended); `console` (the real stdout by default)
    gets one line per finished task and a progress bar. When a task fails, the error it raised is shown
    (kfp.local runs the exit handler's task after it, so the log's last lines are that task's); Ctrl-C and
    an error raised here before any task (a user error, which says what it is) show where the log is; any
    other error shows the log's last lines."""
    console = console or sys.__stdout__
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log, \
            tqdm(desc="starting", unit="task", file=console, dynamic_ncols=True, leave=False) as bar:
        stream = TaskLog(log, bar, console)
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                yield stream
            stream.drain()
        except BaseException as e:
            stream.drain()
            bar.close()
            if failed := stream.failures():
                lines = [f"task '{name}' failed: {error or 'see the log'}" for name, error in failed]
            elif isinstance(e, KeyboardInterrupt):
                lines = ["pipeline interrupted"]
            elif isinstance(e, PrmflowError):
                lines = []
            else:
                tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
                lines = ["pipeline failed; the last lines of its log:", *(f"  | {t}" for t in tail)]
            print("\n".join([*lines, f"full log: {log_path}"]), file=console)
            raise


@contextlib.contextmanager
def parallel_task_records_kept() -> Iterator[None]:
    """Keep the log records of tasks that kfp.local runs side by side (a ParallelFor's shards).

    kfp.local (2.17, `logging_utils.local_logger_context`) wraps each task in a context that saves the
    root logger's handlers and level, installs its own handler, and puts the saved ones back on exit.
    Two tasks on threads interleave that: when the first to finish restores what it saw on entry (the
    handlers from before either task), the other task's "finished with status" line and its outputs
    went to no handler at a level that drops INFO, and the console missed that shard. Under this
    context what is restored is a handler on the `sys.stdout` of this moment (the run's log, or the
    terminal with --verbose) at INFO, so those records land there too. The caller restores the root
    logger afterwards (`root_logger_restored`)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)


@contextlib.contextmanager
def root_logger_restored(detach: bool = False) -> Iterator[None]:
    """kfp.local swaps the root logger's handlers for a StreamHandler on the sys.stdout of that moment and,
    on some paths, leaves it there: a later log record in the same process (a test, a notebook) then
    writes to a stream that may be closed. It also indents its output by replacing `builtins.print`
    for the length of each task, which the threads of a ParallelFor undo out of order: print stayed
    indented (by up to 28 spaces) after the pipeline. Put back the handlers, the level and print.

    detach: also take the root logger's handlers off until then. The CLI's own handler writes to the
    terminal's stderr; when two parallel tasks leave kfp.local's logger context out of order, one of
    them restores the handlers it found, and a task's INFO lines then reached the terminal past the
    quiet console (parallel_task_records_kept sends them to the run's log)."""
    import builtins

    root = logging.getLogger()
    handlers, level, printer = root.handlers[:], root.level, builtins.print
    if detach:
        root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        builtins.print = printer
