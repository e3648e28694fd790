"""sft, prm (both heads: token classification and PRIME's implicit) and ppo as 2 gloo ranks (DeepSpeed ZeRO-2 and
ZeRO-3) give the 1-process result.

`prmflow <stage> --engine.nproc_per_node 2` is what a user types: the stage re-executes itself
through torch.distributed.run. The reference is the same config in one process (the same global
batch, data order and loss normalization). Each 2-rank run costs about a minute on 2 shared cores
(two Python processes importing torch, transformers and DeepSpeed), hence @slow.

Why Adam's epsilon is raised here. Everything is float32, and the two runs differ only in the order
of float additions: a rank sums half of each micro-batch's per-token losses and gradients (a GEMM
with half the rows, so the CPU kernel blocks and rounds it differently), and DeepSpeed adds the two
halves (divided by 2, then multiplied back by the engine; both exact). So every gradient element
carries a rounding difference of about 2^-23 times the size of its summands. Adam's step,
lr * m / (sqrt(v) + eps), is scale-free: for an element whose true gradient is far below its
summands (one that nearly cancels) the step is ~lr * sign(g), and a last-bit difference in g can
flip or halve it. Measured (2026-11-25, sft on tiny-llama, torch backend, 3 steps): adding noise of
2^-23 x each tensor's gradient rms to every gradient moved a weight by 2.96e-5 with eps = 1e-8 (an
o_proj element whose first gradient was 3.5e-8 against the tensor's rms 7.3e-3; 125 elements moved
> 1e-6), and by 5.96e-8 (one ulp) with eps = 1e-3 (no element > 1e-6). So at torch's eps = 1e-8
the weights of a correct 2-rank run differ by whatever the machine's GEMM rounding happens to feed
those elements: 1.2e-7 (sft) and 1.1e-6 (ppo) on the development machines, 1.0e-5 and 1.4e-5 on a
fresh CI machine, as large as a real mistake (DeepSpeed's average over ranks not undone: 3.3e-5).

The weight check therefore runs Adam with eps = EPS = 1e-3 (`optim.eps`): an element with |g| << eps
steps lr * g / eps, linear in g, so a rounding difference d in g moves the weight by about
lr * d / eps <= 3e-3 * 1e-8 / 1e-3 ~ 3e-8, below one float32 ulp of the O(1) norm weights (1.19e-7).
What remains is rounding of the weights themselves: a few ulps of the largest weights (~1).

Measured with EPS (2026-11-25, a 2-core development machine; max |w_2ranks - w_1process|, and the
largest relative difference of a step's gradient norm):

| stage | ZeRO-2 weights | ZeRO-3 weights | ZeRO-2 grad norm | ZeRO-3 grad norm |
|---|---|---|---|---|
| sft | 1.19e-7 | 1.19e-7 | 1.7e-7 | 2.4e-8 |
| prm | 3.7e-9 | 3.7e-9 | 7.1e-8 | 9.3e-8 |
| prm, `head.kind: implicit` (measured 2026-11-26) | 7.5e-9 | 1.19e-7 | 1.7e-7 | 2.7e-7 |
| ppo | 6.0e-8 | 6.0e-8 | 8.9e-8 | 1.4e-8 |

and the documented mistakes (sft, ZeRO-2, the same EPS): DeepSpeed's average over ranks not undone
(the engine's `loss * world_size` removed) 1.17e-5; both ranks on rank 0's slice of each micro-batch
8.0e-3; one optimizer step missed on the ranks 8.6e-3. WEIGHT_TOL = 1e-6 (dp_helpers.py) is 8x the
largest correct run (one ulp of 1.0) and 12x below the smallest mistake; the in-process check of
test_rounding_noise.py shows a correct run stays inside it when the gradients carry another machine's
rounding.

Adam hides a gradient that is off by a constant factor (DeepSpeed's average over ranks not undone,
or the loss divided by each rank's own token count) whenever |g| >> eps, and gradient clipping hides
it too. So the gradient norm each step (logged to MLflow as train/grad_norm before clipping) is
compared as well, with a relative tolerance: a sum of squares over every element, whose rounding is
~1e-7 relative, while a factor-2 mistake is a relative 0.5 or 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dp_helpers import ARGS, EPS, WEIGHT_TOL, WEIGHTS, max_abs_diff, metric_history, run_cli, stage_runs, weights

pytestmark = pytest.mark.slow

GRAD_NORM_RTOL = 1e-5


@pytest.fixture(scope="module")
def ppo_inputs(tmp_path_factory) -> dict:
    """A tiny policy and an advantages hand-off of 16 responses scored by it (tests/ppo helpers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ppo"))
    from ppo_helpers import build_rows, write_advantages

    from prmflow.components.data import io
    from prmflow.components.models import modeling

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
            "engine.collective_timeout_s": 120, "optim.eps": EPS, "tracking.uri": f"sqlite:///{run_dir / 'mlflow.db'}"}


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("stage", ["sft", "prm", "prm-implicit", "ppo"])
def test_two_ranks_equal_one_process(stage, zero, tmp_path, request):
    ppo_inputs = request.getfixturevalue("ppo_inputs") if stage == "ppo" else {}
    cli = stage.split("-")[0]  # prm-implicit: the prm stage with head.kind=implicit
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    ref = run_cli(cli, _values(stage, zero, ppo_inputs, one, 1), one)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = run_cli(cli, _values(stage, zero, ppo_inputs, two, 2), two)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "starting 2 ranks" in got.stderr

    # the same weights, up to float reduction order (tolerance: module docstring)
    diff = max_abs_diff(weights(one / "out" / WEIGHTS[stage]), weights(two / "out" / WEIGHTS[stage]))
    print(f"{stage} ZeRO-{zero}: max |w_2ranks - w_1process| = {diff:.3g}")
    assert diff <= WEIGHT_TOL, f"{stage} ZeRO-{zero}: the 2-rank weights differ from one process's by {diff:.3g}"

    # exactly one committed output, with one manifest, and nothing half-written beside it
    assert sorted(p.name for p in two.iterdir() if p.name.startswith(".out") or p.name == "out") == ["out"]
    assert [p.relative_to(two).as_posix() for p in two.rglob("manifest.json")] == ["out/manifest.json"]
    assert (two / "out" / WEIGHTS[stage]).is_file()

    # one MLflow run for the stage, finished, from rank 0; its gradient norms are the 1-process ones
    runs2, runs1 = stage_runs(f"sqlite:///{two / 'mlflow.db'}", cli), stage_runs(f"sqlite:///{one / 'mlflow.db'}", cli)
    assert len(runs2) == 1 and len(runs1) == 1
    assert runs2[0].info.status == "FINISHED"
    g2 = metric_history(f"sqlite:///{two / 'mlflow.db'}", runs2[0].info.run_id, "train/grad_norm")
    g1 = metric_history(f"sqlite:///{one / 'mlflow.db'}", runs1[0].info.run_id, "train/grad_norm")
    assert len(g2) == len(g1) >= 2
    print(f"{stage} ZeRO-{zero}: max relative grad-norm difference = {max(abs(a - b) / b for a, b in zip(g2, g1)):.3g}")
    assert g2 == pytest.approx(g1, rel=GRAD_NORM_RTOL)
