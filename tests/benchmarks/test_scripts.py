"""benchmarks/perf/ and benchmarks/experiments/: every script finds the repository from where it lies, the scripts
that name others name files that exist, and each starts (its --help)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for folder in ("perf", "experiments") for p in (ROOT / "benchmarks" / folder).glob("*.py"))
#: Files that run benchmark scripts by path.
RUNNERS = [ROOT / "benchmarks" / "perf" / "gpu_check.sh", ROOT / ".ci" / "run", *SCRIPTS]


def test_the_folders_hold_the_scripts():
    assert {p.parent.name for p in SCRIPTS} == {"perf", "experiments"}
    assert not sorted((ROOT / "benchmarks").glob("*.py")), "a benchmark script belongs in perf/ or experiments/"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_finds_the_repository(script):
    """`Path(__file__).resolve().parents[k]` is how a script reaches configs/ and prmflow/: after a move it must
    still be the repository root."""
    ks = {int(k) for k in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d)\]", script.read_text(encoding="utf-8"))}
    assert all(script.resolve().parents[k] == ROOT for k in ks), f"{script.name}: parents{sorted(ks)} is not the repository"


def test_runners_name_scripts_that_exist():
    named = {(runner.relative_to(ROOT), m) for runner in RUNNERS if runner.exists()
             for m in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh|json)", runner.read_text(encoding="utf-8"))}
    missing = sorted(f"{runner}: {path}" for runner, path in named if not (ROOT / path).exists())
    assert not missing, "benchmark paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.slow
@pytest.mark.parametrize("script", [p for p in SCRIPTS if "__main__" in p.read_text(encoding="utf-8")],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_answers_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_stage_samplers_runs_each_stage_arms_as_it_names_them():
    """stage_samplers_gpu.py: `--stage` runs exactly the default arms of those stages; an arm named -vllm samples with
    vLLM and no other does but rollout's vllm arms; a -cpu arm hides the GPU, and each arm's config is the stage's."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "perf"))
    import stage_samplers_gpu as ssg

    by_stage = {s: ssg.select_arms([s], [], False) for s in ssg.STAGES}
    assert sorted(sum(by_stage.values(), [])) == sorted(ssg.DEFAULT_ARMS)
    assert by_stage["rollout"] == ["hf", "vllm", "vllm-inproc", "vllm-stock"]
    assert ssg.select_arms(["rollout"], [], True) == ["vllm", "vllm-inproc", "vllm-stock"]
    assert ssg.select_arms(["rollout"], ["evaluate-vllm"], False) == ["evaluate-vllm"]
    for name, arm in ssg.ARMS.items():
        assert (arm.config.get("sampler") == "vllm") == ("vllm" in name), name
        assert (arm.env.get("CUDA_VISIBLE_DEVICES") == "") == name.endswith("-cpu"), name
        assert name.startswith(arm.stage) or arm.stage == "rollout" or name == "decode-1.5b", name
    args = type("Args", (), dict(prompts=0, samples=0, max_new_tokens=128, label_prompts=8, label_samples=2,
                                 completions=4, big_prompts=32))()
    sizes = {name: (o["num_prompts"], o["n_samples"]) for name in ssg.ARMS if name != "decode-1.5b"
             for o in [ssg.overrides(name, "/policy", args, Path("/out"))]}
    assert sizes["hf"] == (64, 8) and sizes["evaluate-gpu"] == (16, 4) and sizes["prm-label-cpu"] == (8, 2)
    assert sizes["evaluate-1.5b"] == (32, 4)
