"""Reaching a KFP API server the way Kubeflow users do: `kfp.Client` with the credentials they have,
errors that say which credential to use, and a run watched to its end.

The credential paths (all are kfp.Client's own; prmflow only chooses between them):

    --token TOKEN (or $PRMFLOW_KFP_TOKEN)   existing_token: a bearer token, e.g. a service-account token
                                            `kubectl -n NS create token default-editor --audience=pipelines.kubeflow.org`
    --cookie NAME=VALUE ($PRMFLOW_KFP_COOKIE) cookies: multi-user Kubeflow behind Dex / oauth2-proxy, the session
                                            cookie of a browser login (authservice_session=..., oauth2_proxy_kubeflow=...)
    --sa-token [FILE]                       credentials=ServiceAccountTokenVolumeCredentials: the projected pipelines
                                            token of a pod (default $KF_PIPELINES_SA_TOKEN_PATH or
                                            /var/run/secrets/kubeflow/pipelines/token), re-read before each request
    no --host, inside a pod                 kfp's in-cluster default: ml-pipeline.<kfp namespace>.svc.cluster.local:8888
                                            with that same projected token (a Kubeflow notebook with the
                                            `access-ml-pipeline` PodDefault)
    --host only                             no credentials: a single-user KFP or a port-forward

`--namespace` is the user's profile namespace on a multi-user Kubeflow (where the experiment, the run
and an uploaded pipeline live); leave it out on a single-user install.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import ConfigError, PrmflowError
from .contracts import kfp_client as kfp_client_rules

TOKEN_ENV, COOKIE_ENV = "PRMFLOW_KFP_TOKEN", "PRMFLOW_KFP_COOKIE"
#: Run states after which a run changes no more (kfp_server_api.V2beta1RuntimeState).
FINAL_STATES = ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED")


class KfpAuthError(PrmflowError):
    """The KFP API server refused the request's identity (401) or what it may do (403)."""


class KfpError(PrmflowError):
    """The KFP API server could not be reached, or answered an error that is not about authentication."""


@dataclass
class Connection:
    """Where the KFP API is and who we are to it (the command line's --host/--token/--cookie/...)."""

    host: str = ""
    """KFP API endpoint (default: $KF_PIPELINES_ENDPOINT; none inside a pod: the in-cluster service)."""
    token: str = ""
    """Bearer token (kfp.Client existing_token)."""
    cookie: str = ""
    """Session cookie NAME=VALUE of a multi-user Kubeflow login (kfp.Client cookies)."""
    sa_token: str | None = None
    """Projected service-account token file ('' = kfp's default path); None: not used."""
    namespace: str = ""
    """The user's profile namespace (multi-user Kubeflow); empty on a single-user install."""
    kfp_namespace: str = "kubeflow"
    """Namespace of the KFP deployment itself (the in-cluster service name is ml-pipeline.<this>)."""
    ui_host: str = ""
    """Base URL of the KFP UI for run links (default: the host)."""

    @classmethod
    def from_args(cls, args) -> "Connection":
        return cls(host=args.host or os.environ.get("KF_PIPELINES_ENDPOINT", ""),
                   token=args.token or os.environ.get(TOKEN_ENV, ""),
                   cookie=args.cookie or os.environ.get(COOKIE_ENV, ""), sa_token=args.sa_token,
                   namespace=args.namespace or "", kfp_namespace=args.kfp_namespace, ui_host=args.ui_host or "")

    def how(self) -> str:
        """The credential this connection sends, in words (for errors)."""
        if self.token:
            return "a bearer token (--token / $" + TOKEN_ENV + ")"
        if self.cookie:
            return f"the session cookie {self.cookie.split('=', 1)[0]} (--cookie / ${COOKIE_ENV})"
        if self.sa_token is not None:
            return f"the service-account token in {self.sa_token or _default_sa_token_path()} (--sa-token)"
        if not self.host and in_cluster():
            return "the pod's projected pipelines token (kfp's in-cluster default)"
        return "no credentials"

    def where(self) -> str:
        return self.host or (f"ml-pipeline.{self.kfp_namespace}.svc.cluster.local:8888" if in_cluster() else "(no host)")


