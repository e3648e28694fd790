"""How big a compiled prmflow pipeline grows on the cluster, and so how many RL iterations one run holds.

A KFP run is one Argo Workflow: its spec (what the API server's Argo compiler makes of the pipeline spec)
and, while it runs, one status node per driver, executor and DAG, each storing its inputs and outputs
(contracts/argo.py has every rule and its source). This module rebuilds both from the compiled pipeline
spec, the way KFP and Argo lay them out, and measures their JSON:

- `argo_spec`: the Workflow's spec, emulated from the pipeline spec as KFP's Argo compiler writes it
  (checked against KFP's own test_data/compiled-workflows in tests/pipelines/test_run_size.py);
- `node_status`: the status nodes of a finished run: per container task a driver pod (the component,
  task, container and Kubernetes config in; the pod-spec patch out), an executor DAG and the pod (the
  patch in), per DAG its driver and node, Retry parents where the template retries; serialized,
  gzipped and base64-encoded as Argo's packer does. What the run itself writes (artifact URIs, metadata,
  node names, timestamps) is modelled with realistic lengths, not observed.

A run is accepted when, with MARGIN to spare, its spec fits etcd and Argo's limit, its spec plus the
compressed nodes at the end of the run fit MAX_WORKFLOW_SIZE, and no driver argument passes Linux's
single-argument limit. Every part grows linearly in the iterations, so two compiles (2 and 4 iterations)
give the largest count that fits (`max_iterations`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import math
from dataclasses import dataclass

from .contracts import argo as rules
from .contracts import kfp as kfp_rules

#: The share of every limit kept free: status the model does not see (a retried pod, a longer message,
#: metadata we underestimate) must not be what tips a run over.
MARGIN = 0.25
#: Argo's system templates (container driver, executor, impl, DAG driver) and the Workflow's fixed fields:
#: their JSON in KFP 2.17.0's test_data/compiled-workflows/hello_world.yaml, less that pipeline's name.
SYSTEM_TEMPLATES_BYTES = 2257 + 390 + 1917 + 2069 + 282 - 2 * len("echo")
#: Artifact metadata one of our tasks records (kfp_shim.write_location: where, fingerprint, bytes; plus the
#: stage's metrics on a Model): modelled sizes, by artifact type.
METADATA_BYTES = {"system.Model": 900, "system.Artifact": 200, "system.Dataset": 120, "system.Metrics": 400}
RUN_NAME = "prmflow-pipeline-x7k2q"  # a Workflow's name: KFP's generateName + 5 characters


def _json(value) -> str:
    """Compact JSON with sorted keys: how KFP stores a proto (stablyMarshalJSON) and Go marshals a map."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _hex(seed: str, n: int = 64) -> str:
    """A stable pseudo-random hex string (uuids, hashes, ids of the modelled run)."""
    out = ""
    while len(out) < n:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        out += seed
    return out[:n]


# ---- the Workflow's spec, as KFP's Argo compiler writes it ---------------------------------------------

def _param(name: str, value: str) -> dict:
    return {"name": name, "value": value}


def _container_tasks(name: str, task: dict, comp_ref: str, impl_ref: str, k8s: dict | None, in_loop: bool) -> list[dict]:
    """A container task: its driver (component, task JSON, container, Kubernetes config) and its executor."""
    params = [_param("component", comp_ref), _param("task", _json(task)), _param("container", impl_ref),
              _param("task-name", name), _param("parent-dag-id", "{{inputs.parameters.parent-dag-id}}")]
    if in_loop:
        params.append(_param("iteration-index", "{{inputs.parameters.iteration-index}}"))
    if k8s:
        params.append(_param("kubernetes-config", _json(k8s)))
    deps = " && ".join(f"{d}.Succeeded" for d in task.get("dependentTasks", []))
    driver = {"arguments": {"parameters": params}, "name": f"{name}-driver", "template": "system-container-driver",
              **({"depends": deps} if deps else {})}
    executor = {"arguments": {"parameters": [
        _param("pod-spec-patch", f"{{{{tasks.{name}-driver.outputs.parameters.pod-spec-patch}}}}"),
        {"default": "false", **_param("cached-decision", f"{{{{tasks.{name}-driver.outputs.parameters.cached-decision}}}}")}]},
        "depends": f"{name}-driver.Succeeded", "name": name, "template": "system-container-executor"}
    return [driver, executor]


