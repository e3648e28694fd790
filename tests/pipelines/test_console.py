"""run-local's console: kfp.local's own task lines drive one line per task; everything goes to the log."""

import io
import logging
import re

from prmflow.pipelines import console


def test_task_log_keeps_everything_in_the_log_and_shows_one_line_per_task(tmp_path):
    from kfp.local import logging_utils, status

    screen = io.StringIO()
    log_path = tmp_path / "root" / "run-local.log"
    with console.task_log(log_path, console=screen) as stream:
        # what kfp.local prints around a task, formatted by kfp itself (colors included)
        with logging_utils.local_logger_context():
            name = logging_utils.format_task_name("sft")
            logging.info(f"Executing task {name}")
            print("    loading model ... 4 layers; MISSING score.bias", flush=True)
            logging.info(f"Task {name} finished with status {logging_utils.format_status(status.Status.SUCCESS)}")
            logging.info(f"Executing task {logging_utils.format_task_name('prm')}")
    assert [f[:2] for f in stream.finished] == [("sft", "SUCCESS")]
    shown = screen.getvalue()
    assert "sft" in shown and "MISSING" not in shown  # the task's own output stays in the log
    log = log_path.read_text()
    assert "MISSING score.bias" in log and "Executing task" in log and "finished with status" in log


def test_a_failure_shows_the_end_of_the_log(tmp_path):
    screen = io.StringIO()
    try:
        with console.task_log(tmp_path / "run-local.log", console=screen):
            print("Traceback: the stage's own error")
            raise RuntimeError("Task 'ppo' finished with status FAILURE")
    except RuntimeError:
        pass
    assert "the stage's own error" in screen.getvalue() and "full log:" in screen.getvalue()


def test_a_failed_task_shows_the_error_it_raised_not_the_exit_handlers_output(tmp_path):
    """kfp.local runs the exit handler's task (finish-tracking) after a stage fails, so the log's last 30 lines
    were that task's executor JSON; the stage's own error ('policy ... does not exist') was not on screen."""
    from kfp.local import logging_utils, status

    screen = io.StringIO()
    error = "prmflow.errors.ModelLoadError: policy '/nonexistent' does not exist. Point policy at a model."
    try:
        with console.task_log(tmp_path / "run-local.log", console=screen):
            with logging_utils.local_logger_context():
                tasks = (("sft", ["Traceback (most recent call last):", f"    {error}"], status.Status.FAILURE),
                         ("finish-tracking", ['    {"outputs": {"artifacts": {}}}'] * 40, status.Status.SUCCESS))
                for name, lines, result in tasks:
                    logging.info(f"Executing task {logging_utils.format_task_name(name)}")
                    for line in lines:
                        print(line)
                    logging.info(f"Task {logging_utils.format_task_name(name)} finished with status "
                                 f"{logging_utils.format_status(result)}")
            raise RuntimeError("Pipeline 'prmflow' finished with status FAILURE. Inner task failed: 'sft'")
    except RuntimeError:
        pass
    shown = screen.getvalue()
    assert f"task 'sft' failed: {error}" in shown and "full log:" in shown
    assert '"outputs"' not in shown


def test_ctrl_c_says_interrupted_not_failed(tmp_path):
    screen = io.StringIO()
    try:
        with console.task_log(tmp_path / "run-local.log", console=screen):
            print('    {"executor": "input"}')
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert "pipeline interrupted" in screen.getvalue() and "failed" not in screen.getvalue()
    assert "executor" not in screen.getvalue()


