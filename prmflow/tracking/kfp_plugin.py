"""Kubeflow Pipelines 2.17's MLflow plugin: what it tells a task's container, and where prmflow's runs go then.

Read from kubeflow/pipelines at 2.17.0 (SOURCES below; each rule beside its line). With `plugins.mlflow` in
the API server's config, every run gets, before it starts, an MLflow experiment (`KFP-Default` unless the
run or the admin names one) and a run for the pipeline run; the driver makes a nested run per task (tag
mlflow.parentRunId) on the same server. What the task's container sees:

- always: KFP_MLFLOW_CONFIG, the plugin's runtime config as JSON (endpoint, experimentId, parentRunId,
  authType, workspace, injectUserEnvVars, ...), on every launcher-role container (the task's own), and
  for authType basic-auth / bearer the credentials as secret references to `kfp-mlflow-credentials`;
- only with `plugins.mlflow.settings.injectUserEnvVars: true` (default off): MLFLOW_RUN_ID (the task's
  nested run), MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID, MLFLOW_WORKSPACE (workspaces on), and
  MLFLOW_TRACKING_AUTH=kubernetes / kubernetes-namespaced for authType kubernetes (the default), with
  which MLflow's client sends the pod's service-account token and ignores MLFLOW_TRACKING_USERNAME /
  PASSWORD (mlflow 3.17 utils/rest_utils.py:258-260).

prmflow reads KFP_MLFLOW_CONFIG (`runtime_config`) and, when it logs to the same server (`target`), files
its runs in KFP's tree: the pipeline's parent run is KFP's run of the pipeline; a stage logs into its
task's run where KFP names it (MLFLOW_RUN_ID), else makes its run under KFP's parent in KFP's experiment.
Logging to another server, it drops the auth KFP set for KFP's server (`drop_kfp_auth`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

REPO, TAG = "kubeflow/pipelines", "2.17.0"
SOURCES = {
    # apiserver: the runtime config and the credentials on the driver and launcher containers
    "runtime_config": "backend/src/apiserver/plugins/mlflow/handler.go:106-126 (KFP_MLFLOW_CONFIG)",
    "credentials": "backend/src/apiserver/plugins/mlflow/handler.go:127-137, common/plugins/mlflow/config.go:99-124",
    "launcher_role": "backend/src/apiserver/plugins/mlflow/config.go:525-535 (driver and launcher containers)",
    "defaults": "backend/src/apiserver/plugins/mlflow/config.go:67-86 (authType kubernetes; workspaces on with it)",
    "experiment": "backend/src/apiserver/plugins/mlflow/config.go:41 (KFP-Default)",
    # driver: the task's nested run and the env of the user container
    "nested_run": "backend/src/v2/common/plugins/mlflow/handler.go:68-74 (tag mlflow.parentRunId)",
    "inject_gate": "backend/src/v2/common/plugins/mlflow/handler.go:134-136 (injectUserEnvVars)",
    "run_env": "backend/src/v2/common/plugins/mlflow/handler.go:141-145",
    "workspace_env": "backend/src/v2/common/plugins/mlflow/handler.go:146-148",
    "auth_env": "backend/src/v2/common/plugins/mlflow/handler.go:149-168",
    "order": "backend/src/v2/driver/driver.go:290-298 (plugin env after the component's), k8s.go:347-386 (secrets after)",
    # an outage at task start: with injectUserEnvVars the task fails (fixed after 2.17.0 by 93d56b5)
    "outage": "backend/src/v2/common/plugins/mlflow/handler.go:137-139, dispatcher.go:127-131, driver/container.go:247-250",
}
RUNTIME_ENV = "KFP_MLFLOW_CONFIG"
CREDENTIAL_SECRET = "kfp-mlflow-credentials"  # common/plugins/mlflow/config.go:44
AUTH_KUBERNETES, AUTH_BEARER, AUTH_BASIC = "kubernetes", "bearer", "basic-auth"  # common/plugins/mlflow/client.go:38-40
RUN_ENV, URI_ENV, EXPERIMENT_ENV, WORKSPACE_ENV, AUTH_ENV = (
    "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_WORKSPACE", "MLFLOW_TRACKING_AUTH")
TOKEN_ENV, USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
#: The server setting that makes KFP hand each task its run (and, with it, what the outage rule below needs).
INJECT_SETTING = "plugins.mlflow.settings.injectUserEnvVars"


@dataclass(frozen=True)
class RuntimeConfig:
    """The fields of KFP_MLFLOW_CONFIG prmflow reads (common/plugins/mlflow/config.go:50-62)."""

    endpoint: str
    experiment_id: str
    parent_run_id: str
    auth_type: str = AUTH_KUBERNETES
    workspaces_enabled: bool = False
    workspace: str = ""
    inject_user_env_vars: bool = False
    credential_secret_ref: dict | None = None

    @classmethod
    def from_json(cls, text: str) -> "RuntimeConfig":
        raw = json.loads(text)
        return cls(endpoint=raw.get("endpoint", ""), experiment_id=str(raw.get("experimentId", "")),
                   parent_run_id=raw.get("parentRunId", ""), auth_type=raw.get("authType") or AUTH_KUBERNETES,
                   workspaces_enabled=bool(raw.get("workspacesEnabled")), workspace=raw.get("workspace", ""),
                   inject_user_env_vars=bool(raw.get("injectUserEnvVars")),
                   credential_secret_ref=raw.get("credentialSecretRef"))

    def to_json(self) -> str:
        out = {"endpoint": self.endpoint, "parentRunId": self.parent_run_id, "experimentId": self.experiment_id,
               "authType": self.auth_type, "workspacesEnabled": self.workspaces_enabled,
               "workspace": self.workspace, "injectUserEnvVars": self.inject_user_env_vars}
        if self.credential_secret_ref:
            out["credentialSecretRef"] = self.credential_secret_ref
        return json.dumps(out)


def runtime_config(environ=None) -> RuntimeConfig | None:
    """KFP's MLflow runtime config of this task (None: KFP's MLflow integration is off for this run, or this is
    not a KFP task). An unreadable one is logged and taken as none."""
    text = (os.environ if environ is None else environ).get(RUNTIME_ENV, "")
    if not text:
        return None
    try:
        cfg = RuntimeConfig.from_json(text)
    except (ValueError, AttributeError) as e:
        log.warning("%s is not the JSON KFP writes (%s); ignoring KFP's MLflow integration", RUNTIME_ENV, e)
        return None
    return cfg if cfg.endpoint and cfg.parent_run_id and cfg.experiment_id else None


def credential_env(cfg: RuntimeConfig) -> list[dict]:
    """The credentials of a basic-auth / bearer plugin, as secret references (BuildCredentialEnvVars)."""
    ref = cfg.credential_secret_ref or {}

    def secret(name, key):
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": CREDENTIAL_SECRET, "key": key}}}

    if cfg.auth_type == AUTH_BEARER and ref.get("tokenKey"):
        return [secret(TOKEN_ENV, ref["tokenKey"])]
    if cfg.auth_type == AUTH_BASIC and ref.get("usernameKey") and ref.get("passwordKey"):
        return [secret(USERNAME_ENV, ref["usernameKey"]), secret(PASSWORD_ENV, ref["passwordKey"])]
    return []


def launcher_env(cfg: RuntimeConfig) -> list[dict]:
    """What the API server puts on every launcher-role container of the run, whatever injectUserEnvVars says."""
    return [{"name": RUNTIME_ENV, "value": cfg.to_json()}, *credential_env(cfg)]


def user_env(cfg: RuntimeConfig, nested_run_id: str) -> list[dict]:
    """What the driver adds to the task's user container (RetrieveUserContainerEnvVars): nothing unless
    injectUserEnvVars; then the task's run, the server, the experiment, the workspace and the auth."""
    if not cfg.inject_user_env_vars:
        return []
    env = [{"name": RUN_ENV, "value": nested_run_id}, {"name": URI_ENV, "value": cfg.endpoint},
           {"name": EXPERIMENT_ENV, "value": cfg.experiment_id}]
    if cfg.workspaces_enabled:
        env.append({"name": WORKSPACE_ENV, "value": cfg.workspace})
    if cfg.auth_type == AUTH_KUBERNETES:
        env.append({"name": AUTH_ENV, "value": "kubernetes-namespaced" if cfg.workspaces_enabled else "kubernetes"})
    else:
        env.extend(credential_env(cfg))
    return env


