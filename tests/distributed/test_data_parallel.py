"""sft, prm and ppo as 2 gloo ranks (DeepSpeed ZeRO-2 and ZeRO-3) give the 1-process result.

`prmflow <stage> --engine.nproc_per_node 2` is what a user types: the stage re-executes itself
through torch.distributed.run. The reference is the same config in one process (the same global
batch, data order and loss normalization). Each 2-rank run costs about a minute on 2 shared cores
(two Python processes importing torch, transformers and DeepSpeed), hence @slow.

Tolerance. Everything is float32. The two runs differ only in the order of float additions: a rank
sums half of each micro-batch's per-token losses and gradients, and DeepSpeed adds the two halves
(divided by 2, then multiplied back by the engine) instead of one process summing all of them.
Each such sum is exact to a few units in the last place (relative 2^-23 ~ 1.2e-7 per rounding, a
handful of roundings), Adam's update lr * m / (sqrt(v) + eps) is scale-free in the gradient, so a
relative gradient error of ~1e-6 moves a weight by ~lr * 1e-6 per step; the weights are O(1), so
after 3 steps the difference is a few float32 ulps of O(1) numbers: ~1e-7 to 1e-6 (measured,
ZeRO-2 / ZeRO-3: sft 1.2e-7 / 1.2e-7, prm 7.7e-7 / 8.4e-7, ppo 1.1e-6 / 5.7e-7). We allow 1e-5:
about 10x that headroom, and below what a real mistake does (DeepSpeed's average over ranks not
undone: 3.3e-5 on sft; a rank on the wrong slice or a missed step: >= 1e-3 at these learning rates).

Adam hides a gradient that is off by a constant factor (e.g. DeepSpeed's average over ranks not
undone, or the loss divided by each rank's own token count): the weights barely move differently.
So the gradient norm each step (logged to MLflow as train/grad_norm before clipping) is compared
too, with the same relative tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dp_helpers import ARGS, WEIGHTS, max_abs_diff, metric_history, run_cli, stage_runs, weights

pytestmark = pytest.mark.slow

WEIGHT_TOL = 1e-5
GRAD_NORM_RTOL = 1e-5


@pytest.fixture(scope="module")
def ppo_inputs(tmp_path_factory) -> dict:
    """A tiny policy and an advantages hand-off of 16 responses scored by it (tests/ppo helpers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ppo"))
    from ppo_helpers import build_rows, write_advantages

    from prmflow.components.common import io, modeling

    root = tmp_path_factory.mktemp("ppo-inputs")
    model, tok = modeling.load_causal_lm("tiny-llama", seed=0)
    with io.atomic_output_dir(root / "policy", "policy", manifest={"config": {"preset": "tiny-llama"}}) as tmp:
        modeling.save_pretrained(model, tok, tmp)
    rows = build_rows(root / "policy", 16)
    write_advantages(root / "advantages", rows, advantages=lambda i, t: (1.0 if i % 2 == 0 else -1.0) * (1 + 0.1 * t))
    return {"policy": str(root / "policy"), "input": str(root / "advantages")}


def _values(stage: str, zero: int, ppo_inputs: dict, run_dir: Path, nproc: int) -> dict:
    return {**ARGS[stage], **(ppo_inputs if stage == "ppo" else {}), "output": str(run_dir / "out"),
            "engine.backend": "deepspeed", "engine.zero_stage": zero, "engine.nproc_per_node": nproc,
            "engine.collective_timeout_s": 120, "tracking.uri": f"sqlite:///{run_dir / 'mlflow.db'}"}


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("stage", ["sft", "prm", "ppo"])
def test_two_ranks_equal_one_process(stage, zero, tmp_path, request):
    ppo_inputs = request.getfixturevalue("ppo_inputs") if stage == "ppo" else {}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    ref = run_cli(stage, _values(stage, zero, ppo_inputs, one, 1), one)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = run_cli(stage, _values(stage, zero, ppo_inputs, two, 2), two)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "starting 2 ranks" in got.stderr

    # the same weights, up to float reduction order (tolerance: module docstring)
    diff = max_abs_diff(weights(one / "out" / WEIGHTS[stage]), weights(two / "out" / WEIGHTS[stage]))
    print(f"{stage} ZeRO-{zero}: max |w_2ranks - w_1process| = {diff:.3g}")
    assert diff <= WEIGHT_TOL

    # exactly one committed output, with one manifest, and nothing half-written beside it
    assert sorted(p.name for p in two.iterdir() if p.name.startswith(".out") or p.name == "out") == ["out"]
    assert [p.relative_to(two).as_posix() for p in two.rglob("manifest.json")] == ["out/manifest.json"]
    assert (two / "out" / WEIGHTS[stage]).is_file()

    # one MLflow run for the stage, finished, from rank 0; its gradient norms are the 1-process ones
    runs2, runs1 = stage_runs(f"sqlite:///{two / 'mlflow.db'}", stage), stage_runs(f"sqlite:///{one / 'mlflow.db'}", stage)
    assert len(runs2) == 1 and len(runs1) == 1
    assert runs2[0].info.status == "FINISHED"
    g2 = metric_history(f"sqlite:///{two / 'mlflow.db'}", runs2[0].info.run_id, "train/grad_norm")
    g1 = metric_history(f"sqlite:///{one / 'mlflow.db'}", runs1[0].info.run_id, "train/grad_norm")
    assert len(g2) == len(g1) >= 2
    assert g2 == pytest.approx(g1, rel=GRAD_NORM_RTOL)
