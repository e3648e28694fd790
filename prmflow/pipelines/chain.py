"""A long RL run as a chain of bounded KFP runs (docs/cluster.md#long-runs-a-chain-of-runs).

One KFP run holds a bounded number of iterations (size.py: Argo stops a workflow that outgrows its
object limit, and KFP has no loop). `pipeline.iterations: 300` therefore runs as consecutive runs
("segments") of at most K iterations; segment j covers the global iterations [jK, min((j+1)K, N)):

    segment 0:      init -> sft -> prm -> iterations 0..K-1                 -> chain-next
    segment j:      init -> chain-resume -> iterations jK..(j+1)K-1         -> chain-next
    last segment:   init -> chain-resume -> iterations ..N-1 -> evaluate

Every stage gets the GLOBAL iteration (first_iteration, a run parameter, + its index in the run), so
seeds, metric steps and the LR schedule are those of one long run, and a chain of 2 runs x 2
iterations ends bit for bit where one 4-iteration run does. `chain-next` writes the segment's final
state (the policy, critic, optimizer state, KL controller state, PRM and its replay state, the SFT
policy: each a location on the workspace with its fingerprint) to WORKSPACE/chain-KEY/after-N.json,
KEY naming what computes it (the stage configs and the DAG's shape, never a run id); the next segment's
`chain-resume` (cached) reads it, so a resubmitted chain finds the same record and its tasks hit
the cache. On a cluster `chain-next` then submits the next segment itself (kfp.Client() inside the
cluster, with the pod's service account: `submit_next`); `run-local` runs the segments in turn.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import ConfigError, DataError

#: The pipeline parameters a chained package has beside the stage configs.
FIRST_PARAM, CHAIN_PARAM, CHAIN_ID_PARAM = "first_iteration", "chain", "chain_id"
#: The pod label of Kubeflow's `access-ml-pipeline` PodDefault, which mounts the projected pipelines token
#: (audience pipelines.kubeflow.org) at kfp's default KF_PIPELINES_SA_TOKEN_PATH; chain-next carries it.
TOKEN_POD_LABEL = "access-ml-pipeline"


@dataclass(frozen=True)
class Segment:
    """One run of a chain: global iterations [first, first + iterations) of total."""

    index: int
    count: int
    first: int
    iterations: int
    total: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def end(self) -> int:
        return self.first + self.iterations

    @property
    def shape(self) -> str:
        """Which package runs it: whole (no chain), first (sft, prm), next (resumes), last (resumes, evaluates)."""
        if self.count == 1:
            return "whole"
        return "first" if self.index == 0 else "last" if self.last else "next"


#: The package shapes, in the order a chain runs them.
SHAPES = ("first", "next", "last")


def segments(total: int, per_run: int) -> list[Segment]:
    """The runs of a chain of `total` iterations, at most `per_run` each."""
    if per_run < 1:
        raise ConfigError(f"one run holds {per_run} iterations; a chain needs at least 1 per run "
                          f"(pipeline.run_iterations).")
    count = -(-total // per_run)
    return [Segment(j, count, j * per_run, min(per_run, total - j * per_run), total) for j in range(count)]


def versions_from(kfp_version: str) -> list[str]:
    """The KFP versions a package compiled for `kfp_version` runs on: it and every later one we check."""
    from .contracts import KFP_VERSIONS, version_tuple

    return [v for v in KFP_VERSIONS if version_tuple(v) >= version_tuple(kfp_version)]


def shape_at(shape: str, n: int) -> Segment | None:
    """A run of `shape` with n iterations (None: the whole run), to measure what one iteration costs in it."""
    return {"whole": None, "first": Segment(0, 2, 0, n, 2 * n), "next": Segment(1, 3, n, n, 3 * n),
            "last": Segment(1, 2, n, n, 2 * n)}[shape]


def shape_key(spec) -> str:
    """What of the DAG's compiled shape decides the state a segment ends with (not the stage configs, which are run
    parameters and enter the record's key at run time: `state_key`)."""
    from .kfp_shim import output_key

    pipe = spec.pipeline
    return output_key("chain-shape", {}, {"rollout_shards": pipe.rollout_shards, "prm_update": pipe.prm_update,
                                          "prm_update_config": spec.stages.get("prm-update") or {},
                                          "sft_model": pipe.sft_model, "prm_model": pipe.prm_model,
                                          **({"schedule": pipe.schedule} if pipe.schedule != "serial" else {})})


def state_key(shape: str, configs: dict) -> str:
    """The chain's name on the workspace: the DAG shape and every stage config that shapes the state."""
    from .kfp_shim import output_key

    return output_key("chain", configs, {"shape": shape})


def record_path(workspace: str, key: str, after: int) -> str:
    """Where the state after `after` iterations of chain `key` is recorded on the workspace."""
    return os.path.join(workspace, f"chain-{key}", f"after-{after}.json")


