"""images/build.sh's handling of --constraints, against a stand-in `docker` on PATH that records the
arguments it was sent (a Docker daemon cannot run here; tests/images/test_cpu_image.py builds for real
with buildah and checks the pins reach pip)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build.sh"


def build(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """Run build.sh with a recording `docker`; returns the result and docker's argv (None: not called)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "docker-argv"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "docker"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {record}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run([str(BUILD), "cpu", "prmflow-cpu:test", "--tool", "docker", *args],
                            env=env, capture_output=True, text=True)
    argv = record.read_text().split("\0")[:-1] if record.exists() else None
    return result, argv


def build_args(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")


def test_pins_from_a_freeze_reach_the_build_as_one_argument(tmp_path):
    frozen = tmp_path / "constraints.txt"
    frozen.write_text("# pip freeze --exclude-editable\nPyYAML==6.0.3\n\ntorch==2.13.0+cpu  # CPU build\n"
                      "transformers[torch]==5.23.0\npython-dateutil==2.9.0.post0")  # no final newline
    result, argv = build(tmp_path, "--constraints", str(frozen))
    assert result.returncode == 0, result.stderr
    assert build_args(argv)["PIP_CONSTRAINTS"] == (
        "PyYAML==6.0.3 torch==2.13.0+cpu transformers[torch]==5.23.0 python-dateutil==2.9.0.post0")
    assert argv[-1] == str(ROOT / "images" / "..")  # the build context is the repository


def test_without_constraints_the_build_gets_no_pins(tmp_path):
    result, argv = build(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "PIP_CONSTRAINTS" not in build_args(argv) and "BASE_IMAGE" in build_args(argv)


def test_a_line_that_is_not_a_pin_is_refused_with_its_line_before_anything_is_built(tmp_path):
    frozen = tmp_path / "constraints.txt"
    frozen.write_text("numpy==2.4.6\n-e git+https://example.com/prmflow.git@abc#egg=prmflow\n")
    result, argv = build(tmp_path, "--constraints", str(frozen))
    assert result.returncode == 2 and argv is None
    assert f"{frozen} line 2" in result.stderr and "name==version" in result.stderr

    frozen.write_text("numpy==2.4.6\nprmflow @ file:///work/main\n")
    result, argv = build(tmp_path, "--constraints", str(frozen))
    assert result.returncode == 2 and argv is None and "line 2" in result.stderr


def test_an_empty_or_missing_constraints_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing pinned\n\n")
    result, argv = build(tmp_path, "--constraints", str(empty))
    assert result.returncode == 2 and argv is None and "holds no 'name==version' pin" in result.stderr
    result, argv = build(tmp_path, "--constraints", str(tmp_path / "absent.txt"))
    assert result.returncode == 2 and argv is None and "not a readable file" in result.stderr


DIGEST = "sha256:" + "ab" * 32


def push(tmp_path: Path, tool: str, tag: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """build.sh --push with a recording `tool` that answers like a registry client: each call's argv."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / tool
    fake.write_text(f"""#!/usr/bin/env bash
printf "%s\\0" "$@" >> {log}; printf "\\n" >> {log}
if [ "$1" = image ] && [ "$2" = inspect ]; then
  printf "other.example/x@sha256:{'0' * 64}\\n{tag.rsplit(':', 1)[0]}@{DIGEST}\\n"
fi
if [ "$1" = push ]; then
  while [ $# -gt 0 ]; do [ "$1" = --digestfile ] && printf "{DIGEST}" > "$2"; shift; done
fi
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run([str(BUILD), "cpu", tag, "--push", "--tool", tool], env=env, capture_output=True, text=True)
    calls = [c.split("\0")[:-1] for c in log.read_text().split("\n") if c] if log.exists() else []
    return result, calls


def test_push_builds_pushes_and_prints_the_digest_pinned_name(tmp_path):
    tag = "registry.example.com:5000/ml/prmflow-cpu:0.2.0"
    pinned = f"registry.example.com:5000/ml/prmflow-cpu@{DIGEST}"
    for tool in ("docker", "podman"):
        result, calls = push(tmp_path / tool, tool, tag)
        assert result.returncode == 0, result.stderr
        assert calls[0][0] == "build" and calls[1][:1] == ["push"] and calls[1][-1] == tag
        assert result.stdout.strip() == pinned  # what pipeline.images.cpu should say
        assert f"--set images.cpu={pinned}" in result.stderr


def test_push_needs_a_registry_in_the_name(tmp_path):
    result, calls = push(tmp_path, "docker", "prmflow-cpu:test")
    assert result.returncode == 2 and calls == []
    assert "--push needs a registry in the image name" in result.stderr
