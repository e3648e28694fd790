"""A fake Kubernetes API server with Kubeflow Trainer's TrainJob API, on loopback.

It answers the calls the `kubeflow` SDK (0.5.0, TrainerClient on the Kubernetes backend) and the
`kubernetes` client make, records every request, and plays the Trainer controller's part: a created
TrainJob reads Created on the first status read, Running (its node pods Running) while its `work`
runs, then Complete, or Failed with the condition reason and message the work returns. `work` is the
test's stand-in for the node pods: a function of the TrainJob body returning None (success) or
(reason, message); it runs in a thread once the job is Running. A DELETE of a TrainJob removes it (as
Kubernetes does, with its JobSet and pods); `trainer_version` is what the Trainer's public ConfigMap
(kubeflow-system/kubeflow-trainer-public, from Trainer v2.2.0) states, None for an older Trainer that has
none; `pod_logs` ({pod: text}) answers the pod log reads of `kubectl logs` / CoreV1Api.

Admission as the emulated Trainer does it: a created TrainJob must pass that version's validating webhook
and the openAPIV3Schema of its CRD (tests/data/trainer/, from the tag) with its list-map keys (no two env vars
of one name) and its CEL rules (an RFC 1035 name of <= 63 characters), all through
prmflow.pipelines.contracts.trainer; a refused one gets the API server's 422 Invalid answer, naming
the rule. `read_faults` are what the next status reads of a running TrainJob meet, in order:
("stall", seconds) answers late, ("status", code) answers that error (e.g. a transient 500).
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import yaml

from prmflow.pipelines.contracts import trainer as trainer_rules

from .fake_http import JsonHandler

DATA = Path(__file__).resolve().parents[1] / "data" / "trainer"


def crd_schema(version: str) -> dict:
    """The TrainJob openAPIV3Schema of Trainer `version` (its own tag where shipped, else its family's)."""
    tag = version if version.startswith("v") else f"v{version}"
    path = DATA / f"trainjob-openapiv3-{tag}.json.gz"
    if not path.is_file():
        path = DATA / f"trainjob-openapiv3-{trainer_rules.TAGS[trainer_rules.family(version)]}.json.gz"
    return json.loads(gzip.decompress(path.read_bytes()))


API = "/apis/trainer.kubeflow.org/v1alpha1"
CREATED_AT = "2026-11-24T01:00:00Z"


def runtime_cr(name: str, framework: str = "torch") -> dict:
    """A ClusterTrainingRuntime as Kubeflow Trainer installs torch-distributed (trimmed)."""
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": framework}},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
                 "template": {"spec": {"replicatedJobs": [{
                     "name": "node", "replicas": 1,
                     "template": {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                  "spec": {"template": {"spec": {"containers": [
                                      {"name": "node", "image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"}]}}}}}]}}},
    }


