"""Safe loading: no pickle-based loads in the package, trust_remote_code off by default, weights
from safetensors only, and no file name (manifest entry, weight shard) that leaves its directory.
Also: a crash between the two renames of an atomic replace loses nothing."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest

import prmflow
from prmflow.components.training import checkpoint
from prmflow.components.data import io
from prmflow.components.models import modeling
from prmflow.errors import DataError, ModelLoadError, OutputExistsError

PACKAGE = Path(prmflow.__file__).parent


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


PICKLE_LOADS = {"pickle.load", "pickle.loads", "cloudpickle.load", "dill.load", "joblib.load", "yaml.unsafe_load",
                "yaml.full_load", "marshal.load", "marshal.loads"}


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Every torch.load without weights_only=True, pickle-style load, unsafe yaml.load, numpy
    allow_pickle=True, use_safetensors=False, and trust_remote_code=True given or defaulted."""
    found = []
    tree = ast.parse(source, filename)
    calls_ok = set()
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load") or name == "torch.load":
                if _is_true(kw.get("weights_only")):
                    calls_ok.add(id(node.func))
                else:
                    found.append(f"{where}: torch.load without weights_only=True")
            if name in PICKLE_LOADS:
                found.append(f"{where}: {name} (unpickles arbitrary code)")
            loader = ast.unparse(kw.get("Loader", ast.Constant(None)))
            if name in ("yaml.load", "yaml.load_all") and "SafeLoader" not in loader and loader != "safe_loader()":
                found.append(f"{where}: {name} without SafeLoader")  # safe_loader(): tests/pipelines/test_backend_contracts.py
            if name.split(".")[-1] == "load" and name.startswith(("np.", "numpy.")) and _is_true(kw.get("allow_pickle")):
                found.append(f"{where}: numpy load with allow_pickle=True")
            if _is_true(kw.get("trust_remote_code")):
                found.append(f"{where}: trust_remote_code=True")
            if isinstance(kw.get("use_safetensors"), ast.Constant) and kw["use_safetensors"].value is False:
                found.append(f"{where}: use_safetensors=False")
        elif isinstance(node, ast.Attribute) and _dotted(node) == "torch.load" and id(node) not in calls_ok:
            pass  # judged at its Call; aliases are caught below
        elif isinstance(node, ast.Assign) and _dotted(node.value) == "torch.load":
            found.append(f"{where}: torch.load aliased (its calls cannot be checked)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                if arg.arg == "trust_remote_code" and _is_true(default):
                    found.append(f"{where}: {node.name}(trust_remote_code=True) default")
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if arg.arg == "trust_remote_code" and _is_true(default):
                    found.append(f"{where}: {node.name}(trust_remote_code=True) default")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == "trust_remote_code" and _is_true(node.value):
                found.append(f"{where}: config field trust_remote_code defaults to True")
    return found


def test_the_scanner_catches_what_it_should():
    bad = '''
import torch, pickle, yaml, numpy as np
from dataclasses import dataclass
torch.load("x")
torch.load("x", weights_only=False)
state = pickle.load(open("f", "rb"))
yaml.load(text)
yaml.load_all(text, Loader=yaml.Loader)
np.load("a.npy", allow_pickle=True)
M.from_pretrained(p, trust_remote_code=True)
M.from_pretrained(p, use_safetensors=False)
def load(p, trust_remote_code=True): ...
def load2(p, *, trust_remote_code=True): ...
loader = torch.load
@dataclass
class C:
    trust_remote_code: bool = True
'''
    assert len(unsafe_loads(bad)) == 12, unsafe_loads(bad)
    good = '''
import torch, yaml
torch.load("x", weights_only=True)
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
yaml.load_all(text, Loader=safe_loader())
M.from_pretrained(p, trust_remote_code=cfg.trust_remote_code, use_safetensors=True)
def load(p, trust_remote_code=False): ...
'''
    assert unsafe_loads(good) == []


def test_package_source_has_no_unsafe_loads(reliability):
    files = sorted(PACKAGE.rglob("*.py"))
    found = [f for p in files for f in unsafe_loads(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert files and not found, "\n".join(found)
    reliability.add("safe-loading", source_files_scanned=len(files), unsafe_loads_found=len(found))


def test_stage_configs_keep_remote_code_off():
    from prmflow import stages
    from prmflow.components import config

    for name, module in stages.available().items():
        for key, (_, _, default) in config.flat_fields(module.Config).items():
            if key.split(".")[-1] == "trust_remote_code":
                assert default is False, f"{name}: {key} defaults to {default}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model, tok = modeling.build_tiny_model("tiny-llama")
    d = tmp_path_factory.mktemp("tiny") / "model"
    modeling.save_pretrained(model, tok, d)
    return d


def test_weight_shard_index_cannot_leave_the_model_directory(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    shutil.copy(d / "model.safetensors", tmp_path / "evil.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../evil.safetensors"}}))
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        modeling.load_causal_lm(d)
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        modeling.load_scalar_model(d)


def test_pickled_weights_are_refused(tiny_dir, tmp_path):
    model, _ = modeling.load_causal_lm(tiny_dir)
    d = tmp_path / "bin"
    shutil.copytree(tiny_dir, d)
    (d / "model.safetensors").unlink()
    import torch

    torch.save(model.state_dict(), d / "pytorch_model.bin")  # what an old or hostile checkpoint ships
    with pytest.raises(ModelLoadError):
        modeling.load_causal_lm(d)


def test_remote_code_is_off_unless_asked(tiny_dir):
    import inspect

    for fn in (modeling.load_causal_lm, modeling.load_tokenizer, modeling.load_scalar_model):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False


def test_existing_output_listing_a_file_outside_is_not_taken_as_done(tmp_path):
    out = tmp_path / "out"
    with io.atomic_output_dir(out, "advantages", manifest={"config": {"a": 1}}) as tmp:
        (tmp / "part-00000.parquet").write_bytes(b"x")
    m = json.loads((out / io.MANIFEST).read_text())
    m["files"] = {"../x": io.sha256_file(out / "part-00000.parquet")}
    (out / io.MANIFEST).write_text(json.dumps(m))
    (tmp_path / "x").write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="escape"):
        io.completed_output(out, {"config": {"a": 1}}, overwrite=False, stage="t")
    assert io.completed_output(out, {"config": {"a": 1}}, overwrite=True, stage="t") is None  # replaced, not trusted


