"""run-local's console: kfp.local's own task lines drive one line per task; everything goes to the log."""

import io
import logging

from tqdm import tqdm

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
