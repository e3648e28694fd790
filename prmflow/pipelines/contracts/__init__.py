"""The rules of the systems prmflow runs on, each written once with the source it comes from.

KFP's driver and compiler, the Argo controller it deploys (how big a run may grow), Kubeflow Trainer's
webhook and CRD, the `kubeflow` SDK and kfp's Client each
enforce rules that cannot run here. One module per system holds the rules we depend on, each beside a
`Source` (repository, tag, path, line) read from that system's code; the compile-time checks
(`pipeline compile/plan/submit`), the TrainJob step and the fakes in tests/pipelines all read them
from here, so a fake cannot drift from what the code checks. Rules that differ by version take the
version as an argument; the versions we support are listed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Kubeflow Pipelines backends the compiled spec is checked against (compile, plan, submit).
KFP_VERSIONS = ("2.15", "2.16", "2.17")
#: Kubeflow Trainer control planes the TrainJob step is checked against.
TRAINER_VERSIONS = ("2.2", "2.3")


@dataclass(frozen=True)
class Source:
    """Where a rule is written in the real system: repository, tag, path and line (as read)."""

    repo: str
    tag: str
    path: str
    line: int | str

    def __str__(self) -> str:
        return f"{self.repo}@{self.tag} {self.path}:{self.line}"


def version_tuple(version: str, what: str = "version") -> tuple[int, int]:
    """'2.16.1' / 'v2.16' -> (2, 16); ValueError naming `what` when it is not a version."""
    m = re.match(r"v?(\d+)\.(\d+)", str(version or "").strip())
    if m is None:
        raise ValueError(f"{what} {version!r} is not a version like 2.15 or 2.15.0")
    return int(m.group(1)), int(m.group(2))


def version_family(version: str, known: tuple[str, ...], what: str) -> str:
    """'2.16.1' / 'v2.2.1' -> '2.16' / '2.2'; ValueError naming `what` for one we do not check against."""
    major, minor = version_tuple(version, what)
    fam = f"{major}.{minor}"
    if fam not in known:
        raise ValueError(f"{what} {version} is not one prmflow checks against ({', '.join(known)})")
    return fam