def add_arguments(parser) -> None:
    """The connection options of `pipeline submit` / `pipeline upload`."""
    g = parser.add_argument_group("connection (see docs/submitting.md)")
    g.add_argument("--host", default="", help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline "
                   "(default: $KF_PIPELINES_ENDPOINT; inside a pod leave it out: the in-cluster service)")
    g.add_argument("--token", default="", help=f"bearer token (default: ${TOKEN_ENV})")
    g.add_argument("--cookie", default="", metavar="NAME=VALUE",
                   help=f"session cookie of a multi-user Kubeflow login, e.g. authservice_session=... (default: ${COOKIE_ENV})")
    g.add_argument("--sa-token", nargs="?", const="", default=None, metavar="FILE",
                   help="send a projected service-account token file (default file: $KF_PIPELINES_SA_TOKEN_PATH or "
                        "/var/run/secrets/kubeflow/pipelines/token)")
    g.add_argument("--namespace", default="", help="your profile namespace on a multi-user Kubeflow")
    g.add_argument("--kfp-namespace", default="kubeflow",
                   help="namespace of the KFP deployment (in-cluster service name; default: kubeflow)")
    g.add_argument("--ui-host", default="", help="base URL of the KFP UI for the run link (default: the host)")


def in_cluster() -> bool:
    """True inside a Kubernetes pod (the service env vars every pod gets)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def _default_sa_token_path() -> str:
    from kfp import client as kfp_client

    return os.environ.get(kfp_client.KF_PIPELINES_SA_TOKEN_ENV) or kfp_client.KF_PIPELINES_SA_TOKEN_PATH


def hint(conn: Connection, status: int) -> str:
    """What to do after a 401 (who are you?) or a 403 (you may not)."""
    if status == 403:
        ns = conn.namespace or "(none given)"
        return ("The identity was accepted but may not do this in namespace " + ns + ". On a multi-user Kubeflow, "
                "pass --namespace YOUR_PROFILE_NAMESPACE, and make sure the user or service account is an owner or "
                "contributor of that profile (a service account token: one of the profile's, e.g. default-editor).")
    return ("Authenticate with one of:\n"
            f"  --token TOKEN (or ${TOKEN_ENV}): a bearer token, e.g. "
            "`kubectl -n YOUR_NAMESPACE create token default-editor --audience=pipelines.kubeflow.org`\n"
            f"  --cookie NAME=VALUE (or ${COOKIE_ENV}): on a multi-user Kubeflow (Dex / oauth2-proxy), the session "
            "cookie of your browser login (authservice_session=... or oauth2_proxy_kubeflow=...), with --namespace\n"
            "  --sa-token [FILE]: inside a pod with the projected pipelines token (PodDefault access-ml-pipeline)\n"
            "  inside the cluster: leave out --host; kfp then uses the in-cluster service and the pod's token")


@contextlib.contextmanager
def api_errors(conn: Connection, doing: str) -> Iterator[None]:
    """Turn kfp_server_api / urllib3 failures while `doing` into errors that say what to do."""
    import kfp_server_api
    import urllib3

    try:
        yield
    except kfp_server_api.ApiException as e:
        status, reason = e.status, e.reason
        body = (e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or "")).strip()
        if status in (401, 403):
            raise KfpAuthError(f"KFP at {conn.where()} refused {doing}: {status} {reason} ({body[:300]}); "
                               f"sent {conn.how()}.\n{hint(conn, status)}") from None
        if status == 0:  # kfp_server_api wraps connection errors this way on some paths
            raise KfpError(f"Cannot reach KFP at {conn.where()} while {doing}: {reason}. Check --host.") from None
        raise KfpError(f"KFP at {conn.where()} failed {doing}: {status} {reason} {body[:500]}") from None
    except urllib3.exceptions.HTTPError as e:
        raise KfpError(f"Cannot reach KFP at {conn.where()} while {doing}: {e}. Check --host "
                       "(and, inside the cluster, --kfp-namespace).") from None


def require_id(conn: Connection, value: str | None, what: str) -> str:
    """`value` (an id the API returned); KfpError when it is missing: the answer was not the KFP API's (a
    Dex / oauth2-proxy login page that an unauthenticated request was redirected to, or a wrong --host)."""
    if not value:
        raise KfpAuthError(f"KFP at {conn.where()} answered {what} without an id: that was not the KFP API "
                           f"(a multi-user Kubeflow redirects a request without a session to its login page), "
                           f"or --host is wrong; sent {conn.how()}.\n{hint(conn, 401)}")
    return value


def connect(conn: Connection):
    """A kfp.Client for `conn`: its credential, and the user's namespace on every call that takes one."""
    import kfp
    from kfp.client import set_volume_credentials

    if not conn.host and not in_cluster() and not _kubeconfig_exists():
        raise ConfigError("No KFP endpoint: pass --host https://KUBEFLOW/pipeline (or set $KF_PIPELINES_ENDPOINT); "
                          "only inside a pod can it be left out.")
    if conn.cookie and "=" not in conn.cookie:
        raise ConfigError(f"--cookie {conn.cookie[:20]!r}...: expected NAME=VALUE, e.g. authservice_session=<value>.")
    if sum(map(bool, (conn.token, conn.cookie, conn.sa_token is not None))) > 1:
        raise ConfigError("Use one credential: --token, --cookie or --sa-token.")
    credentials = None
    if conn.sa_token is not None:
        path = conn.sa_token or _default_sa_token_path()
        if not os.path.isfile(path):
            raise ConfigError(f"--sa-token: no token file at {path}. Mount the projected pipelines token "
                              "(Kubeflow PodDefault 'access-ml-pipeline') or name the file.")
        credentials = set_volume_credentials.ServiceAccountTokenVolumeCredentials(path=path)
    host = conn.host
    if not host and in_cluster():
        # kfp finds the in-cluster service only when given no token and no credentials, and then sends the
        # default projected token whatever --sa-token named (contracts/kfp_client.py): name the service here
        host = kfp_client_rules.in_cluster_url(conn.kfp_namespace)
        if credentials is None and not conn.token and not conn.cookie and os.path.isfile(_default_sa_token_path()):
            credentials = set_volume_credentials.ServiceAccountTokenVolumeCredentials()
    # kfp.Client's `namespace` names the KFP deployment for its own in-cluster and kube-proxy addresses, and any
    # value but 'kubeflow' becomes the user's namespace (kfp_client_rules.NAMESPACE_BECOMES_USERS): with a host,
    # pass only the user's own namespace
    namespace = (conn.namespace or "kubeflow") if host else conn.kfp_namespace
    with warnings.catch_warnings(), api_errors(conn, "the health check"):
        warnings.filterwarnings("ignore", message="This client only works with Kubeflow Pipeline")
        try:
            client = kfp.Client(host=host or None, namespace=namespace, existing_token=conn.token or None,
                                cookies=conn.cookie or None, credentials=credentials, ui_host=conn.ui_host or None)
            if not host and not conn.namespace and namespace != "kubeflow":  # kube-proxy: the KFP namespace, not ours
                client._context_setting["namespace"] = ""
            # kfp found no namespace (none given, not a pod): a multi-user KFP would refuse every call for want of one
            if not conn.namespace and not client.get_user_namespace() and client.get_kfp_healthz().multi_user:
                raise ConfigError(f"KFP at {conn.where()} is a multi-user install: pass --namespace "
                                  "YOUR_PROFILE_NAMESPACE (where your runs and experiments live).")
        except TimeoutError as e:  # kfp's healthz probe gave up (5 tries)
            raise KfpError(f"KFP at {conn.where()} did not answer its health check ({e}); sent {conn.how()}.\n"
                           + hint(conn, 401)) from None
    return client


