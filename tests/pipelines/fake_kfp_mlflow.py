"""A fake of Kubeflow Pipelines 2.17's MLflow plugin: the runs it makes and the env its tasks' containers get.

The rules are prmflow.tracking.kfp_plugin's (each beside its kubeflow/pipelines@2.17.0 line); this plays
the API server and the driver around them, on a real MLflow store:

- `start_run` (apiserver/plugins/mlflow/handler.go:53-141): the experiment (KFP-Default unless named,
  config.go:41), the run of the pipeline run (one tag stands in for BuildKFPTags), and the runtime config every launcher-role
  container gets with the credentials (handler.go:106-137, config.go:525-535);
- `task_env` (driver/container.go:181-187 then :247-271): the task's nested run, tagged mlflow.parentRunId
  (v2/common/plugins/mlflow/handler.go:68-74), and the container's env as the pod gets it: the component's
  env, then the plugin's (driver.go:290-296; only with injectUserEnvVars, handler.go:134-168), then the
  pipeline's secrets (k8s.go:347-386), each secretKeyRef resolved from `secrets`. Where two entries share a
  name the later one is what the process sees (Kubernetes expands a container's env in order).
"""

from __future__ import annotations

from prmflow.tracking import kfp_plugin

SETTINGS_DEFAULTS = "backend/src/apiserver/plugins/mlflow/config.go:67-86"


class FakeKfpMlflow:
    def __init__(self, uri: str, inject: bool = False, auth: str = kfp_plugin.AUTH_KUBERNETES,
                 workspaces: bool | None = None, namespace: str = "ml-team", experiment: str = "KFP-Default",
                 secrets: dict[str, dict[str, str]] | None = None):
        from mlflow.tracking import MlflowClient

        self.uri, self.client, self.namespace, self.experiment = uri, MlflowClient(uri), namespace, experiment
        # ApplySettingsDefaults: workspaces default on with authType kubernetes, off otherwise
        self.workspaces = (auth == kfp_plugin.AUTH_KUBERNETES) if workspaces is None else workspaces
        self.inject, self.auth = inject, auth
        self.ref = ({"usernameKey": "user", "passwordKey": "pass"} if auth == kfp_plugin.AUTH_BASIC
                    else {"tokenKey": "token"} if auth == kfp_plugin.AUTH_BEARER else None)
        self.secrets = {kfp_plugin.CREDENTIAL_SECRET: {"user": "kfp-user", "pass": "kfp-pass", "token": "kfp-token"},
                        **(secrets or {})}
        self.cfg: kfp_plugin.RuntimeConfig | None = None
        self.task_runs: dict[str, str] = {}

    def start_run(self, display_name: str, kfp_run_id: str) -> kfp_plugin.RuntimeConfig:
        """OnBeforeRunCreation: the experiment, KFP's run of the pipeline run, the runtime config."""
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
        parent = self.client.create_run(exp_id, run_name=display_name, tags={"kfp.pipeline_run_id": kfp_run_id})
        self.cfg = kfp_plugin.RuntimeConfig(
            endpoint=self.uri, experiment_id=exp_id, parent_run_id=parent.info.run_id, auth_type=self.auth,
            workspaces_enabled=self.workspaces, workspace=self.namespace if self.workspaces else "",
            inject_user_env_vars=self.inject, credential_secret_ref=self.ref)
        return self.cfg

    def task_env(self, task: str, component_env: list[dict] | None = None,
                 secret_env: list[dict] | None = None) -> dict[str, str]:
        """OnTaskStart (the task's nested run) and the env of the task's container, resolved."""
        nested = self.client.create_run(self.cfg.experiment_id, run_name=task,
                                        tags={"mlflow.parentRunId": self.cfg.parent_run_id}).info.run_id
        self.task_runs[task] = nested
        entries = [*kfp_plugin.launcher_env(self.cfg), *(component_env or []),
                   *kfp_plugin.user_env(self.cfg, nested), *(secret_env or [])]
        return self.resolve(entries)

    def resolve(self, entries: list[dict]) -> dict[str, str]:
        """A container's env list as its process sees it: secret references read, the later of two names kept."""
        env = {}
        for e in entries:
            if "value" in e:
                env[e["name"]] = e["value"]
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                value = self.secrets.get(ref["name"], {}).get(ref["key"])
                if value is None and not ref.get("optional"):
                    raise KeyError(f"secret {ref['name']} has no key {ref['key']}")
                if value is not None:
                    env[e["name"]] = value
        return env
