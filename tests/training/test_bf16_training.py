"""bfloat16 training keeps fp32 master weights, so an lr-1e-6 step moves the weights as it does in fp32.

bf16 has an 8-bit mantissa: a weight of 0.02 moves only in steps of ~1.5e-4, so AdamW applied to bf16
weights rounds an lr-1e-6 update (Adam's first step is ~lr per weight) away for almost every weight.
Reference: the same step in float32 on the torch backend. The torch backend in bf16 (autocast over
fp32 parameters) and DeepSpeed ZeRO-1/2/3 in bf16 (fp32 master copy, fp32 gradient accumulation; all
run on CPU here) must move their master weights as the reference does.
"""

import pytest
import torch

from prmflow.components.models import modeling
from prmflow.components.training.engine import EngineConfig, OptimSettings, TrainEngine
from prmflow.errors import ConfigError

LR = 1e-6


#: where TrainEngine puts a one-process model (cuda:0 on a GPU machine)
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 40, (4, 12), generator=g).to(DEVICE) for _ in range(2)]


def _step(backend: str, zero: int, dtype: str) -> tuple[dict, dict, TrainEngine]:
    """One optimizer step of two micro-batches; (master weights before, after, the engine)."""
    model = modeling.build_tiny_model("tiny-llama", seed=0)[0]
    if dtype == "bfloat16":
        model.to(torch.bfloat16)  # as the stages load it (modeling.load_causal_lm(path, "bfloat16"))
    engine = TrainEngine(model, EngineConfig(backend=backend, zero_stage=zero, dtype=dtype),
                         OptimSettings(lr=LR, total_steps=4, schedule="constant"), micro_batch_size=4, grad_accum=2)
    before = _masters(engine)
    engine.train()
    for ids in _batches():
        engine.backward(engine(input_ids=ids, labels=ids).loss / 2)
    engine.step()
    return before, _masters(engine), engine


def _masters(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """The weights the optimizer updates: DeepSpeed's fp32 copies, else the parameters themselves."""
    if engine.cfg.backend == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def fp32_update():
    before, after, _ = _step("torch", 0, "float32")
    return {n: after[n] - before[n] for n in before}


@pytest.mark.parametrize("backend,zero", [("torch", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)])
def test_a_bf16_step_at_lr_1e6_moves_the_master_weights_as_fp32_does(backend, zero, fp32_update):
    before, after, engine = _step(backend, zero, "bfloat16")
    update = {n: after[n] - before[n] for n in before}
    total = sum(u.numel() for u in fp32_update.values())
    moved = sum(int((update[n] != 0).sum()) for n in update)
    close = sum(int(((update[n] - fp32_update[n]).abs() <= 0.1 * LR).sum()) for n in update)
    assert moved / total > 0.99  # AdamW on bf16 weights: ~2% of the weights move at all
    assert close / total > 0.97  # the rest: gradients within bf16 noise of zero whose sign flipped
    assert all(p.dtype == torch.float32 for p in after.values())
    if backend == "deepspeed":  # bf16 parameters, gradients accumulated over micro-batches in fp32
        assert engine.model.get_data_types() == (torch.bfloat16, torch.float32)
    else:
        assert all(p.dtype == torch.float32 for p in engine.module.parameters())


def test_deepspeed_bf16_without_zero_is_refused():
    """DeepSpeed's ZeRO-0 has no fp32 gradient accumulation for bf16 parameters (it raises NotImplementedError)."""
    with pytest.raises(ConfigError, match=r"engine.dtype=bfloat16 with engine.backend=deepspeed needs engine.zero_stage >= 1"):
        EngineConfig(backend="deepspeed", zero_stage=0, dtype="bfloat16")
    EngineConfig(backend="torch", dtype="bfloat16")
