"""Build the CPU image with buildah on a debootstrapped bookworm base, cached between runs, and run
commands in it as a user would run `docker run --user 1000:1000 -v in:/inputs:ro -v out:/outputs`.

Everything lives under one cache directory ($PRMFLOW_IMAGE_CACHE, default ~/.cache/prmflow-images):
the base root filesystem (images/bootstrap-base.sh keys it on its own content), a containers storage
of its own (so the test never touches the user's images), the torch wheel, and builds.jsonl with the
time and size of every build. The built image is tagged with a hash of everything that goes into it,
so a warm run only starts containers.

The image is built with this environment's versions pinned (`pip freeze` as build.sh --constraints):
the comparisons with outputs made here mean something only on the same libraries, and a dependency
layer cached from an earlier day would otherwise keep the releases of that day.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPO = "localhost/prmflow-cpu-test"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def missing_requirements() -> str | None:
    """Why the container test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (buildah --isolation chroot and debootstrap)"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install buildah debootstrap; .ci/run does)"
    return None


def cache_dir() -> Path:
    path = Path(os.environ.get("PRMFLOW_IMAGE_CACHE", Path.home() / ".cache" / "prmflow-images"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def tool_env(cache: Path) -> dict:
    """The environment for buildah: a containers storage inside the cache directory."""
    conf = cache / "storage.conf"
    text = (f'[storage]\ndriver = "overlay"\ngraphroot = "{cache / "storage"}"\n'
            f'runroot = "/run/prmflow-images-{hashlib.sha256(str(cache).encode()).hexdigest()[:8]}"\n')
    if not conf.exists() or conf.read_text() != text:
        conf.write_text(text)
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf)}


def sh(cmd: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def torch_wheels(cache: Path) -> Path | None:
    """A directory holding the CPU torch wheel this environment runs (pip fetches it from wherever pip
    is configured to look: a local wheel directory here), or None: then the build uses the CPU index."""
    import torch

    wheels = cache / "wheels"
    version = torch.__version__
    if any(wheels.glob(f"torch-{version}-*.whl")):
        return wheels
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                             f"torch=={version}"], capture_output=True, text=True)
    return wheels if result.returncode == 0 and any(wheels.glob("torch-*.whl")) else None


_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==\S+$")


def constraints(cache: Path) -> Path:
    """This environment's versions as a pip constraints file: `pip freeze`'s `name==version` lines, less
    prmflow itself (the image installs it from the build context)."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    pins = [line for line in frozen if _PIN.match(line) and line.split("==")[0].lower() != "prmflow"]
    path = cache / "constraints.txt"
    text = "\n".join(sorted(pins, key=str.lower)) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def build_key(base: str, wheels: Path | None, pins: Path) -> str:
    """Hash of what goes into the image: the Dockerfile, the build context it copies, the base, the wheels
    and the pinned versions."""
    h = hashlib.sha256(base.encode() + b"\0" + pins.read_bytes())
    files = [ROOT / "images" / "Dockerfile.cpu", ROOT / "images" / "build.sh", ROOT / ".dockerignore",
             ROOT / "pyproject.toml", ROOT / "README.md"]
    for folder in ("prmflow", "configs"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    h.update(" ".join(sorted(p.name for p in wheels.glob("*.whl"))).encode() if wheels else b"index")
    return h.hexdigest()[:12]


def cpu_image() -> dict:
    """The CPU image, built (or found) in the cache: {'image', 'base', 'built', 'build_s', 'size', 'env'}."""
    cache = cache_dir()
    env = tool_env(cache)
    base = sh([str(ROOT / "images" / "bootstrap-base.sh"), "--tool", "buildah", "--cache", str(cache)],
              env).stdout.split()[-1]
    wheels = torch_wheels(cache)
    pins = constraints(cache)
    image = f"{REPO}:{build_key(base, wheels, pins)}"
    built, seconds = False, None
    if subprocess.run(["buildah", "inspect", "--type", "image", image], env=env, capture_output=True).returncode != 0:
        cmd = [str(ROOT / "images" / "build.sh"), "cpu", image, "--tool", "buildah", "--base", base,
               "--constraints", str(pins)]
        cmd += ["--wheels", str(wheels)] if wheels else []
        cmd += ["--ca-bundle", str(CA_BUNDLE)] if CA_BUNDLE.is_file() else []
        start = time.monotonic()
        sh(cmd, env)
        built, seconds = True, round(time.monotonic() - start, 1)
    size = sh(["buildah", "images", "--format", "{{.Size}}", image], env).stdout.strip()
    record = {"image": image, "base": base, "built": built, "build_s": seconds, "size": size}
    if built:
        with open(cache / "builds.jsonl", "a") as f:
            f.write(json.dumps({**record, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        drop_older_tags(image, env)
    return {**record, "env": env}


def drop_older_tags(keep: str, env: dict) -> None:
    """Older builds of the test image go (their shared dependency layers stay as the build cache)."""
    listed = json.loads(sh(["buildah", "images", "--json"], env).stdout or "[]")
    for entry in listed:
        for name in entry.get("names") or []:
            if name.startswith(REPO + ":") and name != keep:
                subprocess.run(["buildah", "rmi", name], env=env, capture_output=True)


class Container:
    """A working container of the image; run() is `docker run --rm --user 1000:1000 -v ...` in buildah terms."""

    def __init__(self, image: str, env: dict):
        self.env = env
        self.name = sh(["buildah", "from", "--pull-never", image], env).stdout.strip().splitlines()[-1]

    def run(self, args: list[str], volumes: dict[Path, str] = {}, check=True) -> subprocess.CompletedProcess:
        cmd = ["buildah", "run", "--isolation", "chroot", "--user", "1000:1000",
               "--env", "HOME=/home/prmflow", "--env", "OMP_NUM_THREADS=1", "--env", "COLUMNS=100"]
        for host, spec in volumes.items():
            cmd += ["--volume", f"{host}:{spec}"]
        result = subprocess.run(cmd + [self.name, "--", *args], env=self.env, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise AssertionError(f"in the container: {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.name], env=self.env, capture_output=True)