def _dag_driver(name: str, comp: str, task: dict, extra: list[dict] = ()) -> dict:
    return {"arguments": {"parameters": [_param("component", f"{{{{workflow.parameters.components-{comp}}}}}"),
                                         *extra, _param("parent-dag-id", "{{inputs.parameters.parent-dag-id}}"),
                                         _param("task", _json(task)), _param("task-name", name)]},
            "name": name, "template": "system-dag-driver"}


def _dag_template(name: str, tasks: list[dict], loop: bool = False) -> dict:
    inputs = [{"name": "parent-dag-id"}] + ([{"name": "iteration-index"}] if loop else [])
    return {"dag": {"tasks": tasks}, "inputs": {"parameters": inputs}, "metadata": {}, "name": name, "outputs": {}}


def argo_spec(docs: list[dict]) -> dict:
    """The Argo Workflow (no status) KFP's API server makes of the compiled spec `docs` (pipeline spec and
    platform spec), laid out as KFP's Argo compiler does; exact where it matters for size (the stored
    component specs, implementations, task JSON and Kubernetes configs), the system templates as measured."""
    ir = docs[0]
    k8s = (docs[1] if len(docs) > 1 else {}).get("platforms", {}).get("kubernetes", {})
    platform = k8s.get("deploymentSpec", {}).get("executors", {})
    comps, execs = ir["components"], ir.get("deploymentSpec", {}).get("executors", {})
    arguments, templates, stored = [], [], set()

    def container_ref(comp: str) -> tuple[str, str]:
        """Component spec and implementation, stored once per sha256 of the container (hashComponentContainer)."""
        container = execs[comps[comp]["executorLabel"]].get("container", execs[comps[comp]["executorLabel"]])
        digest = hashlib.sha256(_json(container).encode()).hexdigest()
        if digest not in stored:
            stored.add(digest)
            arguments.append(_param(f"components-{digest}", _json(comps[comp])))
            arguments.append(_param(f"implementations-{digest}", _json(container)))
        return f"{{{{workflow.parameters.components-{digest}}}}}", f"{{{{workflow.parameters.implementations-{digest}}}}}"

    def dag(comp: str, spec: dict, in_loop: bool) -> None:
        arguments.append(_param(f"components-{comp}", _json(spec)))
        tasks = []
        for name, task in spec["dag"]["tasks"].items():
            ref = task["componentRef"]["name"]
            if "dag" not in comps[ref]:
                comp_ref, impl_ref = container_ref(ref)
                tasks += _container_tasks(name, task, comp_ref, impl_ref, platform.get(comps[ref]["executorLabel"]), in_loop)
                continue
            loop = "parameterIterator" in task or "artifactIterator" in task
            dag(ref, comps[ref], in_loop or loop)
            if loop:  # an iterator template (count) and an iteration template (one item), each with a DAG driver
                iteration = _dag_template(f"{ref}-iteration", [
                    _dag_driver("iteration-item-driver", ref, task,
                                [_param("iteration-index", "{{inputs.parameters.iteration-index}}")]),
                    {"arguments": {"parameters": [
                        _param("parent-dag-id", "{{tasks.iteration-item-driver.outputs.parameters.execution-id}}"),
                        _param("condition", "{{tasks.iteration-item-driver.outputs.parameters.condition}}")]},
                     "depends": "iteration-item-driver.Succeeded", "name": "iteration-item", "template": ref}], loop=True)
                iterator = _dag_template(f"{ref}-{name}-iterator", [
                    _dag_driver("iteration-driver", ref, task),
                    {"arguments": {"parameters": [
                        _param("parent-dag-id", "{{tasks.iteration-driver.outputs.parameters.execution-id}}"),
                        _param("iteration-index", "{{item}}")]},
                     "depends": "iteration-driver.Succeeded", "name": "iteration-iterations", "template": f"{ref}-iteration",
                     "withSequence": {"count": "{{tasks.iteration-driver.outputs.parameters.iteration-count}}"}}])
                templates.extend([iteration, iterator])
                tasks.append({"arguments": {"parameters": [_param("parent-dag-id", "{{inputs.parameters.parent-dag-id}}")]},
                              "name": name, "template": iterator["name"]})
            else:
                tasks.append(_dag_driver(f"{name}-driver", ref, task))
                tasks.append({"arguments": {"parameters": [
                    _param("parent-dag-id", f"{{{{tasks.{name}-driver.outputs.parameters.execution-id}}}}"),
                    _param("condition", f"{{{{tasks.{name}-driver.outputs.parameters.condition}}}}")]},
                    "depends": f"{name}-driver.Succeeded", "name": name, "template": ref})
        templates.append(_dag_template(comp, tasks, loop=in_loop))

    dag("root", ir["root"], False)
    runtime = {"parameterValues": {k: p.get("defaultValue") for k, p in
                                   ir["root"].get("inputDefinitions", {}).get("parameters", {}).items()}}
    templates.append({"dag": {"tasks": [
        {"arguments": {"parameters": [_param("component", "{{workflow.parameters.components-root}}"),
                                      _param("runtime-config", _json(runtime)), _param("driver-type", "ROOT_DAG")]},
         "name": "root-driver", "template": "system-dag-driver"},
        {"arguments": {"parameters": [_param("parent-dag-id", "{{tasks.root-driver.outputs.parameters.execution-id}}"),
                                      _param("condition", "")]},
         "depends": "root-driver.Succeeded", "name": "root", "template": "root"}]},
        "inputs": {}, "metadata": {}, "name": "entrypoint", "outputs": {}})
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
            "metadata": {"generateName": f"{ir['pipelineInfo']['name']}-"},
            "spec": {"arguments": {"parameters": arguments}, "templates": templates}}


