"""A faithful-enough fake of the KFP v2beta1 API server: an HTTP server on loopback that records every
request (method, path, headers, body) and answers the calls `kfp.Client` (2.17) makes for experiments,
runs, pipelines and pipeline uploads.

Authentication as a multi-user Kubeflow answers it: with `tokens` / `cookies` / `namespaces` set, a
request without an accepted bearer token or session cookie gets 401 (the API server's "no user identity"
answer behind the Istio gateway), and one for a namespace the identity may not use gets 403 (KFP's
SubjectAccessReview refusal). Error bodies have grpc-gateway's shape: {error, code, message, details}.
With `login_page`, a request without identity is redirected (302) to an HTML login page instead, as Dex
or oauth2-proxy in front of a multi-user Kubeflow answer a client without a session.

Run creation applies the Argo compiler's workspace-claim rule of the emulated KFP `version`
(prmflow.pipelines.contracts.kfp): a run whose per-run workspace that version refuses gets the API
server's 400 with the compiler's message. `tag_name` is what healthz states (default: the version;
"unknown" as a server without TAG_NAME answers).

A created run plays the backend's part: each GET of it advances through `run_states` (default PENDING,
RUNNING, SUCCEEDED); `run_details` (task details, as the backend reports them) is returned with it.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prmflow.pipelines.contracts import kfp as kfp_rules

from .fake_http import JsonHandler

API = "/apis/v2beta1"


class FakeKfp:
    def __init__(self, tokens: dict[str, str] | None = None, cookies: dict[str, str] | None = None,
                 run_states: list[str] | None = None, run_details: dict | None = None, login_page: bool = False,
                 version: str = "2.15.0", tag_name: str | None = None):
        """tokens/cookies: {credential: identity}; None for both: no authentication (single-user KFP).
        An identity may use the namespaces in `namespaces` (identity -> set), default: all."""
        self.requests: list[dict] = []
        self.experiments: list[dict] = []
        self.pipelines: list[dict] = []
        self.versions: list[dict] = []
        self.runs: dict[str, dict] = {}
        self.tokens, self.cookies = tokens, cookies
        self.namespaces: dict[str, set[str]] = {}
        self.run_states = run_states or ["PENDING", "RUNNING", "SUCCEEDED"]
        self.run_details = run_details or {}
        self.login_page = login_page  # Dex / oauth2-proxy in front: no identity -> 302 to an HTML login page
        self.version = version  # the KFP release emulated at run creation
        self.tag_name = version if tag_name is None else tag_name  # what healthz states
        self.lock = threading.Lock()
        fake = self

        class Handler(JsonHandler):
            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = self.headers.get("Content-Type", "")
                if ctype.startswith("multipart/form-data"):
                    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                        f"Content-Type: {ctype}\r\n\r\n".encode() + raw)
                    body = {part.get_param("name", header="content-disposition"):
                            (part.get_filename(), part.get_payload(decode=True).decode()) for part in msg.iter_parts()}
                else:
                    try:
                        body = json.loads(raw) if raw else None
                    except json.JSONDecodeError:
                        body = raw.decode(errors="replace")
                url = urlsplit(self.path)
                with fake.lock:
                    fake.requests.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                          "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                return url.path, parse_qs(url.query), body

            def _error(self, status: int, message: str, code: int):
                return self._reply(status, {"error": message, "code": code, "message": message, "details": []})

            def _identity(self, namespace: str | None):
                """None when the request may go on, else the error reply already sent."""
                if fake.tokens is None and fake.cookies is None:
                    return None
                auth = self.headers.get("Authorization", "")
                who = (fake.tokens or {}).get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
                for part in filter(None, (c.strip() for c in self.headers.get("Cookie", "").split(";"))):
                    who = who or (fake.cookies or {}).get(part)
                if who is None and fake.login_page:
                    self.send_response(302)
                    self.send_header("Location", "/dex/auth?client_id=kubeflow-oidc-authservice&response_type=code")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return True
                if who is None:
                    return self._error(401, "Request header error: there is no user identity header.", 16)
                allowed = fake.namespaces.get(who)
                if namespace and allowed is not None and namespace not in allowed:
                    return self._error(403, f"Failed to authorize with API: PermissionDenied: User '{who}' is not "
                                            f"authorized with reason:  (request: &ResourceAttributes{{Namespace:"
                                            f"{namespace},Verb:list,Group:pipelines.kubeflow.org,Resource:experiments}})", 7)
                return None

            def _who(self):
                auth = self.headers.get("Authorization", "")
                return (fake.tokens or {}).get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None

            def _login_html(self):
                data = b"<!DOCTYPE html><html><head><title>Log in to Kubeflow</title></head><body>...</body></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path, query, _ = self._record()
                if path == "/dex/auth":
                    return self._login_html()
                namespace = (query.get("namespace") or [None])[0]
                if self._identity(namespace) is not None:
                    return
                if path == f"{API}/healthz":
                    return self._reply(200, {"commit_sha": "unknown", "tag_name": fake.tag_name, "pipeline_store": "database",
                                             "multi_user": fake.tokens is not None or fake.cookies is not None})
                if path == f"{API}/experiments":
                    return self._reply(200, fake.listed(fake.experiments, query))
                if path.startswith(f"{API}/experiments/"):
                    return self._reply(200, fake.experiments[0] if fake.experiments else {})
                if path == f"{API}/pipelines":
                    return self._reply(200, fake.listed(fake.pipelines, query, key="pipelines"))
                if path.startswith(f"{API}/pipelines/") and path.endswith("/versions"):
                    pid = path.split("/")[-2]
                    return self._reply(200, fake.listed([v for v in fake.versions if v["pipeline_id"] == pid], query,
                                                        key="pipeline_versions"))
                if path.startswith(f"{API}/runs/"):
                    run_id = path.rsplit("/", 1)[1]
                    if run_id not in fake.runs:
                        return self._error(404, f"Run {run_id} not found", 5)
                    return self._reply(200, fake.advance(run_id))
                return self._error(404, f"fake KFP: no GET {path}", 5)

            def do_POST(self):
                path, query, body = self._record()
                if path == "/dex/auth":  # urllib3 follows a 302 with the same method
                    return self._login_html()
                body = body or {}
                namespace = body.get("namespace") if isinstance(body, dict) else None
                if self._identity(namespace) is not None:
                    return
                if path == f"{API}/experiments":
                    exp = {"experiment_id": f"exp-{len(fake.experiments) + 1}", "display_name": body.get("display_name"),
                           "namespace": body.get("namespace")}
                    fake.experiments.append(exp)
                    return self._reply(200, exp)
                if path == f"{API}/runs":
                    status, message = fake.run_refusal(body, self._who())
                    if status:
                        return self._error(status, message, {400: 3, 403: 7, 404: 5}[status])
                    refused = fake.compiler_errors(body)
                    if refused:
                        return self._error(400, "Failed to create a run: failed to compile the workflow: "
                                                + "; ".join(refused), 3)
                    run_id = f"run-{42 + len(fake.runs)}"
                    fake.runs[run_id] = {**body, "run_id": run_id, "state": "PENDING"}
                    return self._reply(200, fake.runs[run_id])
                if path == f"{API}/pipelines/upload":
                    name = query["name"][0] if "name" in query else body.get("uploadfile", ("", ""))[0]
                    if any(p["display_name"] == name for p in fake.pipelines):
                        return self._error(409, f"Failed to create a pipeline: pipeline {name} already exists", 6)
                    pipeline = {"pipeline_id": f"pipe-{len(fake.pipelines) + 1}", "display_name": name,
                                "namespace": (query.get("namespace") or [""])[0]}
                    fake.pipelines.append(pipeline)
                    fake.versions.append({"pipeline_id": pipeline["pipeline_id"], "display_name": name,
                                          "pipeline_version_id": f"ver-{len(fake.versions) + 1}"})
                    return self._reply(200, pipeline)
                if path == f"{API}/pipelines/upload_version":
                    pid, name = query["pipelineid"][0], query["name"][0]
                    if any(v["pipeline_id"] == pid and v["display_name"] == name for v in fake.versions):
                        return self._error(409, f"Failed to create a pipeline version: version {name} already exists", 6)
                    version = {"pipeline_id": pid, "display_name": name,
                               "pipeline_version_id": f"ver-{len(fake.versions) + 1}"}
                    fake.versions.append(version)
                    return self._reply(200, version)
                return self._error(404, f"fake KFP: no POST {path}", 5)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def run_refusal(self, body: dict, who: str | None) -> tuple[int, str]:
        """(status, message) of the API server's refusal of a run, or (0, ''): the run's namespace is its
        experiment's (kubeflow/pipelines@2.15.0 backend/src/apiserver/server/run_server.go:142-150), the identity
        must be allowed to create runs there (run_server.go:152-157, a SubjectAccessReview), and a
        pipeline_version_reference must name a version of that pipeline (backend/src/apiserver/resource/
        resource_manager.go:1056-1064)."""
        exp = next((e for e in self.experiments if e["experiment_id"] == body.get("experiment_id")), None)
        namespace = (exp or {}).get("namespace") or body.get("namespace")
        allowed = self.namespaces.get(who) if who else None
        if namespace and allowed is not None and namespace not in allowed:
            return 403, (f"Failed to create a run due to authorization error. Check if you have write permissions to "
                         f"namespace {namespace}")
        ref = body.get("pipeline_version_reference") or {}
        if ref.get("pipeline_version_id"):
            version = next((v for v in self.versions if v["pipeline_version_id"] == ref["pipeline_version_id"]), None)
            if version is None:
                return 404, (f"Failed to fetch a pipeline version and its manifest from pipeline version "
                             f"{ref['pipeline_version_id']}: Failed to get a pipeline version with id "
                             f"{ref['pipeline_version_id']}")
            if ref.get("pipeline_id") and version["pipeline_id"] != ref["pipeline_id"]:
                return 400, (f"Pipeline version {ref['pipeline_version_id']} belongs to pipeline "
                             f"{version['pipeline_id']} (not {ref['pipeline_id']})")
        return 0, ""

    def compiler_errors(self, body: dict) -> list[str]:
        """What the emulated version's compiler refuses in a run's platform spec (the workspace claim)."""
        platform = ((body.get("pipeline_spec") or {}).get("platform_spec") or {}).get("platforms", {})
        workspace = (platform.get("kubernetes", {}).get("pipelineConfig") or {}).get("workspace")
        if workspace is None:
            return []
        patch = (workspace.get("kubernetes") or {}).get("pvcSpecPatch") or {}
        return kfp_rules.workspace_pvc_errors(patch, self.version)

    def listed(self, items: list[dict], query: dict, key: str = "experiments") -> dict:
        """The items the query's filter (display_name EQUALS) and namespace select."""
        found = list(items)
        if "filter" in query:
            for pred in json.loads(query["filter"][0]).get("predicates", []):
                found = [i for i in found if i.get(pred["key"]) == pred.get("stringValue", pred.get("string_value"))]
        if "namespace" in query:
            found = [i for i in found if (i.get("namespace") or "") == query["namespace"][0]]
        return {key: found, "total_size": len(found)} if found else {"total_size": 0}

    def advance(self, run_id: str) -> dict:
        with self.lock:
            run = self.runs[run_id]
            seen = run.setdefault("_reads", 0)
            run["_reads"] = seen + 1
            state = self.run_states[min(seen, len(self.run_states) - 1)]
            out = {k: v for k, v in run.items() if k != "_reads"}
        out["state"] = state
        if state in ("FAILED", "SUCCEEDED"):
            out["run_details"] = self.run_details
            if state == "FAILED":
                out["error"] = {"code": 2, "message": "pipeline run failed"}
        return out

    def sent(self, method: str | None = None) -> list[dict]:
        return [r for r in self.requests if method is None or r["method"] == method]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
