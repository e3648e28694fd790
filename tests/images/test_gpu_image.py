"""The GPU image resolves before anyone builds it: the base image's Python satisfies the pinned vLLM's
Requires-Python, the base's CUDA major is the one the pinned torch wheel is built for, the pins agree
with pyproject, and the Dockerfile keeps its dependency layer apart from the source.

No registry or GPU is needed: the base's CUDA and Ubuntu release are read from its tag, Ubuntu's
python3 from a table of the LTS releases, vLLM's Requires-Python and torch's CUDA from the header
that images/lock_gpu.py writes from the index's metadata into images/constraints-gpu.txt.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
#: python3 of each Ubuntu LTS (the nvidia/cuda images' OS)
UBUNTU_PYTHON = {"20.04": "3.8", "22.04": "3.10", "24.04": "3.12"}
CUDA_TAG = re.compile(r"nvidia/cuda:(?P<cuda>\d+\.\d+(?:\.\d+)?)-(?:cudnn-)?(?P<flavour>base|runtime|devel)"
                      r"-ubuntu(?P<ubuntu>\d+\.\d+)@sha256:[0-9a-f]{64}")


def gpu_base(text: str | None = None) -> re.Match:
    text = text or (ROOT / "images" / "bases.env").read_text()
    value = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("GPU_BASE_IMAGE="))
    match = CUDA_TAG.fullmatch(value)
    assert match, f"GPU_BASE_IMAGE={value} is not an nvidia/cuda:<cuda>-<flavour>-ubuntu<release>@sha256 image"
    return match


def lock() -> tuple[dict[str, str], dict[str, str]]:
    """(pins name -> version, header facts) of images/constraints-gpu.txt."""
    text = (ROOT / "images" / "constraints-gpu.txt").read_text()
    facts = dict(re.findall(r"^# (\S+==\S+ [a-z-]+): (.+)$", text, re.M))
    pins = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), f"'{line}' is not a name==version pin"
            pins[name.lower().replace("_", "-")] = version
    return pins, facts


def check_base_against_pins(base: re.Match, pins: dict[str, str], facts: dict[str, str]) -> None:
    python = UBUNTU_PYTHON[base["ubuntu"]]
    requires = facts[f"vllm=={pins['vllm']} requires-python"]
    assert Version(python) in SpecifierSet(requires), (
        f"the GPU base's Ubuntu {base['ubuntu']} brings Python {python}; vllm {pins['vllm']} requires {requires}")
    torch_cuda = facts[f"torch=={pins['torch']} cuda"]
    assert base["cuda"].split(".")[0] == torch_cuda.split(".")[0], (
        f"the GPU base is CUDA {base['cuda']}; torch {pins['torch']}'s wheel is built for CUDA {torch_cuda}")
    assert base["flavour"] != "devel", "nothing in the image compiles CUDA: use the runtime base (devel adds ~10 GB)"


def test_the_base_images_python_and_cuda_fit_the_pinned_vllm_and_torch():
    pins, facts = lock()
    check_base_against_pins(gpu_base(), pins, facts)


def test_the_check_refuses_the_old_base():
    """The base this image had before (CUDA 12.4 devel, Ubuntu 22.04: Python 3.10) fails the check."""
    pins, facts = lock()
    old = gpu_base("GPU_BASE_IMAGE=nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04@sha256:" + "6" * 64)
    try:
        check_base_against_pins(old, pins, facts)
    except AssertionError as e:
        assert "Python 3.10" in str(e)
    else:
        raise AssertionError("the CUDA 12.4 / Python 3.10 base passed the check")


def test_the_pins_satisfy_pyproject_and_cover_every_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins, _ = lock()
    for text in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{req.name} (pyproject) has no pin in images/constraints-gpu.txt; run images/lock_gpu.py"
        assert Version(pins[name]) in req.specifier, f"{name}=={pins[name]} is outside pyproject's {req}"


def test_the_dockerfile_installs_the_pins_in_a_venv_before_the_source():
    text = (ROOT / "images" / "Dockerfile.gpu").read_text()
    lines = [line.strip() for line in text.splitlines()]
    deps = next(i for i, line in enumerate(lines) if "pip install -r /tmp/requirements.txt" in line)
    source = lines.index("COPY prmflow ./prmflow")
    assert deps < source  # a source change does not reinstall the ~10 GB of dependencies
    assert "COPY pyproject.toml images/constraints-gpu.txt ./" in lines[:deps]
    assert "PIP_CONSTRAINT=/opt/prmflow/constraints.txt" in text
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text
    for var in ("HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "VLLM_WORKER_MULTIPROC_METHOD=spawn"):
        assert var in text, var