def spec_bytes(docs: list[dict]) -> int:
    """JSON bytes of the Workflow KFP's API server creates for `docs` (the system templates as measured)."""
    name = docs[0]["pipelineInfo"]["name"]
    return len(_json(argo_spec(docs))) + SYSTEM_TEMPLATES_BYTES + 2 * len(name)


# ---- the status nodes of a finished run ----------------------------------------------------------------

def _artifact(schema: str, uri: str, with_metadata: bool) -> dict:
    out = {"type": {"schemaTitle": schema, "schemaVersion": "0.0.1"}, "uri": uri}
    if with_metadata:
        out["name"] = str(int(_hex(uri, 8), 16) % 10**6)
        out["metadata"] = {"where": "/kfp-workspace/" + uri[-60:], "fingerprint": _hex(uri + "fp"),
                           "note": "x" * max(0, METADATA_BYTES.get(schema, 200) - 140)}
    return out


def _uri(pipeline: str, task: str, key: str, item: int) -> str:
    return f"s3://mlpipeline/v2/artifacts/{pipeline}/{_hex(RUN_NAME, 36)}/{task}/{_hex(f'{task}{item}', 36)}/{key}"


def _executor_input(ir: dict, t: kfp_rules.ExecutorTask, item: int) -> dict:
    comp = ir["components"][t.component]
    defs = comp.get("inputDefinitions", {})
    params = {k: (v if v is not None else _hex(f"{t.name}{k}", 36)) for k, v in t.parameters.items()}
    pipeline = ir["pipelineInfo"]["name"]
    arts = {}
    for key, sources in t.inputs.items():
        schema = defs.get("artifacts", {}).get(key, {}).get("artifactType", {}).get("schemaTitle", "system.Artifact")
        arts[key] = {"artifacts": [_artifact(schema, _uri(pipeline, src, out, i), True)
                                   for i, (src, out) in enumerate(sources)]}
    outs = {key: {"artifacts": [_artifact(d.get("artifactType", {}).get("schemaTitle", "system.Artifact"),
                                          _uri(pipeline, t.name, key, item), False)]}
            for key, d in comp.get("outputDefinitions", {}).get("artifacts", {}).items()}
    return {"inputs": {"parameterValues": params, "artifacts": arts},
            "outputs": {"artifacts": outs, "outputFile": "/tmp/kfp_outputs/output_metadata.json"}}


