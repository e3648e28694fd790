"""What the target Kubeflow Pipelines backend would refuse or break in a compiled prmflow spec, found
before anything runs (`pipeline compile`, `plan`, `submit`, `upload`).

The rules are KFP's own, from contracts/kfp.py, for the version in pipeline.cluster.kfp_version (and,
on submit, the version the API server reports):
- the per-run workspace's claim is one the Argo compiler of that version accepts (storage class);
- every task that opens state on the workspace (a location artifact of sft, prm, prm-update, ppo or
  locate) or writes it gets the workspace mounted: workspace_pvc on its pod, or, with KFP's per-run
  workspace, a parameter naming it (the driver's mount rule).
"""

from __future__ import annotations

import re

from ..errors import ConfigError
from .contracts import kfp as kfp_rules

#: Components whose Model/Artifact outputs are locations on the workspace (kfp_shim.write_location);
#: ppo's kl_state is a copied file, not a location.
LOCATION_PRODUCERS = ("sft", "prm", "prm-update", "ppo", "locate")
NOT_LOCATIONS = ("kl_state",)
#: Components that write heavy state to the workspace.
WORKSPACE_WRITERS = ("sft", "prm", "prm-update", "ppo")


def _stage(component: str) -> str:
    """comp-ppo-2 -> ppo; comp-prm-update-3 -> prm-update."""
    return re.sub(r"^comp-|-\d+$", "", component)


def workspace_tasks(ir: dict) -> list[kfp_rules.ExecutorTask]:
    """The container tasks that need the workspace: they open a location or write state there."""
    out = []
    for task in kfp_rules.executor_tasks(ir):
        reads = any(_stage(comp) in LOCATION_PRODUCERS and key not in NOT_LOCATIONS
                    for sources in task.inputs.values() for comp, key in sources)
        if reads or _stage(task.component) in WORKSPACE_WRITERS:
            out.append(task)
    return out


def mounted(task: kfp_rules.ExecutorTask, platform: dict, per_run_workspace: bool) -> bool:
    """Does `task`'s pod get the workspace: workspace_pvc mounted on it, or KFP's per-run workspace by the
    driver's rule (a parameter naming it)?"""
    if platform.get(task.executor, {}).get("pvcMount"):
        return True
    return per_run_workspace and kfp_rules.driver_mounts_workspace(task.parameters)


def backend_errors(docs: list[dict], version: str, server_default_class: bool = False) -> list[str]:
    """What KFP `version` would refuse (at run creation) or leave unmounted in the compiled spec `docs`
    (the YAML documents of a package: the pipeline spec and its platform spec)."""
    ir = docs[0]
    k8s = (docs[1] if len(docs) > 1 else {}).get("platforms", {}).get("kubernetes", {})
    platform = k8s.get("deploymentSpec", {}).get("executors", {})
    workspace = (k8s.get("pipelineConfig") or {}).get("workspace")
    errors = []
    if workspace is not None:
        patch = (workspace.get("kubernetes") or {}).get("pvcSpecPatch") or {}
        for e in kfp_rules.workspace_pvc_errors(patch, version, server_default_class):
            errors.append(f"KFP {version} refuses the run's workspace: {e}. Set pipeline.cluster.workspace_storage_class "
                          f"to a ReadWriteMany storage class (kubectl get storageclass), or to server-default if "
                          f"the KFP API server's config sets workspace.volumeclaimtemplatespec, or give "
                          f"pipeline.cluster.workspace_pvc; KFP >= 2.17 (pipeline.cluster.kfp_version) takes the "
                          f"cluster's default class.")
    fam = kfp_rules.family(version)
    for task in workspace_tasks(ir):
        if not mounted(task, platform, workspace is not None):
            errors.append(f"task '{task.name}' opens state on the workspace, but KFP {version}'s driver would not "
                          f"mount it there (no workspace_pvc mount, no parameter naming the per-run workspace: "
                          f"{kfp_rules.DRIVER_WORKSPACE_MOUNT[fam]}): the step would fail to find its input.")
    return errors


def check(docs: list[dict], version: str, server_default_class: bool = False, where: str = "") -> None:
    """ConfigError listing what KFP `version` would refuse in `docs`; nothing when it would run."""
    errors = backend_errors(docs, version, server_default_class)
    if errors:
        raise ConfigError(f"{where or 'the compiled pipeline'} would not run on Kubeflow Pipelines {version}:\n  "
                          + "\n  ".join(errors))
