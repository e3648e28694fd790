"""The tracker interface, doing nothing: what a stage gets with tracking off, so it needs no `if`s."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class NullTracker:
    """Takes every tracking call and does nothing."""

    run_id: str = ""
    uri: str = ""

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...
    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # SystemExit/KeyboardInterrupt: stopped from outside (preemption, Ctrl-C), not a failure of the stage
        stopped = exc_type is not None and issubclass(exc_type, (SystemExit, KeyboardInterrupt))
        self.finish("KILLED" if stopped else "FAILED" if exc_type else "FINISHED")
        return False
