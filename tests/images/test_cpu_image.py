"""The CPU image, built here and run as a user runs it: `prmflow` as uid 1000, inputs mounted read-only,
one writable output directory, a read-only home (so nothing may compile or cache there: DeepSpeed's
shm comm op has to be in the image). Each command's output must equal the same command's output
outside the container, in this environment.

Built with buildah (--isolation chroot: no daemon) on a bookworm base that images/bootstrap-base.sh
debootstraps from the Debian mirror; both are cached (tests/images/image_build.py), so only a cold
cache pays for them. Skipped, with the reason, without root, buildah or debootstrap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from prmflow import stages
from prmflow.components.data import schema

import image_build

pytestmark = [pytest.mark.container, pytest.mark.slow]
PRMFLOW = str(Path(sys.executable).parent / "prmflow")
HOST_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}

SFT_CONFIG = """\
sft:
  policy: tiny-llama
  task: arithmetic
  num_prompts: 256
  eval_size: 16
  max_steps: 20
  micro_batch_size: 16
  optim: {lr: 3.0e-3, warmup_steps: 2}
  eval_every: 0
  save_every: 0
  eval_max_new_tokens: 24
  engine: {backend: deepspeed, zero_stage: 0}
  tracking: {enabled: false}
"""


@pytest.fixture(scope="module")
def image():
    why = image_build.missing_requirements()
    if why:
        pytest.skip(why)
    built = image_build.cpu_image()
    state = f"built in {built['build_s']} s" if built["built"] else "found in the cache"
    print(f"\n{built['image']} ({built['size']}) {state}, on {built['base']}")
    return built


@pytest.fixture(scope="module")
def container(image):
    c = image_build.Container(image["image"], image["env"])
    yield c
    c.remove()


@pytest.fixture
def dirs(tmp_path):
    """inputs/ (read-only in the container), outputs/ (writable by uid 1000), an empty read-only home."""
    inputs, outputs, home = tmp_path / "inputs", tmp_path / "outputs", tmp_path / "home"
    for d in (inputs, outputs, home):
        d.mkdir()
    os.chown(outputs, 1000, 1000)
    mounts = {inputs: "/inputs:ro", outputs: "/outputs:rw", home: "/home/prmflow:ro"}
    return inputs, outputs, mounts


def host(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([PRMFLOW, *args], env=HOST_ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_help_in_the_image_is_the_help_here(container, dirs):
    inputs, _, mounts = dirs
    inside = container.run(["prmflow", "--help"], mounts).stdout
    assert inside == host("--help").stdout
    assert all(name in inside for name in stages.STAGES)
    # the mounts are what the test claims: inputs read-only for uid 1000
    denied = container.run(["touch", "/inputs/x"], mounts, check=False)
    assert denied.returncode != 0 and not (inputs / "x").exists()


# The libraries whose versions decide the bytes of an output (weights, Parquet shards).
DECISIVE = ("torch", "transformers", "deepspeed", "safetensors", "tokenizers", "pyarrow", "numpy", "scipy")


def test_the_image_runs_the_library_versions_this_environment_runs(container):
    """The byte-for-byte comparisons below mean something only on the same versions. Left to itself the
    image resolves pyproject's ranges when its dependency layer is built, and that cached layer keeps
    the releases of that day; it is built with this environment's `pip freeze` as its constraints."""
    import importlib.metadata as md

    code = f"import importlib.metadata as md; print(*[md.version(d) for d in {DECISIVE!r}])"
    inside = dict(zip(DECISIVE, container.run(["python", "-c", code]).stdout.split()))
    here = {d: md.version(d) for d in DECISIVE}
    assert inside == here, (f"the image has {inside}, this environment {here}, though it was built with "
                            f"{image_build.cache_dir() / 'constraints.txt'} (this environment's pip freeze) as "
                            f"its pins: images/build.sh --constraints did not reach pip")


def rollouts() -> pa.Table:
    """Three groups of three samples: varied lengths, step rewards and outcomes, one zero-variance group."""
    rows = []
    for g, outcomes in enumerate([(1.0, 0.0, 1.0), (0.0, 0.0, 0.0), (1.0, 1.0, 0.0)]):
        for i, outcome in enumerate(outcomes):
            n = 3 + g + i
            rows.append({"prompt_id": f"p{g}", "sample_idx": i, "iteration": 0, "response_ids": list(range(n)),
                         "old_logprobs": [-1.0 - 0.1 * t for t in range(n)], "ref_logprobs": [-1.2] * n,
                         "values": [0.1 * t for t in range(n)], "step_ends": [1, n - 1],
                         "step_rewards": [0.2 + 0.1 * i, 0.9 - 0.2 * g], "outcome_reward": outcome})
    return pa.Table.from_pylist(rows)


def test_advantage_stage_in_the_image_equals_outside(container, dirs, tmp_path):
    inputs, outputs, mounts = dirs
    with schema.DatasetWriter(inputs / "rollouts", "rollouts") as w:
        w.write(rollouts())
    before = sorted(p.name for p in inputs.rglob("*"))
    args = ["--iteration", "0", "--estimator", "gae", "--kl_coef", "0.05", "--tracking.enabled", "false"]
    container.run(["prmflow", "advantage", "--input", "/inputs/rollouts", "--output", "/outputs/advantages",
                   *args], mounts)
    host("advantage", "--input", str(inputs / "rollouts"), "--output", str(tmp_path / "host-advantages"), *args)

    inside, outside = outputs / "advantages", tmp_path / "host-advantages"
    assert json.loads((inside / "manifest.json").read_text())["files"] == \
        json.loads((outside / "manifest.json").read_text())["files"]  # same shards, byte for byte
    assert schema.read_dataset(inside, "advantages").to_pylist() == schema.read_dataset(outside, "advantages").to_pylist()
    assert sorted(p.name for p in inputs.rglob("*")) == before


def test_sft_in_the_image_equals_outside(container, dirs, tmp_path):
    """20 DeepSpeed steps of the tiny model: the same weights, bit for bit, and a loadable HF directory."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    inputs, outputs, mounts = dirs
    (inputs / "sft.yaml").write_text(SFT_CONFIG)
    run = container.run(["prmflow", "sft", "--config", "/inputs/sft.yaml", "--output", "/outputs/sft"], mounts)
    assert "torch_extensions" not in run.stdout + run.stderr  # DeepSpeed loaded its op from the image: no JIT
    host("sft", "--config", str(inputs / "sft.yaml"), "--output", str(tmp_path / "host-sft"))

    inside, outside = outputs / "sft", tmp_path / "host-sft"
    a, b = load_file(str(inside / "model.safetensors")), load_file(str(outside / "model.safetensors"))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    files_in = json.loads((inside / "manifest.json").read_text())["files"]
    assert files_in == json.loads((outside / "manifest.json").read_text())["files"]
    AutoModelForCausalLM.from_pretrained(inside)