def _kubeconfig_exists() -> bool:
    return any(os.path.isfile(p) for p in (os.environ.get("KUBECONFIG", "").split(os.pathsep)
                                           + [os.path.expanduser("~/.kube/config")]) if p)


def server_version(kfp_client, conn: Connection) -> str:
    """The KFP API server's version (healthz's tag_name, e.g. '2.16.1'), or '' where it does not say
    (TAG_NAME unset: 'unknown'). kfp_server_api's healthz model drops tag_name, so the answer is read raw
    (kubeflow/pipelines backend/src/apiserver/main.go, the /apis/v2beta1/healthz handler)."""
    import json

    with api_errors(conn, "the health check"):
        answer = kfp_client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    try:
        tag = json.loads(answer.data).get("tag_name") or ""
    except (ValueError, AttributeError):
        return ""
    return "" if tag == "unknown" else tag.lstrip("v")


def run_url(conn: Connection, run_id: str) -> str:
    """The KFP UI page of a run."""
    base = (conn.ui_host or conn.host).rstrip("/")
    return f"{base}/#/runs/details/{run_id}" if base else f"/pipeline/#/runs/details/{run_id}"


def _state(value: Any) -> str:
    return str(value or "RUNTIME_STATE_UNSPECIFIED").upper()


def task_lines(run) -> list[tuple[str, str, str, str]]:
    """(task name, state, pod, error message) of the run's tasks that ran a pod, in start order."""
    details = getattr(run, "run_details", None)
    tasks = list(getattr(details, "task_details", None) or [])
    tasks.sort(key=lambda t: (t.start_time or t.create_time or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)))
    out = []
    for t in tasks:
        pods = [c.pod_name for c in (t.child_tasks or []) if getattr(c, "pod_name", None)]
        pod = t.pod_name or (pods[-1] if pods else "")
        message = getattr(t.error, "message", "") if t.error else ""
        out.append((t.display_name or t.task_id or "?", _state(t.state), pod, message or ""))
    return out