def _pod_spec_patch(ir: dict, t: kfp_rules.ExecutorTask, k8s: dict | None, item: int) -> str:
    """The driver's pod-spec patch: the launcher with --executor_input and --component_spec, then the user
    command and args with {{$}} resolved to the executor input (initPodSpecPatch)."""
    execs = ir["deploymentSpec"]["executors"]
    container = execs[t.executor].get("container", {})
    ei = _json(_executor_input(ir, t, item))
    user = [ei if a == "{{$}}" else a for a in container.get("command", []) + container.get("args", [])]
    launcher = ["/kfp-launcher/launch", "--pipeline_name", ir["pipelineInfo"]["name"], "--run_id", _hex(RUN_NAME, 36),
                "--execution_id", "1234", "--executor_input", ei, "--component_spec", _json(ir["components"][t.component]),
                "--pod_name", "$(KFP_POD_NAME)", "--pod_uid", "$(KFP_POD_UID)", "--ml_pipeline_server_address",
                "ml-pipeline.kubeflow", "--ml_pipeline_server_port", "8887", "--mlmd_server_address",
                "metadata-grpc-service.kubeflow", "--mlmd_server_port", "8080", "--publish_logs", "false", "--"]
    main = {"name": "main", "image": container.get("image", ""), "command": launcher + user,
            "resources": container.get("resources", {}), "platform": k8s or {}}  # the config's env, volumes, placement
    return _json({"containers": [main]})


def _node(name: str, kind: str, template: str, inputs: dict, outputs: dict, pod: bool) -> dict:
    node = {"id": f"{RUN_NAME}-{int(_hex(name, 8), 16)}", "name": f"{RUN_NAME}.{name}", "displayName": name.split(".")[-1],
            "type": kind, "templateName": template, "templateScope": f"local/{RUN_NAME}", "phase": "Succeeded",
            "boundaryID": f"{RUN_NAME}-{int(_hex(name + 'b', 8), 16)}", "startedAt": "2026-11-29T06:00:00Z",
            "finishedAt": "2026-11-29T06:10:00Z", "progress": "1/1", "resourcesDuration": {"cpu": 12, "memory": 96},
            "inputs": {"parameters": [{"name": k, "value": v} for k, v in inputs.items()]},
            "children": [f"{RUN_NAME}-{int(_hex(name + 'c', 8), 16)}"]}
    out = {"parameters": [{"name": k, "value": v} for k, v in outputs.items()]} if outputs else {}
    if pod:
        node.update(hostNodeName="ip-10-0-12-34.ec2.internal", taskResultSynced=True)
        log_key = f"private-artifacts/kubeflow/{RUN_NAME}/2026/11/29/{node['id']}/main.log"
        out.update(exitCode="0", artifacts=[{"name": "main-logs", "s3": {"key": log_key}}])
    if out:
        node["outputs"] = out
    return node