# --- a crash between the two renames of a replace ---------------------------------------------------

def _killed_mid_replace(path: Path) -> Path:
    """What a kill between `os.replace(path, old)` and `os.replace(tmp, path)` leaves behind."""
    old = path.with_name(f".{path.name}.tmp-old-4242")
    os.replace(path, old)
    new_tmp = path.with_name(f".{path.name}.tmp-abcd")
    new_tmp.mkdir()
    (new_tmp / "half").write_text("x")  # the new version, not yet committed
    return old


def test_resume_checkpoint_survives_a_kill_mid_replace(tmp_path):
    work = tmp_path / ".out.work"
    latest = work / "latest"
    with io.atomic_output_dir(latest, "resume-checkpoint", manifest={"config": checkpoint.identity({"a": 1})}) as tmp:
        (tmp / "state").write_text("step 6")
    _killed_mid_replace(latest)
    assert not latest.exists()
    assert checkpoint.find(work, {"a": 1}) == latest  # the previous checkpoint is back, not swept away
    assert (latest / "state").read_text() == "step 6"


def test_committed_output_survives_a_kill_mid_overwrite(tmp_path):
    out = tmp_path / "out"
    with io.atomic_output_dir(out, "thing") as tmp:
        (tmp / "a").write_text("v1")
    _killed_mid_replace(out)
    with pytest.raises(OutputExistsError):  # the restored v1 is not silently replaced
        with io.atomic_output_dir(out, "thing"):
            pass
    assert (out / "a").read_text() == "v1" and io.read_manifest(out)["kind"] == "thing"
    with io.atomic_output_dir(out, "thing", overwrite=True) as tmp:  # an explicit overwrite still works
        (tmp / "a").write_text("v2")
    assert (out / "a").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the half-written temporary is gone


def test_verify_files_names_the_escaping_entry(tmp_path):
    with pytest.raises(DataError, match="escape"):
        io.verify_files(tmp_path, {"files": {"../../etc/passwd": "0" * 64}})
