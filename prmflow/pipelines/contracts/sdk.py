"""The `kubeflow` SDK (0.5.0, TrainerClient on the Kubernetes backend) as the TrainJob step uses it.

Read from the installed wheel (kubeflow 0.5.0; kubeflow/sdk, tag 0.5.0):

- `get_job` makes one read of the TrainJob with a 120 s timeout: a read that takes longer raises
  TimeoutError, any other failure (a 500 of the API server, a 404) RuntimeError with the ApiException
  as its cause; the listing of the job's pods inside `get_job` raises the same two (its own 120 s
  read). `wait_for_job_status` polls `get_job` and raises TimeoutError too when its own
  timeout passes, so a caller cannot tell one slow read from the job's deadline: prmflow polls
  itself and keeps its own deadline.
- `train()` copies only `command` and `args` from an option's spec.trainer (trainer_overrides); a
  CustomTrainerContainer's env takes plain strings. Env by secret reference (spec.trainer.env with
  valueFrom.secretKeyRef) therefore cannot go through `train()`.
"""

from __future__ import annotations

from . import Source

REPO, TAG = "kubeflow/sdk", "0.5.0"
BACKEND = "kubeflow/trainer/backends/kubernetes/backend.py"

#: kubeflow.common.constants.DEFAULT_TIMEOUT: every API read of the SDK waits this long at most.
READ_TIMEOUT_S = 120
READ_TIMEOUT = Source(REPO, TAG, "kubeflow/common/constants.py", 19)
GET_JOB_TIMEOUT = Source(REPO, TAG, BACKEND, 437)       # multiprocessing.TimeoutError -> TimeoutError
GET_JOB_OTHER_ERRORS = Source(REPO, TAG, BACKEND, 441)  # any other Exception -> RuntimeError (cause kept)
POD_LISTING_ERRORS = Source(REPO, TAG, BACKEND, 755)   # get_job's pod listing: TimeoutError / RuntimeError
WAIT_TIMEOUT = Source(REPO, TAG, BACKEND, 520)          # wait_for_job_status's own deadline: TimeoutError
TRAINER_OVERRIDES = Source(REPO, TAG, BACKEND, 836)     # only command and args reach spec.trainer


def read_failure(exc: BaseException) -> str:
    """What a failed `get_job` means: 'gone' (404: the job was deleted), 'transient' (a read that timed out,
    a 5xx or 429 of the API server, a connection error: read again), or 'fatal' (401/403/other)."""
    if isinstance(exc, TimeoutError):
        return "transient"
    cause = exc.__cause__
    status = getattr(cause, "status", None)
    if status == 404:
        return "gone"
    if isinstance(status, int) and (status >= 500 or status == 429 or status == 0):
        return "transient"
    import urllib3

    if isinstance(cause, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
        return "transient"
    return "fatal"