def write_state(workspace: str, key: str, after: int, pieces: dict[str, str], kl_state: str = "") -> str:
    """Record the state after `after` iterations: each piece's location (an artifact directory holding
    location.json, kfp_shim.write_location) copied whole, the KL controller's state inline. Returns the path."""
    from ..components.data.io import write_json_atomic
    from .kfp_shim import read_location

    record = {"after": after, "pieces": {}}
    for name, artifact_dir in pieces.items():
        location = read_location(artifact_dir)
        if location is None:
            raise DataError(f"chain: the {name} to hand to the next run ({artifact_dir}) is not a location on the "
                            f"workspace; a chain keeps its state on workspace_pvc.")
        record["pieces"][name] = location
    if kl_state:
        with open(kl_state) as f:
            record["kl_state"] = json.load(f)
    path = record_path(workspace, key, after)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, record)
    return path


def read_state(workspace: str, key: str, after: int, needs: list[str]) -> dict:
    """The record of chain `key` after `after` iterations, with every piece in `needs`; an error that says
    what to run when the previous segment has not finished (or ran with other configs)."""
    path = record_path(workspace, key, after)
    if not os.path.isfile(path):
        there = sorted(os.listdir(os.path.dirname(path))) if os.path.isdir(os.path.dirname(path)) else []
        found = f"found {', '.join(there)}" if there else "none of this chain yet"
        raise DataError(f"chain: no state after iteration {after} at {path} ({found}): "
                        f"the run of iterations before {after} has not finished with these configs. Submit the chain "
                        f"from its start (pipeline submit / run-local with the same config): finished runs hit the cache.")
    with open(path) as f:
        record = json.load(f)
    missing = [n for n in needs if n not in record["pieces"] and not (n == "kl_state" and "kl_state" in record)]
    if missing:
        raise DataError(f"chain: {path} lacks {', '.join(missing)}, which this run reads; it was written by a run of "
                        f"another shape. Submit the chain from its start.")
    return record


def restore(record: dict, outputs: dict[str, str], kl_state_path: str) -> None:
    """Write each recorded piece into its output artifact directory as the location it was (checked: every file
    still there at its size), pieces not recorded as empty locations, the KL state as its file."""
    from .kfp_shim import LOCATION_FILE, located

    for name, artifact_dir in outputs.items():
        location = record["pieces"].get(name, {"where": "", "fingerprint": "", "files": {}, "sizes": {}, "bytes": 0})
        os.makedirs(artifact_dir, exist_ok=True)
        with open(os.path.join(artifact_dir, LOCATION_FILE), "w") as f:
            json.dump(location, f, indent=1, sort_keys=True)
        if location["files"]:
            located(artifact_dir)
    with open(kl_state_path, "w") as f:
        json.dump(record.get("kl_state", {}), f)


def chain_id(*parts) -> str:
    """A chain's id (its MLflow parent run's tag): the same for the same config on the same workspace, so the
    command run again continues the chain and its parent run."""
    import hashlib

    return "chain-" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def package_paths(path: str, count: int) -> dict[str, str]:
    """{shape: file} of a chain compiled to `path`: the first run's package is `path` itself (what submit sends
    first), the others beside it (PATH.next.yaml for the middle runs, PATH.last.yaml), and PATH.chain.yaml."""
    stem, ext = os.path.splitext(path)
    shapes = ["first"] + (["next"] if count > 2 else []) + ["last"]
    return {shape: path if shape == "first" else f"{stem}.{shape}{ext}" for shape in shapes} | {
        "manifest": f"{stem}.chain{ext}"}


#: The `kind` of a chain manifest (PATH.chain.yaml).
MANIFEST_KIND = "prmflow-chain"


def is_manifest(path: str) -> bool:
    import yaml

    try:
        with open(path) as f:
            return (yaml.safe_load(f) or {}).get("kind") == MANIFEST_KIND
    except (OSError, yaml.YAMLError, AttributeError):
        return False


@dataclass
class Continuation:
    """What a run of a chain needs to submit the next one from inside the cluster (the `chain` run parameter, JSON):
    the uploaded packages of the later runs, where runs are filed, and the arguments every run of the chain gets."""

    pipeline_id: str
    versions: dict
    """{shape: pipeline version id} of the `next` and `last` packages."""
    experiment_id: str
    total: int
    per_run: int
    arguments: dict
    namespace: str = ""
    kfp_namespace: str = "kubeflow"
    run_name: str = ""
    pipeline_root: str = ""
    service_account: str = ""

    def to_json(self) -> str:
        import dataclasses

        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Continuation":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the run parameter `chain` is not what `pipeline submit` writes ({e}); submit the chain "
                              f"with `prmflow pipeline submit --config ...`.") from None

    def next_run(self, after: int) -> Segment:
        """The run that starts after `after` iterations."""
        return next(s for s in segments(self.total, self.per_run) if s.first == after)