def _loops(ir: dict) -> dict[str, int]:
    """Component name -> how many times its tasks run (the product of the ParallelFor item counts above it)."""
    counts = {"__root__": 1}

    def visit(comp: str, mult: int):
        tasks = (ir["root"] if comp == "__root__" else ir["components"][comp])["dag"]["tasks"]
        for task in tasks.values():
            ref = task["componentRef"]["name"]
            if "dag" not in ir["components"][ref]:
                continue
            items = task.get("parameterIterator", {}).get("items", {})
            n = len(json.loads(items["raw"])) if "raw" in items else 1
            counts[ref] = mult * n
            visit(ref, mult * n)
    visit("__root__", 1)
    return counts


def node_status(docs: list[dict], kfp_version: str) -> dict:
    """The status nodes of the finished run of `docs` on KFP `kfp_version` (a model: see the module doc)."""
    fam = kfp_rules.family(kfp_version)
    retry_all = rules.RETRY_EVERY_TEMPLATE[fam]
    ir = docs[0]
    platform = ((docs[1] if len(docs) > 1 else {}).get("platforms", {}).get("kubernetes", {})
                .get("deploymentSpec", {}).get("executors", {}))
    comps = ir["components"]
    nodes: dict[str, dict] = {}

    def add(name, kind, template, inputs, outputs=None, pod=False, retry=False):
        node = _node(name, kind, template, inputs, outputs or {}, pod)
        nodes[node["id"]] = node
        if retry or retry_all:  # the Retry parent: the inputs again, the last child's outputs
            parent = _node(name + "(retry)", "Retry", template, inputs, outputs or {}, False)
            nodes[parent["id"]] = parent

    def parent_of(task_name: str) -> str:
        for comp, spec in comps.items():
            if "dag" in spec and task_name in spec["dag"]["tasks"]:
                return comp
        return "__root__"

    mult = _loops(ir)
    by_name = {}
    for comp, spec in [("__root__", ir["root"])] + list(comps.items()):
        for key, task in spec.get("dag", {}).get("tasks", {}).items():
            by_name.setdefault(task["taskInfo"]["name"], (comp, key, task))
    for t in kfp_rules.executor_tasks(ir):
        comp, key, task = by_name.get(t.name, ("__root__", t.name, {}))
        k8s = platform.get(t.executor)
        retries = bool(task.get("retryPolicy"))
        for item in range(mult.get(comp, 1)):
            where = f"{comp}.{item}.{key}"
            patch = _pod_spec_patch(ir, t, k8s, item)
            container = ir["deploymentSpec"]["executors"][t.executor].get("container", {})
            add(f"{where}-driver", "Pod", "system-container-driver",
                {"component": _json(comps[t.component]), "task": _json(task), "container": _json(container),
                 "task-name": key, "parent-dag-id": "123", "iteration-index": str(item if comp != "__root__" else -1),
                 "kubernetes-config": _json(k8s) if k8s else ""},
                {"pod-spec-patch": patch, "cached-decision": "false", "condition": "true"}, pod=True)
            add(where, "DAG", "system-container-executor", {"pod-spec-patch": patch, "cached-decision": "false"})
            add(f"{where}.executor", "Pod", "system-container-impl", {"pod-spec-patch": patch}, pod=True, retry=retries)
    for comp, spec in comps.items():  # every DAG: its driver and node, once per loop item (an iterator above)
        if "dag" not in spec:
            continue
        owner = parent_of(comp)
        task = next((t for t in (ir["root"] if owner == "__root__" else comps[owner])["dag"]["tasks"].values()
                     if t["componentRef"]["name"] == comp), {})
        for item in range(mult.get(comp, 1)):
            add(f"{comp}.{item}-driver", "Pod", "system-dag-driver",
                {"component": _json(spec), "task": _json(task), "task-name": comp, "parent-dag-id": "123",
                 "iteration-index": str(item), "runtime-config": "", "driver-type": "DAG"},
                {"execution-id": "456", "iteration-count": "0", "condition": "true"}, pod=True)
            add(f"{comp}.{item}", "DAG", comp, {"parent-dag-id": "456", "condition": "true"})
    root_params = {k: p.get("defaultValue") for k, p in ir["root"].get("inputDefinitions", {}).get("parameters", {}).items()}
    add("root-driver", "Pod", "system-dag-driver",
        {"component": _json(ir["root"]), "runtime-config": _json({"parameterValues": root_params}), "driver-type": "ROOT_DAG"},
        {"execution-id": "1", "iteration-count": "0", "condition": "true"}, pod=True)
    return nodes


