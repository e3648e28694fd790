"""Kubeflow Trainer rules a TrainJob from prmflow must meet: the admission webhook and the CRD schema.

Read from kubeflow/trainer at v2.2.0, v2.2.1 and v2.3.0 (the 2.2 sources cite v2.2.1; v2.2.0 has the
same rules on the same lines unless noted):

- The JobSet plugin's webhook refuses env on the `node`, `dataset-initializer` and `model-initializer`
  containers inside spec.runtimePatches ("must not have envs for ..."): env of the training container
  goes in spec.trainer.env, a list of core/v1 EnvVar, so valueFrom.secretKeyRef works there.
- The same webhook refuses a patched replicated job or container the runtime's template lacks, and a
  patch manager that is not a domain-prefixed path.
- The torch plugin refuses the env torchrun's PET_* variables are set through (the runtime sets them).
- The API server validates against the CRD's openAPIV3Schema (shipped for each tag under
  tests/data/trainer/) and prunes unknown fields; a list of type map (spec.trainer.env, keyed by name)
  refuses two items with the same key, and the CRD's CEL rules refuse a TrainJob name that is not an
  RFC 1035 label of at most 63 characters.
"""

from __future__ import annotations

import re

from . import TRAINER_VERSIONS, Source, version_family

REPO = "kubeflow/trainer"
TAGS = {"2.2": "v2.2.1", "2.3": "v2.3.0"}
JOBSET_PLUGIN = "pkg/runtime/framework/plugins/jobset/jobset.go"
TORCH_PLUGIN = "pkg/runtime/framework/plugins/torch/torch.go"

NO_ENV_IN_PATCH = {"2.2": Source(REPO, "v2.2.1", JOBSET_PLUGIN, 156), "2.3": Source(REPO, "v2.3.0", JOBSET_PLUGIN, 203)}
PATCHED_JOB_EXISTS = {"2.2": Source(REPO, "v2.2.1", JOBSET_PLUGIN, 136), "2.3": Source(REPO, "v2.3.0", JOBSET_PLUGIN, 183)}
PATCHED_CONTAINER_EXISTS = {"2.2": Source(REPO, "v2.2.1", JOBSET_PLUGIN, 153),
                            "2.3": Source(REPO, "v2.3.0", JOBSET_PLUGIN, 200)}
PATCH_MANAGER = {"2.2": Source(REPO, "v2.2.1", JOBSET_PLUGIN, 129), "2.3": Source(REPO, "v2.3.0", JOBSET_PLUGIN, 176)}
RESERVED_TORCH_ENV = {"2.2": Source(REPO, "v2.2.0", TORCH_PLUGIN, 68), "2.3": Source(REPO, "v2.3.0", TORCH_PLUGIN, 69)}
#: spec.trainer.env: []corev1.EnvVar (pkg/apis/trainer/v1alpha1/trainjob_types.go, type Trainer).
TRAINER_ENV = {"2.2": Source(REPO, "v2.2.1", "pkg/apis/trainer/v1alpha1/trainjob_types.go", 267),
               "2.3": Source(REPO, "v2.3.0", "pkg/apis/trainer/v1alpha1/trainjob_types.go", 273)}
CRD_PATH = "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"
CRD = {fam: Source(REPO, tag, CRD_PATH, "openAPIV3Schema") for fam, tag in TAGS.items()}
#: The TrainJob's CEL rules on metadata.name (x-kubernetes-validations of the root schema).
NAME_RULE = {"2.2": Source(REPO, "v2.2.1", CRD_PATH, "6012-6015"), "2.3": Source(REPO, "v2.3.0", CRD_PATH, "6050-6053")}
#: spec.trainer.env is x-kubernetes-list-type: map keyed by name: no two env vars of one name.
ENV_LIST_MAP = {"2.2": Source(REPO, "v2.2.1", CRD_PATH, "5746-5748"), "2.3": Source(REPO, "v2.3.0", CRD_PATH, "5784-5786")}
#: The CEL rules of the TrainJob schema this module evaluates, by their text in the CRD, each as a check of
#: the value it sits on (regexes, lengths and set membership: Python says what CEL says). Transition rules
#: (`oldSelf`) apply to updates only, never to a create, so they are not listed.
_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_STORAGE_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")
CEL_RULES = {
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')":
        lambda obj: bool(_RFC1035.search(str((obj.get("metadata") or {}).get("name", "")))),
    "size(self.metadata.name) <= 63": lambda obj: len(str((obj.get("metadata") or {}).get("name", ""))) <= 63,
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": lambda v: v == "" or bool(_STORAGE_URI.search(v)),
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']":
        lambda v: v in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
    "has(self.lastUpdatedTime)": lambda v: "lastUpdatedTime" in v,
}

#: The TrainJob condition types that end it (trainjob_types.go:61 and :64 at v2.2.1 and v2.3.0); the
#: SDK reports the job's status as the type of its true condition.
COMPLETE, FAILED = "Complete", "Failed"
CONDITIONS = {fam: Source(REPO, tag, "pkg/apis/trainer/v1alpha1/trainjob_types.go", "61, 64") for fam, tag in TAGS.items()}
#: constants.Node / DatasetInitializer / ModelInitializer (pkg/constants/constants.go).
NODE, DATASET_INITIALIZER, MODEL_INITIALIZER = "node", "dataset-initializer", "model-initializer"
#: constants.TorchRunReservedEnvNames (pkg/constants/constants.go:287 at v2.2.0, :300 at v2.3.0).
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: k8s.io/apimachinery validation.IsDomainPrefixedPath: a DNS-1123 subdomain, a slash, a non-empty path.
_DOMAIN_PREFIXED = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")