def same_server(uri: str, endpoint: str) -> bool:
    return bool(uri) and uri.rstrip("/") == endpoint.rstrip("/")


def target(uri: str, environ=None) -> RuntimeConfig | None:
    """KFP's runtime config when prmflow logs to KFP's server `uri` (then it files its runs in KFP's tree);
    None otherwise, after dropping the auth KFP injected for its own server (`drop_kfp_auth`) and saying
    that KFP's runs stay empty on the other server."""
    cfg = runtime_config(environ)
    if cfg is None:
        return None
    if same_server(uri, cfg.endpoint):
        if not cfg.inject_user_env_vars:
            log.warning("KFP's MLflow integration is on without %s: prmflow files its runs under KFP's run of the "
                        "pipeline, and KFP's own (empty) run of each task stays beside them. Set %s: true in the KFP "
                        "API server's config (or the namespace's kfp-launcher ConfigMap) to have each stage log into "
                        "its task's run.", INJECT_SETTING, INJECT_SETTING)
        return cfg
    dropped = drop_kfp_auth(cfg, environ)
    log.warning("KFP's MLflow integration logs this run at %s, prmflow at %s: KFP's runs stay empty there%s. For one "
                "tree, log to KFP's server (pipeline.tracking_uri %s), or turn the integration off (remove "
                "plugins.mlflow from the KFP API server's config, or plugins_input.mlflow.disabled for the run).",
                cfg.endpoint, uri, f"; {', '.join(dropped)} (KFP's auth for its server) not sent to {uri}" if dropped
                else "", cfg.endpoint)
    return None


def drop_kfp_auth(cfg: RuntimeConfig, environ=None) -> list[str]:
    """Remove from the environment what KFP set for its own server and MLflow's client would send to any
    server: MLFLOW_TRACKING_AUTH (the pod's service-account token, in place of prmflow's credentials) and
    MLFLOW_WORKSPACE, where they hold KFP's values. Returns the names removed."""
    env = os.environ if environ is None else environ
    kfp = {e["name"]: e["value"] for e in user_env(cfg, "") if "value" in e}
    dropped = [name for name in (AUTH_ENV, WORKSPACE_ENV) if name in kfp and env.get(name) == kfp[name]]
    for name in dropped:
        env.pop(name)
    return dropped


def forward_env(uri: str, environ=None) -> list[dict]:
    """The env a TrainJob's node pods need to log where their step would (KFP's tree on KFP's server): KFP's
    runtime config, and what the driver injected into the step (its task's run, the auth), the credentials
    by secret reference. Nothing when the step logs to another server (the pods then carry only the
    pipeline's own secrets)."""
    env = os.environ if environ is None else environ
    cfg = runtime_config(env)
    if cfg is None or not same_server(uri, cfg.endpoint):
        return []
    out = launcher_env(cfg)
    if env.get(RUN_ENV):  # injected into the step: the node pods log into the step's task run
        names = {e["name"] for e in out}
        out += [e for e in user_env(cfg, env[RUN_ENV]) if e["name"] not in names]
    return out
