"""The command line that re-runs one recorded stage run: in a container (docker/podman) or directly.

`stage_command` mounts every input read-only under `/inputs/<key>` and the output directory at
`/outputs`, and passes the run's logged config with those paths swapped in. A container sees only
what is mounted, so an input is never mounted as a directory of links to elsewhere: the gathered
rollout shards (the advantage stage's `input`, whose entries link to each shard's own directory) are
mounted entry by entry, each at `/inputs/input/shard-NNNNN`, from where its link really points.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..errors import PrmflowError
from ..tracking.handoffs import INPUT_KEYS, KFP_MOUNTS, MANIFEST, describe, handoffs_of_run, manifest_root
from .fetch import gather
from .settings import PLACEHOLDER_REGISTRY

Inputs = dict[str, "Path | dict[str, Path]"]


def container_engine() -> str:
    """docker where it is installed, else podman (the printed line is the same for both)."""
    return "docker" if shutil.which("docker") or not shutil.which("podman") else "podman"


def _logged_input(key: str, value: str) -> Path | dict[str, Path] | None:
    """An input of a run that recorded no dataset for it (a run logged before lineage): where it is here.

    A directory whose entries are links (gathered shards) is returned entry by entry, links resolved."""
    if not value or not os.path.isabs(value):
        return None  # a preset name (tiny-llama), the built-in task, unset
    path = Path(value)
    if not path.exists():
        if any(value.startswith(prefix) for prefix in KFP_MOUNTS):
            raise PrmflowError(f"input {key}={value} is a KFP launcher path inside a pod and the run recorded no "
                               "dataset for it (a run from before lineage): fetch that artifact by hand and pass it "
                               "with --set.")
        raise PrmflowError(f"input {key}={value} does not exist on this machine (the run recorded no dataset to "
                           "fetch it from).")
    if path.is_dir() and manifest_root(path.resolve()) is None:
        links = sorted(p for p in path.iterdir() if p.is_symlink())
        if links:
            dangling = [p for p in links if not p.exists()]
            if dangling:
                raise PrmflowError(f"input {key}={value}: '{dangling[0]}' links to '{os.readlink(dangling[0])}', which "
                                   "does not exist (that shard was deleted or moved): re-run the stage that wrote it.")
            return {p.name: p.resolve() for p in links}
    return path.resolve()


def resolved_inputs(params: dict[str, str], inputs: Inputs | None) -> Inputs:
    """The run's inputs: the recorded (fetched, verified) ones, and the rest from its logged params."""
    out: Inputs = dict(inputs or {})
    for key in INPUT_KEYS:
        if key in params and key not in out:
            local = _logged_input(key, params[key])
            if local is not None:
                out[key] = local
    return out


def _args(stage: str, params: dict[str, str], inputs: Inputs, output_value: str) -> list[str]:
    args = [stage]
    for key, value in sorted(params.items()):
        if key.startswith("tracking."):
            continue
        if key == "output":
            value = output_value
        elif key in inputs:
            value = inputs[key]
        args += ["--set", f"{key}={value}"]
    return args + ["--set", "tracking.enabled=false"]


def stage_command(stage: str, params: dict[str, str], image: str, output: str, inputs: Inputs | None = None,
                  engine: str = "docker") -> list[str]:
    """The docker/podman argv that re-runs `stage` with the logged config `params`, inputs mounted read-only.

    `inputs` maps config keys to local paths (from `fetch.fetch_inputs`); keys it lacks are taken from
    `params` where they are absolute paths on this machine."""
    cmd = [engine, "run", "--rm"]
    in_container: dict[str, str] = {}
    for key, local in resolved_inputs(params, inputs).items():
        mount = f"/inputs/{key}"
        if isinstance(local, dict):  # one mount per shard: the container cannot follow links to the host
            cmd += [x for name, path in sorted(local.items()) for x in ("-v", f"{path}:{mount}/{name}:ro")]
        else:
            cmd += ["-v", f"{local}:{mount}:ro"]
        in_container[key] = mount
    out_name = Path(params.get("output", "") or stage).name
    cmd += ["-v", f"{os.path.abspath(output)}:/outputs"]
    return cmd + [image] + _args(stage, params, in_container, f"/outputs/{out_name}")


def direct_command(stage: str, params: dict[str, str], output: str, inputs: Inputs | None, gathered: Path) -> list[str]:
    """The argv that re-runs `stage` on this machine, no container (inputs read where they were fetched to);
    a sharded input is re-gathered under `gathered/<key>`."""
    paths = {}
    for key, local in resolved_inputs(params, inputs).items():
        paths[key] = str(gather(local, gathered / key) if isinstance(local, dict) else local)
    out_name = Path(params.get("output", "") or stage).name
    return [sys.executable, "-m", "prmflow.cli"] + _args(stage, params, paths, os.path.join(os.path.abspath(output), out_name))


def placeholder_image_note(image: str, run: bool) -> str | None:
    """A line for stderr when the printed `docker run` line names a placeholder image (the default until
    --image is given): no registry serves it. With --run that is an error: the pull would only fail."""
    if not image.startswith(PLACEHOLDER_REGISTRY + "/"):
        return None
    what = (f"'{image}' is a placeholder, not a pullable image. Build one (images/build.sh) and pass it with "
            f"--image, or re-run without a container: --no-container.")
    if run:
        raise PrmflowError(what)
    return f"note: {what}"


def rerun_report(stage: str, run, params: dict[str, str], output: str) -> str:
    """What a finished re-run wrote and whether it is the recorded run's output: the sha256 digest over
    every file of its manifest, against the digest the run recorded for its output (lineage)."""
    out = Path(output) / Path(params.get("output", "") or stage).name
    if not (out / MANIFEST).is_file():
        return f"{stage}: the re-run finished, but '{out}' holds no {MANIFEST}: it wrote no finished output there."
    got = describe("output", out, "output").digest
    recorded = [h.digest for h in handoffs_of_run(run) if h.context == "output"]
    if not recorded:
        return (f"{stage}: the re-run wrote '{out}' (digest {got}); run {run.info.run_id} recorded no output digest to "
                f"compare it with (a run from before lineage, or one that failed).")
    if got in recorded:
        return f"{stage}: the re-run wrote '{out}'; it matches the recorded run's output file for file (digest {got})."
    return (f"{stage}: the re-run wrote '{out}'; it differs from the recorded run's output (digest {got}, recorded "
            f"{recorded[0]}). The same stage on other hardware or another engine can round floats differently; "
            f"compare the two manifests' per-file sha256 to see which files differ.")
