"""SIGTERM (Kubernetes stopping a pod): the stage saves its resume checkpoint, exits 143 within the
grace period, and the next run continues to the same weights as a run that was never stopped."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
from safetensors.torch import load_file

from kill_harness import run_attempt
from stage_cases import CASES
from prmflow.components.training import checkpoint
from prmflow.components import config
from prmflow.components.runtime import preemption
from prmflow.components.sft import stage

SHORT = {"num_prompts": 64, "eval_size": 4, "max_steps": 8, "micro_batch_size": 4, "optim.warmup_steps": 2,
         "eval_every": 5, "save_every": 0, "eval_max_new_tokens": 4, "max_seq_len": 64,
         "engine.backend": "torch", "tracking.enabled": False}


def test_handler_sets_a_flag_and_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with preemption.Preemption() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before the next bytecode
        assert stop.requested and stop.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat while saving changes nothing
        assert stop.requested
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_ctrl_c_interrupts_at_once():
    with preemption.Preemption() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # give the interpreter bytecodes to run the handler on
                pass


def test_outside_the_main_thread_it_is_inert():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("stop", preemption.Preemption().install()))
    t.start()
    t.join()
    assert "stop" in seen and not seen["stop"].requested  # installing from a thread did not raise
    assert {s: signal.getsignal(s) for s in before} == before  # the process keeps its own handlers


def test_preempted_exits_with_143():
    e = preemption.Preempted("sft", 4, "/x/.out.work/latest")
    assert isinstance(e, SystemExit) and e.code == 143 and "step 4" in str(e)


def test_ctrl_c_exits_130_and_names_sigint(tmp_path, monkeypatch, capfd, caplog):
    """Ctrl-C is SIGINT: the stage saves, says SIGINT, and exits 130 (128 + 2), as a shell user expects. It says
    where the checkpoint is once: the CLI shows WARNING logs on stderr too, so a logged copy is a second line."""
    cut = config.load(stage.Config, overrides={**SHORT, "max_steps": 3, "output": str(tmp_path / "cut")})
    real_step = stage.TrainEngine.step
    steps = []

    def step_then_ctrl_c(self):
        norm = real_step(self)
        steps.append(1)
        if len(steps) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return norm

    monkeypatch.setattr(stage.TrainEngine, "step", step_then_ctrl_c)
    with pytest.raises(preemption.Preempted) as stopped:
        stage.run(cut)
    err = capfd.readouterr().err
    assert stopped.value.code == 130 and len(steps) == 1
    assert "received SIGINT" in err and "exiting with status 130" in err
    assert "on request (SIGINT)" in str(stopped.value) and "SIGTERM" not in err
    shown = err.count("stopped after step") + sum("stopped after step" in r.getMessage() for r in caplog.records
                                                   if r.levelno >= logging.WARNING)
    assert shown == 1, err
    assert (checkpoint.work_dir_for(cut.output) / "latest" / "manifest.json").is_file()


def test_sigterm_in_process_saves_exits_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    full = config.load(stage.Config, overrides={**SHORT, "output": str(tmp_path / "full")})
    stage.run(full)
    cut = config.load(stage.Config, overrides={**SHORT, "output": str(tmp_path / "cut")})
    steps = []
    real_step = stage.TrainEngine.step

    def step_then_sigterm(self):
        norm = real_step(self)
        steps.append(1)
        if len(steps) == 5:  # the pod is told to stop during step 5 (an eval step)
            os.kill(os.getpid(), signal.SIGTERM)
        return norm

    monkeypatch.setattr(stage.TrainEngine, "step", step_then_sigterm)
    with pytest.raises(preemption.Preempted) as stopped:
        stage.run(cut)
    assert stopped.value.code == 143 and len(steps) == 5  # the step in progress finished, no more
    work = checkpoint.work_dir_for(cut.output)
    state = json.loads((work / "latest" / "state" / "trainer_state.json").read_text())
    assert state == {"step": 5, "consumed": 20, "eval_pending": True}  # save_every=0: only SIGTERM saved
    assert not (tmp_path / "cut").exists()  # no partial output

    monkeypatch.setattr(stage.TrainEngine, "step", real_step)
    evals = []
    real_eval = stage.evaluate
    monkeypatch.setattr(stage, "evaluate", lambda *a, **k: evals.append(1) or real_eval(*a, **k))
    stage.run(cut)
    assert len(evals) == 2  # the step-5 eval the stop skipped, then the final one
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[n] == b[n]).all() for n in a)  # bit-for-bit
    assert not work.exists()


PRM_SHORT = {"backbone": "tiny-llama", "num_prompts": 32, "eval_size": 8, "max_steps": 8, "micro_batch_size": 8,
             "optim.warmup_steps": 2, "eval_every": 5, "save_every": 0, "max_seq_len": 128, "engine.backend": "torch",
             "tracking.enabled": False}


def test_prm_sigterm_in_process_saves_exits_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    from prmflow.components.prm import stage as prm

    full = config.load(prm.Config, overrides={**PRM_SHORT, "output": str(tmp_path / "full")})
    prm.run(full)
    cut = config.load(prm.Config, overrides={**PRM_SHORT, "output": str(tmp_path / "cut")})
    steps = []
    real_step = prm.TrainEngine.step

    def step_then_sigterm(self):
        norm = real_step(self)
        steps.append(1)
        if len(steps) == 5:  # the pod is told to stop during step 5 (an eval step)
            os.kill(os.getpid(), signal.SIGTERM)
        return norm

    monkeypatch.setattr(prm.TrainEngine, "step", step_then_sigterm)
    with pytest.raises(preemption.Preempted) as stopped:
        prm.run(cut)
    assert stopped.value.code == 143 and stopped.value.stage == "prm" and len(steps) == 5
    work = checkpoint.work_dir_for(cut.output)
    state = json.loads((work / "latest" / "state" / "trainer_state.json").read_text())
    assert state == {"step": 5, "consumed": 40, "eval_pending": True}  # save_every=0: only SIGTERM saved
    assert not (tmp_path / "cut").exists()

    monkeypatch.setattr(prm.TrainEngine, "step", real_step)
    evals = []
    real_eval = prm.evaluate
    monkeypatch.setattr(prm, "evaluate", lambda *a, **k: evals.append(1) or real_eval(*a, **k))
    prm.run(cut)
    assert len(evals) == 2  # the step-5 eval the stop skipped, then the final one
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[n] == b[n]).all() for n in a)  # bit-for-bit
    assert not work.exists()


#: per stage: (trainer state file in the resume checkpoint, its progress key, the earliest it can stop at, the run's
#: total, what a resume prints). sft and prm check the flag after their next step (so >= 4); ppo checks it right
#: after the periodic save, so a SIGTERM landing during that save stops at 3 with that (current) checkpoint.
RUNNING = {
    "sft": ("state/trainer_state.json", "step", 4, 10, "sft: resuming from step {}"),
    "prm": ("state/trainer_state.json", "step", 4, 10, "prm: resuming from step {}"),
    "ppo": ("actor/trainer_state.json", "update", 3, 16, "ppo: resuming from update {}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNNING))
def test_sigterm_to_a_running_stage_process_then_resume(name, stage_runs, tmp_path, reliability):
    case = CASES[name]
    state_file, key, first, total, resumed_line = RUNNING[name]
    _, inputs, ref_dir, _ = stage_runs(name)
    run = tmp_path / "run"
    argv = case.argv(run, inputs)
    # wait for the first periodic checkpoint (step/update 3): training is surely under way
    stopped = run_attempt(case, argv, run, ("event", ".out.work/latest", signal.SIGTERM), "sigterm")
    err = (run / "logs" / "sigterm.err").read_text()
    assert stopped.rc == 143, err[-2000:]
    assert stopped.exit_after_signal_s < case.grace_s
    assert "stopped after" in err and "Traceback" not in err
    state = json.loads((run / ".out.work" / "latest" / state_file).read_text())
    assert first <= state[key] < total  # saved on SIGTERM after the step in progress (not left at the periodic 3)
    assert not (run / "out").exists()

    resumed = run_attempt(case, argv, run, None, "resume")
    assert resumed.rc == 0
    assert resumed_line.format(state[key]) in (run / "logs" / "resume.out").read_text()
    case.compare(ref_dir / "out", run / "out")
    assert not (run / ".out.work").exists()
    reliability.add(f"sigterm/{name}", stopped_at=state[key], exit_after_signal_s=round(stopped.exit_after_signal_s, 2),
                    resumed_bit_for_bit=1)


def test_under_torchrun_only_rank_0_says_where_the_checkpoint_is(monkeypatch, capsys):
    """torchrun prints every rank's stderr: the resume sentence comes once, from rank 0; every rank still stops."""
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        stop = preemption.stopped("ppo", 7, "out/.ppo.work/latest", signal.SIGTERM)
        assert isinstance(stop, preemption.Preempted) and stop.step == 7
        assert ("out/.ppo.work/latest" in capsys.readouterr().err) is said