def test_tasks_printing_at_once_from_threads_lose_no_line(tmp_path):
    """kfp.local runs a ParallelFor's tasks on threads that print at the same time (a line per write, as
    its logging handler and its output pump do): every task's finish line is still read, and shown on
    the terminal, not in the log only."""
    import sys
    import threading

    screen = io.StringIO()
    log_path = tmp_path / "run-local.log"
    n, chatter = 8, 300
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a race shows up at once
    try:
        with console.task_log(log_path, console=screen) as stream:
            def task(i):
                print(f"Executing task 'rollout-{i}'")  # print: sys.stdout is the log while the pipeline runs
                for j in range(chatter):
                    stream.write(f"    shard {i} line {j}\n")
                stream.write(f"Task 'rollout-{i}' finished with status SUCCESS\n")

            threads = [threading.Thread(target=task, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(switch)
    assert sorted(name for name, _, _ in stream.finished) == sorted(f"rollout-{i}" for i in range(n))
    lines = log_path.read_text().splitlines()
    assert len(lines) == n * (chatter + 2)  # nothing lost or merged in the log
    assert all(f"    shard {i} line {j}" in lines for i in range(n) for j in (0, chatter - 1))
    shown = screen.getvalue()
    assert all(re.search(rf"ok +rollout-{i} ", shown) for i in range(n)), shown  # one line per task on the terminal


def _two_tasks_leaving_out_of_order():
    """kfp.local's per-task logger context, entered and left by two ParallelFor threads out of order
    (A enters, B enters, A leaves, B logs its finish)."""
    import threading

    from kfp.local import logging_utils, status

    entered, left = threading.Event(), threading.Event()

    def finish(name):
        task = logging_utils.format_task_name(name)
        logging.info(f"Task {task} finished with status {logging_utils.format_status(status.Status.SUCCESS)}")

    def a():
        with logging_utils.local_logger_context():
            logging.info(f"Executing task {logging_utils.format_task_name('rollout')}")
            entered.wait()
            finish("rollout")
        left.set()

    def b():
        with logging_utils.local_logger_context():
            logging.info(f"Executing task {logging_utils.format_task_name('rollout')}")
            entered.set()
            left.wait()
            finish("rollout")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_the_second_of_two_parallel_tasks_to_finish_is_still_reported(tmp_path):
    """Two tasks leaving kfp.local's logger context out of order: B's finish line still reaches the log and the console."""
    screen = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers.clear()
        root.setLevel(logging.WARNING)  # the default root logger: what kfp.local restores without the fix
        with console.task_log(tmp_path / "run-local.log", console=screen) as stream, \
                console.parallel_task_records_kept():
            _two_tasks_leaving_out_of_order()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert [f[:2] for f in stream.finished] == [("rollout", "SUCCESS")] * 2
    assert len(re.findall(r"ok +rollout ", screen.getvalue())) == 2
    assert (tmp_path / "run-local.log").read_text().count("finished with status") == 2


def test_a_task_line_does_not_reach_the_terminal_through_the_clis_own_log_handler(tmp_path):
    """The CLI's logging handler writes to the terminal's stderr (cli.main's basicConfig). Two tasks leaving
    kfp.local's logger context out of order under run-local's contexts: the terminal gets the task lines
    of the quiet console only, the handler is back afterwards."""
    screen, stderr = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    clis = logging.StreamHandler(stderr)
    try:
        root.handlers[:] = [clis]
        root.setLevel(logging.WARNING)
        with console.root_logger_restored(detach=True), console.task_log(tmp_path / "run-local.log", console=screen) as stream, \
                console.parallel_task_records_kept():
            _two_tasks_leaving_out_of_order()
        assert root.handlers == [clis] and root.level == logging.WARNING
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert [f[:2] for f in stream.finished] == [("rollout", "SUCCESS")] * 2
    assert stderr.getvalue() == ""
    assert (tmp_path / "run-local.log").read_text().count("finished with status") == 2


def test_a_line_half_written_by_one_thread_does_not_swallow_another_threads_line(tmp_path):
    """`print(x)` writes x and then the newline: between the two, another task's thread writes its finish
    line. Each thread's text is its own line: both tasks are read, the log has both lines whole."""
    import threading

    screen = io.StringIO()
    half, other = threading.Event(), threading.Event()
    with console.task_log(tmp_path / "run-local.log", console=screen) as stream:
        def a():
            stream.write("Executing task 'rollout'")
            half.set()
            other.wait()
            stream.write("\n")

        def b():
            half.wait()
            stream.write("Task 'sft' finished with status SUCCESS\n")
            other.set()

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [f[:2] for f in stream.finished] == [("sft", "SUCCESS")]
    assert (tmp_path / "run-local.log").read_text().splitlines() == [
        "Task 'sft' finished with status SUCCESS", "Executing task 'rollout'"]


def test_each_parallel_shard_is_timed_from_its_own_start(tmp_path, monkeypatch):
    """Two shards of one ParallelFor share the task name 'rollout': shard A starts at t=0, shard B at t=10,
    A finishes at t=30 and B at t=40. Each is timed from its own start line (30 s and 30 s), not
    both from the later start (20 s and 30 s)."""
    import queue
    import threading

    clock = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    screen = io.StringIO()
    with console.task_log(tmp_path / "run-local.log", console=screen) as stream:
        # one long-lived thread per shard (a thread id may be reused once its thread has ended)
        inbox = {s: queue.Queue() for s in "AB"}
        done = queue.Queue()

        def shard(s):
            while (text := inbox[s].get()) is not None:
                stream.write(text)
                done.put(s)

        threads = [threading.Thread(target=shard, args=(s,)) for s in "AB"]
        for t in threads:
            t.start()
        for at, s, text in [(0, "A", "Executing task 'rollout'\n"), (10, "B", "Executing task 'rollout'\n"),
                            (30, "A", "Task 'rollout' finished with status SUCCESS\n"),
                            (40, "B", "Task 'rollout' finished with status SUCCESS\n")]:
            clock[0] = at
            inbox[s].put(text)
            done.get()
        for s in "AB":
            inbox[s].put(None)
        for t in threads:
            t.join()
    assert [(name, took) for name, _, took in stream.finished] == [("rollout", 30.0), ("rollout", 30.0)]
