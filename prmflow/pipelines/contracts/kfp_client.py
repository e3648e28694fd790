"""kfp's Client (kfp 2.17.0, kfp/client/client.py as installed from PyPI; kubeflow/pipelines sdk/python)
as `pipeline submit` and `upload` drive it.

- Given a token (existing_token) and no host, the client returns its configuration before it looks
  for the in-cluster service: requests go to the default host, http://localhost.
- Given credentials (e.g. a service-account token file) and no host inside a pod, the in-cluster path
  replaces them with the default projected token (KF_PIPELINES_SA_TOKEN_PATH).
- The in-cluster service is ml-pipeline.<namespace>.svc.cluster.local:8888, <namespace> being the
  client's `namespace` argument; any value of it but 'kubeflow' also becomes the user's namespace, where
  runs and experiments are filed.
"""

from __future__ import annotations

from . import Source

REPO, TAG, PATH = "kfp (PyPI)", "2.17.0", "kfp/client/client.py"
IN_CLUSTER_DNS = Source(REPO, TAG, PATH, 131)           # _IN_CLUSTER_DNS_NAME
NAMESPACE_BECOMES_USERS = Source(REPO, TAG, PATH, 183)  # if namespace != 'kubeflow': context namespace = it
TOKEN_WITHOUT_HOST = Source(REPO, TAG, PATH, 291)       # if token: ... return config (host left at its default)
IN_CLUSTER_DEFAULT_CREDENTIALS = Source(REPO, TAG, PATH, 308)  # in_cluster: default credentials replace ours


def in_cluster_url(kfp_namespace: str) -> str:
    """The KFP API service of the deployment in `kfp_namespace`, as kfp builds it (read from the installed
    kfp, so a test can stand a fake there)."""
    import kfp

    return "http://" + kfp.Client._IN_CLUSTER_DNS_NAME.format(kfp_namespace)
