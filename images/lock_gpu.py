"""Write images/constraints-gpu.txt: one resolution of pyproject's dependencies and its `gpu` extra for
the GPU image's Python (CPython 3.12 on linux x86_64, Ubuntu 24.04's python3), every package pinned.

    python images/lock_gpu.py [--vllm 0.33.0] [--python 3.12]

pip resolves from the package index's metadata (`pip install --dry-run --report`, wheels only, for
the target platform) without installing anything. DeepSpeed ships only a source archive, which pip
will not resolve for another platform: its requirements are listed by hand and its pin is the one
pyproject's floor names. The header records what tests/images/test_gpu_image.py checks against the
base image: vLLM's Requires-Python and the CUDA release torch's wheel is built for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: packages published as source archives only, which pip will not resolve for another platform.
#: DeepSpeed's setup imports torch, so it is pinned by hand (the release CI runs) with its own requirements;
#: the pure-Python ones are built here into platform-free wheels that the resolution may use.
SOURCE_ONLY = {"deepspeed": ("0.19.8", ["einops", "hjson", "msgpack", "ninja", "py-cpuinfo", "pydantic>=2.0.0"])}
PURE_PYTHON_SDISTS = ["kfp-server-api==2.17.3"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="0.33.0")
    parser.add_argument("--python", default="3.12")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [r for r in project["dependencies"] + project["optional-dependencies"]["gpu"]
            if not r.startswith(("deepspeed", "vllm"))]
    reqs += [r for _, needs in SOURCE_ONLY.values() for r in needs] + [f"vllm=={args.vllm}"]
    abi = "cp" + args.python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # the index alone: no local wheels or constraints
        wheels = Path(tmp) / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), "--index-url",
                        "https://pypi.org/simple", *PURE_PYTHON_SDISTS], check=True, env=env)
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
                        "--python-version", args.python, "--implementation", "cp", "--abi", abi,
                        # Ubuntu 24.04's glibc is 2.39: every manylinux tag up to it (pip does not infer them)
                        *[a for g in range(39, 16, -1) for a in ("--platform", f"manylinux_2_{g}_x86_64")],
                        "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
                        "--only-binary=:all:", "--target", str(Path(tmp) / "t"), "--index-url", "https://pypi.org/simple",
                        "--find-links", str(wheels), *reqs],
                       check=True, env=env)
        installed = json.loads(report.read_text())["install"]
    meta = {i["metadata"]["name"].lower(): i["metadata"] for i in installed}
    pins = sorted({f"{m['name']}=={m['version']}" for m in meta.values()} |
                  {f"{name}=={version}" for name, (version, _) in SOURCE_ONLY.items()}, key=str.lower)
    cuda = next(re.search(r"==([\d.]+)", d).group(1) for d in meta["torch"].get("requires_dist", [])
                if d.startswith("cuda-toolkit"))
    header = [
        "# The GPU image's pins (images/Dockerfile.gpu installs exactly these): pyproject's dependencies and its",
        f"# `gpu` extra resolved for CPython {args.python} on linux x86_64 by `python images/lock_gpu.py`.",
        f"# vllm=={meta['vllm']['version']} requires-python: {meta['vllm']['requires_python']}",
        f"# torch=={meta['torch']['version']} cuda: {cuda}",
    ]
    (ROOT / "images" / "constraints-gpu.txt").write_text("\n".join(header + pins) + "\n")
    print(f"wrote images/constraints-gpu.txt: {len(pins)} pins, torch {meta['torch']['version']} (CUDA {cuda}), "
          f"vllm {meta['vllm']['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