def family(version: str) -> str:
    """'v2.2.1' -> '2.2'; ValueError for a Trainer we do not check against."""
    return version_family(version, TRAINER_VERSIONS, "Kubeflow Trainer")


def runtime_containers(runtime: dict) -> dict[str, set[str]]:
    """{replicated job name: its container and init container names} of a (Cluster)TrainingRuntime."""
    out = {}
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]["spec"]
        out[rjob["name"]] = {c["name"] for c in pod.get("containers", []) + pod.get("initContainers", [])}
    return out


def webhook_errors(trainjob: dict, runtime: dict, version: str) -> list[str]:
    """What Trainer `version`'s validating webhook (JobSet and torch plugins) refuses in `trainjob` (a
    TrainJob body) against its runtime `runtime` (the ClusterTrainingRuntime body); [] when admitted."""
    fam = family(version)
    spec = trainjob.get("spec") or {}
    errors = []
    containers = runtime_containers(runtime)
    for patch in spec.get("runtimePatches") or []:
        if not _DOMAIN_PREFIXED.fullmatch(patch.get("manager") or ""):
            errors.append(f"spec.runtimePatches.manager: Invalid value: {patch.get('manager')!r}: must be a "
                          f"domain-prefixed path ({PATCH_MANAGER[fam]})")
        template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in template.get("replicatedJobs") or []:
            names = containers.get(rjob.get("name"))
            if names is None:
                errors.append(f"spec.runtimePatches: must not have replicated job that doesn't exist in the runtime "
                              f"job template ({PATCHED_JOB_EXISTS[fam]})")
                continue
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                if c.get("name") not in names:
                    errors.append(f"spec.runtimePatches: must not have container that doesn't exist in the runtime "
                                  f"job {rjob['name']} ({PATCHED_CONTAINER_EXISTS[fam]})")
                elif c.get("env") and c["name"] in (DATASET_INITIALIZER, MODEL_INITIALIZER, NODE):
                    errors.append(f"spec.runtimePatches: must not have envs for the {DATASET_INITIALIZER}, "
                                  f"{MODEL_INITIALIZER}, {NODE} containers ({NO_ENV_IN_PATCH[fam]})")
    torch = ((runtime.get("spec") or {}).get("mlPolicy") or {}).get("torch") is not None
    reserved = sorted({e.get("name") for e in (spec.get("trainer") or {}).get("env") or []} & set(TORCH_RESERVED_ENV))
    if torch and reserved:
        errors.append(f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved} "
                      f"({RESERVED_TORCH_ENV[fam]})")
    return errors


def _integer(value) -> bool:
    """An integer as the API server's validation reads JSON: 8 and 8.0 (kube-openapi validate/type.go
    accepts a float that is a whole number; the SDK sends resource counts as 8.0)."""
    return not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))


def schema_errors(value, schema: dict, path: str = "") -> list[str]:
    """Where `value` breaks a CRD's structural openAPIV3Schema (types, required, enums, bounds, the unique keys of
    a list of type map), and every field the API server would prune as unknown; of the CEL rules
    (x-kubernetes-validations), those in CEL_RULES are evaluated and any other is reported as not checked."""
    errors: list[str] = []
    where = path or "<root>"
    for rule in schema.get("x-kubernetes-validations") or []:
        check = CEL_RULES.get(rule.get("rule"))
        if "oldSelf" in rule.get("rule", ""):  # a transition rule: checked on update only
            continue
        if check is None:
            errors.append(f"{where}: CEL rule {rule.get('rule')!r} is not evaluated here (add it to CEL_RULES)")
        elif not check(value):
            errors.append(f"{where}: Invalid value: {rule.get('message') or rule['rule']}")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_integer(value) or isinstance(value, str)):
            errors.append(f"{where}: must be an integer or a string")
        return errors
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: must be an object"]
        props = schema.get("properties")
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(f"{path}.{key}: Required value".lstrip("."))
        for key, item in value.items():
            sub = f"{path}.{key}".lstrip(".")
            if props is not None and key in props:
                errors += schema_errors(item, props[key], sub)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], sub)
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and props is not None:
                errors.append(f"{sub}: unknown field (pruned)")
    elif kind == "array":
        if not isinstance(value, list):
            return [f"{where}: must be a list"]
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: at most {schema['maxItems']} items")
        if schema.get("x-kubernetes-list-type") == "map":  # apiextensions' listtype validation: unique map keys
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen = set()
            for i, item in enumerate(value):
                key = tuple((item or {}).get(k) for k in keys) if isinstance(item, dict) else None
                if key in seen:
                    errors.append(f"{path}[{i}]: Duplicate value: {dict(zip(keys, key))}")
                seen.add(key)
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items") or {}, f"{path}[{i}]")
    elif kind == "string":
        if not isinstance(value, str):
            return [f"{where}: must be a string"]
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: longer than {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{where}: shorter than {schema['minLength']}")
        if "enum" in schema and value not in schema["enum"]:
            errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: does not match {schema['pattern']}")
    elif kind == "integer":
        if not _integer(value):
            return [f"{where}: must be an integer"]
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: below {schema['minimum']}")
    elif kind == "boolean" and not isinstance(value, bool):
        errors.append(f"{where}: must be a boolean")
    elif kind == "number" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        errors.append(f"{where}: must be a number")
    return errors
