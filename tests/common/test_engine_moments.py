"""Optimizer moments carried from one run to the next (what PPO does between RL iterations).

Reference: one engine that trains 4 steps without stopping. Two runs of 2 steps each, the second
loading the first's saved weights and moments, must land on the same parameters; a second run that
starts a fresh optimizer must not (its first Adam step is a sign-like step of size lr).
"""

import pytest
import torch

from prmflow.components.common import modeling
from prmflow.components.common.engine import EngineConfig, OptimSettings, TrainEngine
from prmflow.components.common.errors import ModelLoadError


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 40, (4, 12), generator=g) for _ in range(4)]


def _engine(model, backend: str, zero: int = 0) -> TrainEngine:
    optim = OptimSettings(lr=1e-2, total_steps=4, schedule="constant", weight_decay=0.1)
    return TrainEngine(model, EngineConfig(backend=backend, zero_stage=zero), optim, micro_batch_size=4, grad_accum=1)


def _train(engine: TrainEngine, batches) -> None:
    engine.train()
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()


def _params(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("backend,zero", [("torch", 0), ("deepspeed", 1)])
def test_continuing_the_moments_equals_one_uninterrupted_run(tmp_path, backend, zero):
    batches = _batches()
    whole = _engine(modeling.build_tiny_model("tiny-llama", seed=0)[0], backend, zero)
    _train(whole, batches)
    expected = _params(whole)

    first = _engine(modeling.build_tiny_model("tiny-llama", seed=0)[0], backend, zero)
    _train(first, batches[:2])
    first.save_optimizer(tmp_path / "moments")
    halfway = {n: p.detach().clone() for n, p in first.module.named_parameters()}

    def second_run(carry: bool) -> dict[str, torch.Tensor]:
        model = modeling.build_tiny_model("tiny-llama", seed=0)[0]
        with torch.no_grad():  # the weights the first run wrote (its output policy)
            for n, p in model.named_parameters():
                p.copy_(halfway[n])
        engine = _engine(model, backend, zero)
        if carry:
            engine.load_optimizer(tmp_path / "moments")
        _train(engine, batches[2:])
        return _params(engine)

    continued, restarted = second_run(True), second_run(False)
    for name, value in expected.items():
        torch.testing.assert_close(continued[name], value, rtol=1e-5, atol=1e-6, msg=name)
    gap = max((restarted[n] - expected[n]).abs().max().item() for n in expected)
    assert gap > 1e-3  # a fresh optimizer really is a different trajectory (so the check above means something)


def test_moments_of_another_model_are_refused(tmp_path):
    small = _engine(modeling.build_tiny_model("tiny-llama", seed=0)[0], "torch")
    _train(small, _batches()[:1])
    small.save_optimizer(tmp_path / "moments")
    other = _engine(modeling.build_tiny_model("tiny-llama", seed=0, num_hidden_layers=2)[0], "torch")
    with pytest.raises(ModelLoadError, match="other parameters"):
        other.load_optimizer(tmp_path / "moments")
    with pytest.raises(ModelLoadError, match="no optimizer.pt"):
        other.load_optimizer(tmp_path / "nowhere")