# ---- the run's size, its limits, and how many iterations fit ------------------------------------------

@dataclass
class RunSize:
    """The JSON bytes of one run of a compiled spec on one KFP version."""

    kfp: str
    spec: int
    """The Argo Workflow without status: what is created (etcd, the API server's body limit)."""
    nodes: int
    """status.nodes of the finished run, as JSON."""
    compressed: int
    """The same, gzipped and base64-encoded (status.compressedNodes)."""
    component_arg: int
    """The longest DAG spec a DAG driver takes as one `--component` argument."""

    @property
    def stored(self) -> int:
        """What Argo keeps at the end: spec + nodes if that fits MAX_WORKFLOW_SIZE, else spec + compressed nodes."""
        raw = self.spec + self.nodes
        return raw if raw <= rules.MAX_WORKFLOW_SIZE else self.spec + self.compressed


def measure(docs: list[dict], kfp_version: str) -> RunSize:
    """The modelled sizes of a run of the compiled spec `docs` on `kfp_version`."""
    nodes = node_status(docs, kfp_version)
    raw = _json(nodes).encode()
    packed = base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0))
    comps = docs[0]["components"]
    arg = max([len(_json(c)) for c in comps.values() if "dag" in c] + [len(_json(docs[0]["root"]))])
    return RunSize(kfp_version, spec_bytes(docs), len(raw), len(packed), arg)


def limits(kfp_version: str) -> dict[str, tuple[int, str]]:
    """{part: (its limit in bytes, where the limit is written)} for a run on `kfp_version`."""
    fam = kfp_rules.family(kfp_version)
    argo = rules.argo_of(fam)
    return {"spec": (min(rules.ETCD_MAX_REQUEST, rules.MAX_WORKFLOW_SIZE), f"{rules.MAX_WORKFLOW_SIZE_SOURCE[argo]}; "
                     f"{rules.ETCD_MAX_REQUEST_SOURCE}"),
            "stored": (rules.MAX_WORKFLOW_SIZE, f"{rules.MAX_WORKFLOW_SIZE_SOURCE[argo]}, {rules.COMPRESS_SOURCE[argo]}"),
            "component_arg": (rules.MAX_ARG_STRLEN, f"{rules.MAX_ARG_STRLEN_SOURCE}; {rules.DAG_DRIVER_COMPONENT_ARG[fam]}; "
                              f"{rules.ARG_LIMIT_REPORT}")}


#: The two iteration counts a capacity is measured at; the parts a limit applies to.
LOW, HIGH = 2, 4
PARTS = ("spec", "nodes", "stored_compressed", "component_arg")


@dataclass
class Capacity:
    """How many iterations one run holds on one KFP version, from two measured points, LOW and HIGH
    iterations (iteration 0 carries less than a steady one: no critic or optimizer state comes in)."""

    kfp: str
    low: RunSize
    high: RunSize

    def at(self, n: int) -> dict[str, float]:
        """Each limited part's modelled bytes at n iterations (linear in n)."""
        per = self.per_iteration()
        return {part: self._part(self.low, part) + per[part] * (n - LOW) for part in PARTS}

    @staticmethod
    def _part(size: RunSize, part: str) -> float:
        return size.spec + size.compressed if part == "stored_compressed" else getattr(size, part)

    def per_iteration(self) -> dict[str, float]:
        return {p: (self._part(self.high, p) - self._part(self.low, p)) / (HIGH - LOW) for p in PARTS}

    def max_iterations(self, margin: float = MARGIN) -> tuple[int, str]:
        """(the largest n whose every part is within (1 - margin) x its limit, the part that binds)."""
        best, binding = None, ""
        lim = limits(self.kfp)
        for part, key in (("spec", "spec"), ("stored_compressed", "stored"), ("component_arg", "component_arg")):
            a, slope = self._part(self.low, part), self.per_iteration()[part]
            cap = (1 - margin) * lim[key][0]
            n = math.inf if slope <= 0 else LOW + math.floor((cap - a) / slope)
            if best is None or n < best:
                best, binding = n, key
        return (int(best) if best != math.inf else 10**6), binding


