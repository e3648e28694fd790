"""The data-parallel equivalence check holds on a machine that rounds differently (tests/distributed/
test_data_parallel.py, module docstring): a correct run whose gradients differ from the reference's
by one float32 rounding stays within WEIGHT_TOL when Adam's epsilon is EPS, while at torch's default
epsilon the same noise moves weights as far as a real mistake does.

"Another machine" is simulated here, in one process: the second run adds 2^-23 times each tensor's
gradient rms (one rounding of a typical summand) to every gradient element before each optimizer
step, which is what a different GEMM blocking does to a sum of that size.
"""

from __future__ import annotations

import pytest
import torch
from dp_helpers import ARGS, EPS, WEIGHT_TOL, max_abs_diff, weights

from prmflow.components import config
from prmflow.components.training import engine as engine_lib
from prmflow.components.sft import stage

#: The smallest documented mistake of a 2-rank run (DeepSpeed's average over ranks not undone), in weights.
SMALLEST_BREAK = 1e-5


def sft_weights(out, eps: float, noisy: bool, monkeypatch) -> dict:
    step = engine_lib.TrainEngine.step

    def perturbed_step(self):
        gen = torch.Generator().manual_seed(1234)
        for p in self.trainable:
            if p.grad is not None:
                p.grad.add_(torch.randn(p.grad.shape, generator=gen).to(p.grad.device) * p.grad.pow(2).mean().sqrt() * 2.0**-23)
        return step(self)

    with monkeypatch.context() as m:
        if noisy:
            m.setattr(engine_lib.TrainEngine, "step", perturbed_step)
        stage.run(config.load(stage.Config, overrides={
            **ARGS["sft"], "engine.backend": "torch", "tracking.enabled": False, "optim.eps": eps, "output": str(out)}))
    return weights(out / "model.safetensors")


@pytest.mark.parametrize("eps", [EPS, 1e-8], ids=["eps-of-the-check", "torch-default-eps"])
def test_last_bit_gradient_noise_and_adam_epsilon(tmp_path, monkeypatch, eps):
    diff = max_abs_diff(sft_weights(tmp_path / "ref", eps, False, monkeypatch),
                        sft_weights(tmp_path / "noisy", eps, True, monkeypatch))
    print(f"eps={eps:g}: max |w_noisy - w| = {diff:.3g}")
    if eps == EPS:
        assert diff <= WEIGHT_TOL  # a correct run on any machine passes the check
    else:
        assert diff > SMALLEST_BREAK / 10  # why the check does not use torch's eps: noise as large as a mistake