def submit_next(chain_json: str, after: int, chain_id: str, connect=None) -> str:
    """Submit the run of the chain that starts after `after` iterations, from inside the cluster: kfp.Client with no
    host finds the in-cluster API service and sends the pod's projected pipelines token (client.connect; the
    task's pod is labelled for Kubeflow's `access-ml-pipeline` PodDefault). Returns the new run's id."""
    from . import client

    cont = Continuation.from_json(chain_json)
    seg = cont.next_run(after)
    version = cont.versions.get(seg.shape)
    if not version:
        raise ConfigError(f"chain: no uploaded package for a {seg.shape} run (have {sorted(cont.versions)}); submit the "
                          f"chain again with `prmflow pipeline submit --config ...`.")
    conn = client.Connection(namespace=cont.namespace, kfp_namespace=cont.kfp_namespace)
    kfp_client = (connect or client.connect)(conn)
    params = {**cont.arguments, FIRST_PARAM: seg.first, CHAIN_PARAM: chain_json, CHAIN_ID_PARAM: chain_id}
    name = f"{cont.run_name or 'prmflow'} [{seg.index + 1}/{seg.count}: iterations {seg.first}..{seg.end - 1}]"
    with client.api_errors(conn, f"submitting run {seg.index + 1}/{seg.count} of the chain"):
        run = kfp_client.run_pipeline(experiment_id=cont.experiment_id, job_name=name, params=params,
                                      pipeline_id=cont.pipeline_id, version_id=version,
                                      pipeline_root=cont.pipeline_root or None,
                                      service_account=cont.service_account or None)
    run_id = client.require_id(conn, run.run_id, f"run {seg.index + 1} of the chain")
    print(f"chain: submitted run {seg.index + 1}/{seg.count} (iterations {seg.first}..{seg.end - 1}): {run_id}")
    return run_id


def upload_packages(kfp_client, conn, name: str, packages: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Upload the later runs' packages ({shape: file}) as versions of pipeline `name` (made if missing), each
    version named by shape and sha256, so a resubmitted chain finds its versions instead of uploading twice.
    Returns (pipeline id, {shape: version id})."""
    import hashlib

    from . import client

    query = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})
    ns = conn.namespace or None
    with client.api_errors(conn, f"looking up pipeline {name}"):
        found = kfp_client.list_pipelines(filter=query, namespace=ns).pipelines or []
    pipeline_id = found[0].pipeline_id if found else ""
    if not pipeline_id:  # made with a first version (named like the pipeline), unused: versions are named below
        with client.api_errors(conn, f"uploading pipeline {name}"):
            made = kfp_client.upload_pipeline(next(iter(packages.values())), pipeline_name=name, namespace=ns,
                                              description="The later runs of prmflow chains (pipeline submit).")
        pipeline_id = client.require_id(conn, made.pipeline_id, f"the upload of pipeline {name}")
    versions = {}
    for shape, path in packages.items():
        with open(path, "rb") as f:
            version = f"{shape}-sha256-{hashlib.sha256(f.read()).hexdigest()[:12]}"
        vquery = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": version}]})
        with client.api_errors(conn, f"uploading the {shape} package of the chain"):
            have = kfp_client.list_pipeline_versions(pipeline_id, filter=vquery).pipeline_versions or []
            if have:
                versions[shape] = have[0].pipeline_version_id
                continue
            made = kfp_client.upload_pipeline_version(path, pipeline_version_name=version, pipeline_id=pipeline_id)
        versions[shape] = client.require_id(conn, made.pipeline_version_id, f"the upload of version {version}")
    return pipeline_id, versions


def read_manifest(package: str) -> tuple[dict, dict[str, str]]:
    """The chain manifest compiled beside the first run's `package` (compile_chain), and {shape: file} of the later
    runs' packages; an error naming the file when it is not there."""
    import yaml

    stem, ext = os.path.splitext(package)
    path = f"{stem}.chain{ext}"
    if not is_manifest(path):
        raise ConfigError(f"{package} is the first run of a chain, but its manifest {path} is missing or not one: "
                          f"compile the chain again (`prmflow pipeline compile -o {package}` writes all its files) "
                          f"or submit with --config.")
    with open(path) as f:
        manifest = yaml.safe_load(f)
    later = {shape: os.path.join(os.path.dirname(path), name) for shape, name in manifest["packages"].items()
             if shape != "first"}
    for shape, p in later.items():
        if not os.path.isfile(p):
            raise ConfigError(f"{path} names {p} (the {shape} runs' package), which is missing: compile the chain again.")
    return manifest, later