def capacity(compile_at, kfp_version: str) -> Capacity:
    """Capacity of a recipe on `kfp_version`; compile_at(n) -> the compiled docs at n iterations."""
    return Capacity(kfp_version, measure(compile_at(LOW), kfp_version), measure(compile_at(HIGH), kfp_version))


def describe(cap: Capacity, iterations: int, margin: float = MARGIN) -> str:
    """One line for `plan`: how many iterations one run holds on this version, and what binds."""
    n, binding = cap.max_iterations(margin)
    at = cap.at(iterations)
    per = cap.per_iteration()
    what = {"spec": "the Workflow's spec", "stored": "spec + compressed node status (Argo's MAX_WORKFLOW_SIZE)",
            "component_arg": "the exit handler's --component argument (Linux's 128 KiB)"}[binding]
    return (f"KFP {cap.kfp} (Argo {rules.argo_of(kfp_rules.family(cap.kfp))}): one run holds at most {n} iterations "
            f"with {margin:.0%} of each limit kept free (binding: {what}); at {iterations}: spec {at['spec'] / 1024:.0f} KiB, "
            f"nodes {at['nodes'] / 1024:.0f} KiB raw / {(at['stored_compressed'] - at['spec']) / 1024:.0f} KiB compressed; "
            f"per iteration {per['spec'] / 1024:.1f} KiB spec, {per['nodes'] / 1024:.0f} KiB nodes")


def too_long(cap: Capacity, iterations: int, margin: float = MARGIN) -> str | None:
    """The refusal for `iterations` on this version, or None when one run holds them."""
    n, binding = cap.max_iterations(margin)
    if iterations <= n:
        return None
    part, (limit, source) = binding, limits(cap.kfp)[binding]
    at = cap.at(iterations)[{"stored": "stored_compressed"}.get(part, part)]
    return (f"pipeline.iterations is {iterations}, but one run on Kubeflow Pipelines {cap.kfp} holds at most {n} "
            f"(modelled {at / 1024:.0f} KiB against a limit of {limit / 1024:.0f} KiB with {margin:.0%} kept free; {source}). "
            f"Set pipeline.iterations to {n} or fewer (--set pipeline.iterations={n}); a longer run would start, "
            f"spend its GPUs and fail when the workflow outgrows the limit.")


def check_package(docs: list[dict], kfp_version: str, margin: float = MARGIN) -> str | None:
    """The refusal for a package compiled before (`submit --package`, or a server of another version), measured
    as it is; None when it fits every limit with `margin` kept free."""
    size = measure(docs, kfp_version)
    lim = limits(kfp_version)
    for part, value in (("spec", size.spec), ("stored", size.spec + size.compressed), ("component_arg", size.component_arg)):
        limit, source = lim[part]
        if value > (1 - margin) * limit:
            return (f"the package would outgrow Kubeflow Pipelines {kfp_version}'s limits: modelled {value / 1024:.0f} KiB "
                    f"({part}) against {limit / 1024:.0f} KiB with {margin:.0%} kept free ({source}). Compile it again "
                    f"with fewer pipeline.iterations (`prmflow pipeline plan` prints how many one run holds).")
    return None
