"""Kubeflow Pipelines backend rules (driver and Argo compiler) that a compiled prmflow spec must meet.

Read from kubeflow/pipelines at 2.15.0, 2.16.0/2.16.1 and 2.17.0 (the lines below were read at each tag):

- The driver mounts the run's workspace (`/kfp-workspace`) only into a task whose input parameter
  values contain `{{$.workspace_path}}` or `/kfp-workspace`, or whose first input artifact carries the
  `_kfp_workspace` metadata an importer with download_to_workspace sets (`needsWorkspaceMount`).
- A task that gets the workspace must not have its own volume mount under `/kfp-workspace`
  (`validateVolumeMounts`).
- The Argo compiler builds the workspace PVC from the API server's default claim template patched by
  the spec's pvcSpecPatch (only accessModes and storageClassName may be patched); accessModes is
  required, and before 2.17 so is a storageClassName: without one, the run is refused at creation
  ("workspace PVC spec must specify storageClassName"). 2.17.0 leaves it to the cluster's default
  storage class, and refuses only an explicit empty string.
- A task's cache key holds its parameters, input artifacts, command + args, image and mounted PVC names,
  never its env (`cache_key`): what must re-run a step when it changes has to be a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from . import KFP_VERSIONS, Source, version_family, version_tuple

REPO = "kubeflow/pipelines"
#: kfp.dsl.WORKSPACE_PATH_PLACEHOLDER; the driver looks for it verbatim in parameter values.
WORKSPACE_PLACEHOLDER = "{{$.workspace_path}}"
#: component.WorkspaceMountPath, where the driver mounts the per-run workspace.
WORKSPACE_MOUNT_PATH = "/kfp-workspace"
WORKSPACE_ARTIFACT_FLAG = "_kfp_workspace"

WORKSPACE_MOUNT_PATH_SOURCE = {
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/component/constants.go", 31),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/component/constants.go", 32),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/component/constants.go", 32),
}
DRIVER_WORKSPACE_MOUNT = {  # needsWorkspaceMount
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/driver/driver.go", 456),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/driver/driver.go", 475),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/driver/driver.go", 521),
}
DRIVER_VOLUME_CONFLICT = {  # validateVolumeMounts
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/driver/driver.go", 729),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/driver/driver.go", 766),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/driver/driver.go", 812),
}
WORKSPACE_PVC_PATCH_FIELDS = ("accessModes", "storageClassName")
WORKSPACE_PVC_PATCH_FIELDS_SOURCE = {  # convertStructToPVCSpec's `allowed`
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/compiler/argocompiler/argo.go", 494),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/compiler/argocompiler/argo.go", 523),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/compiler/argocompiler/argo.go", 609),
}
WORKSPACE_ACCESS_MODES = {  # GetWorkspacePVC: "workspace PVC spec must specify accessModes"
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/compiler/argocompiler/argo.go", 548),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/compiler/argocompiler/argo.go", 577),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/compiler/argocompiler/argo.go", 663),
}
WORKSPACE_STORAGE_CLASS = {  # GetWorkspacePVC
    "2.15": Source(REPO, "2.15.0", "backend/src/v2/compiler/argocompiler/argo.go", 552),
    "2.16": Source(REPO, "2.16.1", "backend/src/v2/compiler/argocompiler/argo.go", 581),
    "2.17": Source(REPO, "2.17.0", "backend/src/v2/compiler/argocompiler/argo.go", 669),
}
#: The API server's default claim template (its config's workspace.volumeclaimtemplatespec) must itself
#: name accessModes and a storageClassName (getPVCSpec).
SERVER_DEFAULT_WORKSPACE = Source(REPO, "2.15.0", "backend/src/apiserver/main.go", 513)
#: GET /apis/v2beta1/healthz answers {"commit_sha", "tag_name", "multi_user", "pipeline_store"}.
HEALTHZ_TAG_NAME = Source(REPO, "2.15.0", "backend/src/apiserver/main.go", 364)


def family(version: str) -> str:
    """'2.16.1' -> '2.16'; ValueError for a version we do not check against."""
    return version_family(version, KFP_VERSIONS, "KFP version")


def driver_mounts_workspace(parameter_values: dict, input_artifacts_metadata: list[dict] | None = None) -> bool:
    """The driver's needsWorkspaceMount: does a task with these input parameter values (and input artifact
    lists, each the metadata of its first artifact) get the run's workspace mounted?"""
    for value in parameter_values.values():
        if isinstance(value, str) and (WORKSPACE_PLACEHOLDER in value or WORKSPACE_MOUNT_PATH in value):
            return True
    return any(meta.get(WORKSPACE_ARTIFACT_FLAG) is True for meta in input_artifacts_metadata or ())


def volume_mount_conflicts(mount_paths: list[str]) -> list[str]:
    """The driver's validateVolumeMounts: user mounts that collide with the workspace mount."""
    return [p for p in mount_paths if p.startswith(WORKSPACE_MOUNT_PATH)]


