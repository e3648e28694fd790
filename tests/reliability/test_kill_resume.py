"""Kill and resume (SIGKILL and SIGTERM at random moments), and idempotent re-runs, per stage.

CI runs `case.ci_seeds` seeds per stage (advantage 2, the others 1); the full
run is `PRMFLOW_KILL_SEEDS=20 pytest tests/reliability/test_kill_resume.py` (add -s to see each
seed, PRMFLOW_RELIABILITY_REPORT=FILE for the numbers as JSON).
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from kill_harness import dump, kill_and_resume, seeds_for, summary
from stage_cases import ALL_CASES, CASES, make_rollouts
from prmflow import cli
from prmflow.components.advantage import stage as advantage
from prmflow.errors import OutputExistsError
from prmflow.tracking import TrackingConfig


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_killed_stage_resumes_to_the_uninterrupted_result(name, stage_runs, reliability):
    case = CASES[name]
    root, inputs, ref_dir, ref_seconds = stage_runs(name)
    results = []
    for seed in range(seeds_for(case)):
        result = kill_and_resume(case, root, inputs, seed, ref_dir, ref_seconds)
        results.append(result)
        print(f"{name} seed {seed}: " + ", ".join(f"{a.trigger or 'run'}->{a.rc}{' (resumed)' if a.resumed else ''}"
                                                  for a in result.attempts))
        shutil.rmtree(root / f"seed-{seed}")
    s = summary(results)
    reliability.add(f"kill-resume/{name}", reference_s=round(ref_seconds, 1), **s)
    dump(os.environ.get("PRMFLOW_KILL_LOG"), {"case": name, **s})
    assert s["matched"] == s["seeds"] == seeds_for(case)
    assert s["kills"] >= s["seeds"]  # every seed's first kill landed: the resumes above were real
    if case.checkpoint:  # resumes from a checkpoint happened, not only restarts (seed 0's first kill is after one)
        assert s["seeds_that_resumed"] >= max(1, s["seeds"] // 4), s


def _snapshot(out):
    """Every file of an output with its content hash and modification time."""
    return {p.relative_to(out).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_rerun_of_a_complete_output_does_nothing_and_a_different_one_is_refused(name, stage_runs, capsys, reliability):
    """Every stage, one helper (io.finished_output): the same run again leaves the output untouched and
    says so; another config is refused with exit 2 and replaces the output only when asked to."""
    case = ALL_CASES[name]
    _, inputs, ref_dir, _ = stage_runs(name)
    out = ref_dir / case.output
    before = _snapshot(out)
    capsys.readouterr()
    assert cli.main(case.argv(ref_dir, inputs)) == 0
    said = capsys.readouterr()
    assert "nothing to do" in said.out, said
    assert _snapshot(out) == before  # not rewritten, not even touched
    assert cli.main([*case.argv(ref_dir, inputs), *case.changed_argv]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "Traceback" not in err, err
    assert _snapshot(out) == before
    # asked for, another config replaces it (the reference is put back after: the kill test compares with it)
    kept = ref_dir / "kept"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(out, kept)
    try:
        assert cli.main([*case.argv(ref_dir, inputs), *case.changed_argv, "--overwrite", "true"]) == 0
        replaced = _snapshot(out)
        assert replaced != before
        capsys.readouterr()
        assert cli.main([*case.argv(ref_dir, inputs), *case.changed_argv]) == 0  # now that one is the finished output
        assert "nothing to do" in capsys.readouterr().out and _snapshot(out) == replaced
    finally:
        shutil.rmtree(out)
        kept.rename(out)
    assert _snapshot(out) == before
    reliability.add("idempotence", reruns_that_did_nothing=2, mismatches_refused=1)


def test_advantage_refuses_an_output_made_from_other_rollouts(tmp_path, reliability):
    """Same config and paths, but the rollouts behind them changed: not the same result, so an error."""
    cfg = advantage.Config(input=str(tmp_path / "rollouts"), output=str(tmp_path / "adv"), estimator="grpo",
                           tracking=TrackingConfig(enabled=False))
    make_rollouts(tmp_path, prompts=6, seed=1)
    advantage.run(cfg)
    before = _snapshot(tmp_path / "adv")
    shutil.rmtree(tmp_path / "rollouts")
    make_rollouts(tmp_path, prompts=6, seed=2)
    with pytest.raises(OutputExistsError, match="different inputs"):
        advantage.run(cfg)
    assert _snapshot(tmp_path / "adv") == before
    reliability.add("idempotence", mismatches_refused=1)


def _tiny_policy(path, seed):
    shutil.rmtree(path, ignore_errors=True)
    assert cli.main(["make-tiny-model", str(path), "--seed", str(seed)]) == 0


def test_rollout_refuses_an_output_sampled_from_another_policy(tmp_path, capsys, reliability):
    """Same config and paths, but the policy directory was rewritten (a retrained SFT policy): refused."""
    policy, out = tmp_path / "policy", tmp_path / "ro"
    argv = ["rollout", "--policy", str(policy), "--output", str(out), "--num_prompts", "2", "--n_samples", "2",
            "--sampling.max_new_tokens", "8", "--tracking.enabled", "false"]
    _tiny_policy(policy, 0)
    assert cli.main(argv) == 0
    before = _snapshot(out)
    assert cli.main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    _tiny_policy(policy, 1)
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "different inputs" in err and str(out) in err and "Traceback" not in err, err
    assert _snapshot(out) == before
    assert cli.main([*argv, "--overwrite", "true"]) == 0 and _snapshot(out) != before  # asked for: replaced
    reliability.add("idempotence", mismatches_refused=1)


def test_prm_refuses_an_output_trained_on_another_backbone(tmp_path, capsys, reliability):
    """PRM on an SFT policy directory that was retrained in place: not the same PRM, so an error."""
    policy, out = tmp_path / "sft", tmp_path / "prm"
    argv = ["prm", "--backbone", str(policy), "--output", str(out), "--num_prompts", "16", "--eval_size", "4",
            "--max_steps", "2", "--optim.warmup_steps", "1", "--micro_batch_size", "8", "--max_seq_len", "96",
            "--engine.backend", "torch", "--tracking.enabled", "false"]
    _tiny_policy(policy, 0)
    assert cli.main(argv) == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert cli.main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    _tiny_policy(policy, 1)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "different inputs" in err and "Traceback" not in err, err
    assert _snapshot(out) == before
    reliability.add("idempotence", mismatches_refused=1)


def test_the_harness_checks_can_fail(tmp_path):
    """The comparisons and the partial-output reader reject what they must (the harness is no tautology)."""
    from kill_harness import _check_output
    from stage_cases import read_handoff, same_files

    for name, rows in (("a", 6), ("b", 7)):
        make_rollouts(tmp_path / name, prompts=rows)
    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        same_files(tmp_path / "a" / "rollouts", tmp_path / "b" / "rollouts")
    same_files(tmp_path / "a" / "rollouts", tmp_path / "a" / "rollouts")
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "a" / "rollouts", partial)
    (partial / "manifest.json").unlink()  # what a non-atomic writer would expose mid-write
    case = CASES["advantage"]
    with pytest.raises(AssertionError, match="partial or damaged output"):
        _check_output(type(case)(**{**case.__dict__, "read": read_handoff("rollouts")}), partial)
