"""Helpers for the data-parallel tests: the stages' tiny configs, a CLI run, weights, MLflow runs.

(A module with its own name, not conftest.py, so `import dp_helpers` cannot pick up another test
directory's conftest when the whole suite runs.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Seconds a collective waits for a missing rank in these tests (engine.collective_timeout_s).
COLLECTIVE_TIMEOUT_S = 60

#: Few steps of each stage on the tiny preset, with every global batch split over the ranks
#: (micro_batch_size 4 = 2 examples per rank, 2 micro-batches per optimizer step).
ARGS = {
    "sft": {"num_prompts": 32, "eval_size": 4, "micro_batch_size": 4, "grad_accum": 2, "max_steps": 3,
            "optim.warmup_steps": 0, "eval_every": 0, "save_every": 0, "eval_max_new_tokens": 4, "log_every": 1},
    "prm": {"backbone": "tiny-llama", "extra_layers": 0, "train_layers": 0, "num_prompts": 16, "eval_size": 4,
            "negatives_per_problem": 1, "micro_batch_size": 4, "grad_accum": 2, "max_steps": 3,
            "optim.warmup_steps": 0, "eval_every": 0, "save_every": 0, "log_every": 1},
    "ppo": {"minibatch_size": 8, "micro_batch_size": 4, "epochs": 1, "optim.lr": 1e-3, "save_every": 0},
}
#: the prm stage with PRIME's implicit head: the LM trained against its frozen reference (run as `prmflow prm`)
ARGS["prm-implicit"] = {**ARGS["prm"], "head.kind": "implicit", "head.beta": 0.5}

#: Adam's epsilon of the equivalence runs (test_data_parallel.py's docstring: at torch's 1e-8, Adam
#: amplifies float noise into weight differences as large as a real mistake's).
EPS = 1e-3
#: Max |w_2ranks - w_1process| allowed: ~8 float32 ulps of 1.0 (test_data_parallel.py's docstring).
WEIGHT_TOL = 1e-6

#: Where each stage's output keeps the trained weights.
WEIGHTS = {"sft": "model.safetensors", "prm": "model.safetensors", "prm-implicit": "model.safetensors",
           "ppo": "policy/model.safetensors"}


def flags(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


def env() -> dict:
    """This environment without what an in-process DeepSpeed run left in it (RANK, MASTER_PORT...)."""
    dropped = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return {**{k: v for k, v in os.environ.items() if k not in dropped},
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def command(stage: str, values: dict) -> list[str]:
    return [sys.executable, "-m", "prmflow.cli", stage, *flags(values)]


def run_cli(stage: str, values: dict, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(stage, values), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def stage_runs(uri: str, stage: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = client.search_experiments()
    return [r for r in client.search_runs([e.experiment_id for e in exps])
            if r.data.tags.get("prmflow.stage") == stage]


def metric_history(uri: str, run_id: str, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    return [m.value for m in sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=`rank` among the launcher's children (Linux /proc)."""
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None
