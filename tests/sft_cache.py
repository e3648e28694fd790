"""The cached SFT policies the tests share: trained once per code + library version, verified on every hit.

Kept out of conftest.py so a test can import it by name (several conftest modules exist under tests/).
"""

from __future__ import annotations

import os


def source_digest() -> str:
    """Hash of everything that can change what a cached fixture holds: every file of the prmflow package
    and the versions of Python and the libraries that train and save the model. A cached policy is
    never trusted across a change to any of them."""
    import hashlib
    import importlib.metadata as md
    import platform
    from pathlib import Path

    import prmflow

    root = Path(prmflow.__file__).parent
    h = hashlib.sha256(platform.python_version().encode())
    for dist in ("torch", "transformers", "deepspeed", "peft", "tokenizers", "safetensors"):
        try:
            h.update(f"{dist}=={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            h.update(f"{dist} missing".encode())
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in {".py", ".yaml", ".json", ".txt"} and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cached_sft(name: str, overrides: dict):
    """Train (once) an SFT policy with `overrides`, cached under $PRMFLOW_TEST_CACHE (default
    ~/.cache/prmflow-tests; .ci/run points it inside the checkout, so CI always starts cold) by the
    recipe and `source_digest()`, so it is rebuilt whenever the code or the libraries change, and a hit
    is used only when its files match the manifest's checksums."""
    import hashlib
    import json
    import shutil
    from pathlib import Path

    from prmflow.components import config
    from prmflow.components.data import io
    from prmflow.errors import DataError
    from prmflow.components.sft import stage

    import fcntl

    recipe = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    root = Path(os.environ.get("PRMFLOW_TEST_CACHE", Path.home() / ".cache" / "prmflow-tests"))
    out = root / f"{name}-{source_digest()}-{recipe}"
    root.mkdir(parents=True, exist_ok=True)
    # one trainer per entry: parallel test workers (pytest -n) wait here for the first one's result
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            try:  # a hit must be intact: every file the manifest lists, with its checksum
                io.verify_files(out, io.read_manifest(out))
                return out
            except DataError:
                shutil.rmtree(out)
        stage.run(config.load(stage.Config, overrides={**overrides, "output": str(out)}))
    return out
