"""How big a run may grow: the limits of the Argo Workflow a KFP run becomes, and of what stores it.

Read from kubeflow/pipelines at 2.15.0, 2.16.1 and 2.17.0, argoproj/argo-workflows at v3.7.3 and v4.0.5
(the controllers those KFP releases deploy), etcd, Kubernetes and Linux:

- KFP's API server compiles the pipeline spec into one Argo Workflow. Component specs and container
  implementations go once into `spec.arguments.parameters`, keyed by the sha256 of the container
  (identical containers are stored once); every DAG's own spec and every task's JSON are stored per task.
- The Argo controller refuses to keep a workflow whose JSON (metadata + spec + status) is longer than
  MAX_WORKFLOW_SIZE, 1 MiB unless the controller's environment sets it; KFP's manifests do not. Only
  `status.nodes` can shrink: gzip + base64 into `status.compressedNodes`. Offloading the nodes needs a
  persistence database, which KFP's manifests do not configure. Past the limit the run goes to Error
  ("workflow is longer than maximum allowed size").
- Every node of a running workflow stores its template's resolved inputs, and a Retry node (a template
  with a retryStrategy) stores them again, with the last child's outputs. KFP 2.17 gives every template a
  retryStrategy through the controller's workflowDefaults; earlier, only tasks with a retry policy.
- The driver's pod-spec patch, an output of the driver and an input of the executor, holds the executor
  input twice (the launcher's --executor_input, and the user command's {{$}}), the component spec and the
  user command (for a lightweight component, its Python source).
- etcd refuses a request over 1.5 MiB; the API server a body over 3 MiB.
- Linux refuses to exec a program with one argument (or environment string) over 128 KiB; the DAG driver
  of the exit handler takes that DAG's whole spec, every task of every iteration, as `--component`.
"""

from __future__ import annotations

from . import Source

KFP = "kubeflow/pipelines"
ARGO = "argoproj/argo-workflows"
KFP_TAG = {"2.15": "2.15.0", "2.16": "2.16.1", "2.17": "2.17.0"}

#: The workflow controller each KFP release deploys.
ARGO_OF_KFP = {"2.15": "v3.7.3", "2.16": "v3.7.3", "2.17": "v4.0.5"}
ARGO_OF_KFP_SOURCE = {
    "2.15": Source(KFP, "2.15.0", "manifests/kustomize/third-party/argo/base/workflow-controller-deployment-patch.yaml", 13),
    "2.16": Source(KFP, "2.16.1", "manifests/kustomize/third-party/argo/base/workflow-controller-deployment-patch.yaml", 14),
    "2.17": Source(KFP, "2.17.0", "manifests/kustomize/third-party/argo/base/workflow-controller-deployment-patch.yaml", 14),
}

#: getMaxWorkflowSize: $MAX_WORKFLOW_SIZE, else 1024 * 1024; getSize is len(json.Marshal(wf)).
MAX_WORKFLOW_SIZE = 1024 * 1024
MAX_WORKFLOW_SIZE_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "workflow/packer/packer.go", "14-22, 43-54"),
    "v4.0.5": Source(ARGO, "v4.0.5", "workflow/packer/packer.go", "15-23, 44-55"),
}
#: compressWorkflow: status.nodes -> status.compressedNodes = base64(gzip(json(nodes))); still too large -> error.
COMPRESS_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "workflow/packer/packer.go", "73-97"),
    "v4.0.5": Source(ARGO, "v4.0.5", "workflow/packer/packer.go", 74),
}
ENCODE_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "util/file/fileutil.go", "84-86"),
    "v4.0.5": Source(ARGO, "v4.0.5", "util/file/fileutil.go", 86),
}
#: Dehydrate: compress if needed, else offload to the persistence DB (which KFP's manifests do not configure).
DEHYDRATE_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "workflow/hydrator/hydrator.go", "93-127"),
    "v4.0.5": Source(ARGO, "v4.0.5", "workflow/hydrator/hydrator.go", "95-117"),
}
#: initializeExecutableNode: node.Inputs = the template's resolved inputs, on every node.
NODE_INPUTS_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "workflow/controller/operator.go", "2634-2637"),
    "v4.0.5": Source(ARGO, "v4.0.5", "workflow/controller/operator.go", 2785),
}
#: executeTemplate: a template with a retryStrategy gets a Retry parent node (inputs again; the last child's outputs).
RETRY_NODE_SOURCE = {
    "v3.7.3": Source(ARGO, "v3.7.3", "workflow/controller/operator.go", "2182-2209"),
    "v4.0.5": Source(ARGO, "v4.0.5", "workflow/controller/operator.go", "2313-2318"),
}
#: workflowDefaults.spec.templateDefaults.retryStrategy {limit: 2, retryPolicy: OnError}: every template retries.
RETRY_EVERY_TEMPLATE = {"2.15": False, "2.16": False, "2.17": True}
RETRY_EVERY_TEMPLATE_SOURCE = Source(
    KFP, "2.17.0", "manifests/kustomize/third-party/argo/base/workflow-controller-configmap-patch.yaml", "50-59")