class FakeK8s:
    def __init__(self, work: Callable[[dict], tuple[str, str] | None] | None = None,
                 runtimes: dict[str, str] | None = None, trainer_version: str | None = "v2.3.0",
                 pod_logs: dict[str, str] | None = None, read_faults: list[tuple[str, float]] | None = None):
        self.requests: list[dict] = []
        self.jobs: dict[str, dict] = {}       # name -> TrainJob as created (with metadata filled in)
        self.phase: dict[str, str] = {}       # name -> Created / Running / Complete / Failed
        self.failure: dict[str, tuple[str, str]] = {}
        self.work = work or (lambda body: None)
        self.runtimes = runtimes or {"torch-distributed": "torch"}
        self.trainer_version = trainer_version
        self.pod_logs = pod_logs or {}
        self.deleted: list[str] = []
        self.read_faults = list(read_faults or [])
        self.refused: list[list[str]] = []  # the admission errors of each refused TrainJob
        self.lock = threading.Lock()
        # set once a pod listing has shown a job's node pods Running: like a real controller, the fake does not
        # finish a job between the status read that says Running and the listing of its pods
        self.pods_seen: dict[str, threading.Event] = {}
        fake = self

        class Handler(JsonHandler):
            def _not_found(self, what: str):
                return self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                         "reason": "NotFound", "code": 404, "message": f"{what} not found"})

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with fake.lock:
                    fake.requests.append({"method": self.command, "path": self.path, "body": body})
                return body

            def do_GET(self):
                self._record()
                path = self.path.split("?")[0]
                if path == "/api/v1/namespaces/kubeflow-system/configmaps/kubeflow-trainer-public":
                    if fake.trainer_version is None:
                        return self._not_found('configmaps "kubeflow-trainer-public"')
                    return self._reply(200, {"kind": "ConfigMap", "apiVersion": "v1",
                                             "metadata": {"name": "kubeflow-trainer-public"},
                                             "data": {"kubeflow_trainer_version": fake.trainer_version}})
                if m := re.fullmatch("/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", path):
                    if m[2] not in fake.pod_logs:
                        return self._not_found(f'pods "{m[2]}"')
                    tail = re.search(r"tailLines=(\d+)", self.path)
                    lines = fake.pod_logs[m[2]].splitlines(keepends=True)
                    data = "".join(lines[-int(tail[1]):] if tail else lines).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return self.wfile.write(data)
                if m := re.fullmatch(f"{API}/clustertrainingruntimes/([^/]+)", path):
                    framework = fake.runtimes.get(m[1])
                    return self._reply(200, runtime_cr(m[1], framework)) if framework else self._not_found(m[1])
                if re.fullmatch(f"{API}/namespaces/[^/]+/trainingruntimes/[^/]+", path):
                    return self._not_found("trainingruntime")  # only cluster-scoped runtimes here
                if m := re.fullmatch(f"{API}/namespaces/([^/]+)/trainjobs/([^/]+)", path):
                    fault = fake.fault(m[2])
                    if fault and fault[0] == "stall":
                        time.sleep(fault[1])
                    elif fault and fault[0] == "status":
                        return self._reply(int(fault[1]), {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                           "message": "etcdserver: request timed out", "code": int(fault[1])})
                    return self._reply(200, fake.read(m[2])) if m[2] in fake.jobs else self._not_found(m[2])
                if m := re.fullmatch("/api/v1/namespaces/([^/]+)/pods", path):
                    return self._reply(200, fake.pods(self.path))
                return self._not_found(f"fake k8s: GET {path}")

            def do_POST(self):
                body = self._record() or {}
                path = self.path.split("?")[0]
                if m := re.fullmatch(f"{API}/namespaces/([^/]+)/trainjobs", path):
                    name = body["metadata"]["name"]
                    if name in fake.jobs:
                        return self._reply(409, {"kind": "Status", "reason": "AlreadyExists", "code": 409})
                    errors = fake.admission_errors(body)
                    if errors:
                        fake.refused.append(errors)
                        return self._reply(422, {
                            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422,
                            "message": f'admission webhook "validate.trainjob.trainer.kubeflow.org" denied the request: '
                                       f'TrainJob.trainer.kubeflow.org "{name}" is invalid: ' + "; ".join(errors)})
                    body["metadata"].update(namespace=m[1], creationTimestamp=CREATED_AT, uid=f"uid-{name}")
                    with fake.lock:
                        fake.jobs[name], fake.phase[name] = body, "Submitted"
                    return self._reply(201, body)
                return self._not_found(f"fake k8s: POST {path}")

            def do_DELETE(self):
                self._record()
                path = self.path.split("?")[0]
                if m := re.fullmatch(f"{API}/namespaces/([^/]+)/trainjobs/([^/]+)", path):
                    with fake.lock:
                        if m[2] not in fake.jobs:
                            return self._not_found(m[2])
                        fake.jobs.pop(m[2])
                        fake.phase[m[2]] = "Deleted"
                        fake.deleted.append(m[2])
                    return self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                return self._not_found(f"fake k8s: DELETE {path}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # --- the API server's and webhook's part ---------------------------------------------------------
    def admission_errors(self, body: dict) -> list[str]:
        """Why the emulated Trainer refuses this TrainJob: its CRD schema, then its validating webhook."""
        version = self.trainer_version or "v2.2.0"
        errors = trainer_rules.schema_errors(body, crd_schema(version))
        ref = (body.get("spec") or {}).get("runtimeRef") or {}
        framework = self.runtimes.get(ref.get("name"))
        if framework is None:
            return errors + [f"spec.runtimeRef: runtime {ref.get('name')!r} not found"]
        return errors + trainer_rules.webhook_errors(body, runtime_cr(ref["name"], framework), version)

    def fault(self, name: str) -> tuple[str, float] | None:
        """The next injected fault of a status read of TrainJob `name` (once created, until it ends)."""
        with self.lock:
            if self.read_faults and self.phase.get(name) in ("Created", "Running"):
                return self.read_faults.pop(0)
        return None

    # --- the controller's part -------------------------------------------------------------------
    def read(self, name: str) -> dict:
        """The TrainJob as a status read sees it, advancing Submitted -> Created -> Running."""
        with self.lock:
            phase = self.phase[name]
            if phase == "Submitted":
                self.phase[name] = "Created"
            elif phase == "Created":
                self.phase[name] = "Running"
                self.pods_seen.setdefault(name, threading.Event())
                threading.Thread(target=self._run, args=(name,), daemon=True).start()
            job = json.loads(json.dumps(self.jobs[name]))
            phase = self.phase[name]
        conditions = []
        if phase == "Complete":
            conditions = [{"type": trainer_rules.COMPLETE, "status": "True", "reason": "JobsCompleted",
                           "message": "jobset completed",
                           "lastTransitionTime": CREATED_AT}]
        elif phase == "Failed":
            reason, message = self.failure[name]
            conditions = [{"type": trainer_rules.FAILED, "status": "True", "reason": reason, "message": message,
                           "lastTransitionTime": CREATED_AT}]
        job["status"] = {"conditions": conditions} if conditions else {}
        return job

    def _run(self, name: str) -> None:
        try:
            failed = self.work(self.jobs[name])
        except Exception as e:  # noqa: BLE001 - a crash of the simulated pods is a failed job
            failed = ("Error", repr(e))
        self.pods_seen[name].wait(timeout=10)
        with self.lock:
            if self.phase.get(name) == "Deleted":  # deleted while it ran: its pods are gone, nothing finishes
                return
            if failed:
                self.failure[name] = failed
            self.phase[name] = "Failed" if failed else "Complete"

    def pods(self, raw_path: str) -> dict:
        """Node pods of the job named in the label selector: one per node, Running while it runs."""
        m = re.search(r"jobset-name%3D([a-z0-9-]+)", raw_path) or re.search(r"jobset-name=([a-z0-9-]+)", raw_path)
        items = []
        if m and self.phase.get(m[1]) == "Running":
            nodes = (self.jobs[m[1]]["spec"].get("trainer") or {}).get("numNodes", 1)
            items = [{"metadata": {"name": f"{m[1]}-node-0-{i}", "namespace": "default", "creationTimestamp": CREATED_AT,
                                   "labels": {"jobset.sigs.k8s.io/jobset-name": m[1],
                                              "jobset.sigs.k8s.io/replicatedjob-name": "node",
                                              "batch.kubernetes.io/job-completion-index": str(i)}},
                      "spec": {"containers": [{"name": "node", "image": "x"}]},
                      "status": {"phase": "Running"}} for i in range(nodes)]
            self.pods_seen[m[1]].set()
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}

    def posted(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["method"] == "POST"]

    def kubeconfig(self, path: Path, namespace: str = "ml-team") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}]}))
        return path

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