def workspace_pvc_errors(pvc_spec_patch: dict, version: str, server_default_class: bool = False) -> list[str]:
    """What the Argo compiler of `version` refuses in a pipeline workspace's pvcSpecPatch. server_default_class:
    the API server's config has a default claim template (which then names a storage class)."""
    fam = family(version)
    errors = []
    unknown = sorted(set(pvc_spec_patch) - set(WORKSPACE_PVC_PATCH_FIELDS))
    if unknown:
        errors.append(f"unknown fields in PVC spec patch: {unknown} ({WORKSPACE_PVC_PATCH_FIELDS_SOURCE[fam]})")
    if not pvc_spec_patch.get("accessModes") and not server_default_class:
        errors.append(f"workspace PVC spec must specify accessModes ({WORKSPACE_ACCESS_MODES[fam]})")
    cls = pvc_spec_patch.get("storageClassName")
    if version_tuple(fam) < (2, 17):
        if not cls and not server_default_class:
            errors.append(f"workspace PVC spec must specify storageClassName (KFP {fam}: {WORKSPACE_STORAGE_CLASS[fam]})")
    elif cls is not None and cls == "":
        errors.append("workspace PVC spec storageClassName must be omitted or set to a non-empty value "
                      f"({WORKSPACE_STORAGE_CLASS[fam]})")
    return errors


@dataclass
class ExecutorTask:
    """A task of a compiled spec that runs a container: what the driver sees of it."""

    name: str
    component: str
    executor: str
    parameters: dict = field(default_factory=dict)
    """Input parameter name -> its constant value (None where it is only known at run time)."""
    inputs: dict = field(default_factory=dict)
    """Input artifact name -> [(producer component, output key)] (a Collected list has several)."""


def executor_tasks(ir: dict) -> list[ExecutorTask]:
    """Every container task of a compiled pipeline spec (inside loops and the exit handler too), with its
    constant parameters resolved through the DAGs that pass them down."""
    comps = ir["components"]
    found: list[ExecutorTask] = []

    def dag_of(comp: str) -> dict:
        return ir["root"]["dag"] if comp == "__root__" else comps[comp]["dag"]

    def producers(comp: str, key: str) -> list[tuple[str, str]]:
        if "dag" not in comps[comp]:
            return [(comp, key)]
        out = []
        for sel in comps[comp]["dag"]["outputs"]["artifacts"][key]["artifactSelectors"]:
            sub = comps[comp]["dag"]["tasks"][sel["producerSubtask"]]["componentRef"]["name"]
            out.extend(producers(sub, sel["outputArtifactKey"]))
        return out

    def visit(comp: str, params: dict, arts: dict):
        tasks = dag_of(comp)["tasks"]
        for name, t in tasks.items():
            ref = t["componentRef"]["name"]
            values = {}
            for pname, p in (t.get("inputs") or {}).get("parameters", {}).items():
                if "runtimeValue" in p:
                    values[pname] = p["runtimeValue"].get("constant")
                elif "componentInputParameter" in p:
                    values[pname] = params.get(p["componentInputParameter"])
                else:
                    values[pname] = None
            inputs = {}
            for aname, a in (t.get("inputs") or {}).get("artifacts", {}).items():
                if "componentInputArtifact" in a:
                    inputs[aname] = arts.get(a["componentInputArtifact"], [])
                else:
                    src = a["taskOutputArtifact"]
                    inputs[aname] = producers(tasks[src["producerTask"]]["componentRef"]["name"],
                                              src["outputArtifactKey"])
            if "dag" in comps[ref]:
                visit(ref, values, inputs)
            else:
                found.append(ExecutorTask(t["taskInfo"]["name"], ref, comps[ref].get("executorLabel", ""),
                                          values, inputs))

    root_params = {k: p.get("defaultValue") for k, p in
                   (ir["root"].get("inputDefinitions") or {}).get("parameters", {}).items()}
    visit("__root__", root_params, {})
    return found


#: What KFP's driver puts in a task's cache key (the same at 2.15-2.17; read at 2.17.0): the input parameter
#: values and input artifact names, the output artifacts' and parameters' specs, the container's command + args
#: and image, and the names of the PVCs the task mounts (getFingerPrint -> GenerateCacheKey). Not the env, the
#: resources, node selectors or tolerations: a change there alone is a cache hit.
CACHE_KEY = Source(REPO, "2.17.0", "backend/src/v2/driver/cache.go", "83-111")
CACHE_KEY_FIELDS = Source(REPO, "2.17.0", "backend/src/v2/cacheutils/cache.go", "173-228")
#: The PVC names in the key: those of the task's own pvcMount, plus the per-run workspace's only when the
#: driver mounts it into this task (needsWorkspaceMount).
CACHE_KEY_PVCS = Source(REPO, "2.17.0", "backend/src/v2/driver/container.go", "149-171")
#: The per-run workspace PVC's name in the key (GetWorkspacePVCName: the run name and a suffix): one per run.
PER_RUN_WORKSPACE_PVC = "{run}-kfp-workspace"


def cache_key(task: ExecutorTask, container: dict, pvc_mounts: list[str], outputs: dict | None = None) -> dict:
    """The driver's cache key of `task` (as far as a compiled spec fixes it): `container` is the task's
    deploymentSpec executor container (image, command, args), `pvc_mounts` the claim names of its
    pvcMount, `outputs` its component's outputDefinitions. Input artifacts are keyed by their producers
    (the driver keys them by artifact name, which a cached producer keeps)."""
    pvcs = set(pvc_mounts)
    if driver_mounts_workspace(task.parameters):
        pvcs.add(PER_RUN_WORKSPACE_PVC)
    return {
        "inputParameterValues": task.parameters,
        "inputArtifactNames": {k: sorted(map(list, v)) for k, v in task.inputs.items()},
        "outputs": outputs or {},
        "containerSpec": {"image": container.get("image", ""),
                          "cmdArgs": [*container.get("command", []), *container.get("args", [])],
                          "pvcNames": sorted(pvcs)},
    }