#: A task's own retry policy (task.set_retry) becomes the executor template's retryStrategy.
TASK_RETRY_SOURCE = {
    "2.15": Source(KFP, "2.15.0", "backend/src/v2/compiler/argocompiler/container.go", 558),
    "2.16": Source(KFP, "2.16.1", "backend/src/v2/compiler/argocompiler/container.go", 570),
    "2.17": Source(KFP, "2.17.0", "backend/src/v2/compiler/argocompiler/container.go", 577),
}
#: Component specs and implementations stored once per sha256 of the container (hashComponentContainer).
DEDUP_SOURCE = {
    "2.15": Source(KFP, "2.15.0", "backend/src/v2/compiler/argocompiler/argo.go", "251-373"),
    "2.16": Source(KFP, "2.16.1", "backend/src/v2/compiler/argocompiler/argo.go", "277-399"),
    "2.17": Source(KFP, "2.17.0", "backend/src/v2/compiler/argocompiler/argo.go", "359-481"),
}
#: initPodSpecPatch: the launcher's --executor_input and --component_spec, then the user command and args.
POD_SPEC_PATCH_SOURCE = {
    "2.15": Source(KFP, "2.15.0", "backend/src/v2/driver/driver.go", "274-275"),
    "2.16": Source(KFP, "2.16.1", "backend/src/v2/driver/driver.go", "291-292"),
    "2.17": Source(KFP, "2.17.0", "backend/src/v2/driver/driver.go", "320-337"),
}
#: The DAG driver's `--component` argument: the DAG's whole spec, one argv string.
DAG_DRIVER_COMPONENT_ARG = {
    "2.15": Source(KFP, "2.15.0", "backend/src/v2/compiler/argocompiler/dag.go", 565),
    "2.16": Source(KFP, "2.16.1", "backend/src/v2/compiler/argocompiler/dag.go", 578),
    "2.17": Source(KFP, "2.17.0", "backend/src/v2/compiler/argocompiler/dag.go", 580),
}

#: etcd's default --max-request-bytes (DefaultMaxRequestBytes); "etcdserver: request is too large".
ETCD_MAX_REQUEST = int(1.5 * 1024 * 1024)
ETCD_MAX_REQUEST_SOURCE = Source("etcd-io/etcd", "main", "server/embed/config.go", "DefaultMaxRequestBytes")
#: The Kubernetes API server's MaxRequestBodyBytes default (413 above it).
API_MAX_BODY = 3 * 1024 * 1024
API_MAX_BODY_SOURCE = Source("kubernetes/kubernetes", "master", "staging/src/k8s.io/apiserver/pkg/server/config.go",
                             "NewConfig: MaxRequestBodyBytes")
#: MAX_ARG_STRLEN = PAGE_SIZE * 32 (4 KiB pages): execve refuses a longer argument, "argument list too long".
MAX_ARG_STRLEN = 32 * 4096
MAX_ARG_STRLEN_SOURCE = Source("torvalds/linux", "master", "include/uapi/linux/binfmts.h", "MAX_ARG_STRLEN")
#: Reported for main container args over 128 KB on Argo v3.6.10 - v3.7.9 and main (argoproj/argo-workflows#15471,
#: kubeflow/pipelines#12453); no change between v3.7.3 and v4.0.5 says it was fixed, so every version is held to it.
ARG_LIMIT_REPORT = "argoproj/argo-workflows#15471"


def argo_of(kfp_family: str) -> str:
    """The workflow controller KFP `kfp_family` ('2.15') deploys."""
    return ARGO_OF_KFP[kfp_family]