def wait(client, conn: Connection, run_id: str, timeout_s: float, poll_s: float,
         log=lambda line: print(line, flush=True), clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep):
    """Poll run `run_id` until it reaches a final state, logging a line whenever its state or its running
    tasks change. Returns the run (kfp_server_api.V2beta1Run); KfpError after timeout_s."""
    start, last = clock(), None
    while True:
        with api_errors(conn, f"reading run {run_id}"):
            run = client.get_run(run_id)
        state = _state(run.state)
        running = [name for name, st, _, _ in task_lines(run) if st == "RUNNING"]
        line = f"run {run_id}: {state}" + (f" (running: {', '.join(running)})" if running else "")
        if line != last:
            log(f"{time.strftime('%H:%M:%S')} {line}")
            last = line
        if state in FINAL_STATES:
            return run
        if clock() - start > timeout_s:
            raise KfpError(f"run {run_id} is still {state} after --timeout {timeout_s:.0f} s; it keeps running: "
                           f"{run_url(conn, run_id)}")
        sleep(poll_s)


def pod_log_tail(pod: str, namespace: str, lines: int) -> str | None:
    """The last `lines` lines of the step container of `pod`, read with the local Kubernetes credentials
    (kubeconfig or the pod's service account); None when they cannot read it."""
    from kubernetes import client as kube_client
    from kubernetes import config as kube_config

    try:
        if in_cluster() and not os.environ.get("KUBECONFIG"):
            kube_config.load_incluster_config()
        else:
            kube_config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        api = kube_client.CoreV1Api()
        return api.read_namespaced_pod_log(pod, namespace, container="main", tail_lines=lines, _request_timeout=30)
    except Exception as e:  # noqa: BLE001 - no kubeconfig, no RBAC for pods/log, pod gone: say how to get it
        print(f"(could not read the log of pod {pod}: {str(e).splitlines()[0][:200]})", file=sys.stderr)
        return None


def failure_report(run, conn: Connection, log_lines: int = 40, read_log=pod_log_tail) -> str:
    """The failed tasks of a finished run: name, error, and the tail of its pod's log (or how to read it)."""
    namespace = conn.namespace or conn.kfp_namespace
    failed = [t for t in task_lines(run) if t[1] in ("FAILED", "CANCELED")]
    parts = [f"run {run.run_id} {_state(run.state)}: {run_url(conn, run.run_id)}"]
    if getattr(run, "error", None) is not None and getattr(run.error, "message", ""):
        parts.append(f"  error: {run.error.message}")
    for name, state, pod, message in failed:
        parts.append(f"  task {name} {state}" + (f": {message}" if message else "") + (f" (pod {pod})" if pod else ""))
        if pod:
            tail = read_log(pod, namespace, log_lines)
            if tail is None:
                parts.append(f"    log: kubectl -n {namespace} logs {pod} -c main --tail {log_lines}")
            else:
                parts.append(f"    last {log_lines} log lines:")
                parts.extend("    | " + line for line in tail.rstrip("\n").splitlines()[-log_lines:])
    if not failed:
        parts.append("  (the backend reported no failed task; see the run page)")
    return "\n".join(parts)
