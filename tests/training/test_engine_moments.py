"""Optimizer moments carried from one run to the next (what PPO does between RL iterations).

Reference: one engine that trains 4 steps without stopping. Two runs of 2 steps each, the second
loading the first's saved weights and moments, must land on the same parameters; a second run that
starts a fresh optimizer must not (its first Adam step is a sign-like step of size lr).
"""

import pytest
import torch

from prmflow.components.models import modeling
from prmflow.components.training.engine import EngineConfig, OptimSettings, TrainEngine
from prmflow.errors import ModelLoadError


#: where TrainEngine puts a one-process model (cuda:0 on a GPU machine)
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 40, (4, 12), generator=g).to(DEVICE) for _ in range(4)]


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


@pytest.mark.parametrize("legacy", [False, True])
def test_saved_moments_load_back_to_the_same_optimizer_state(tmp_path, legacy):
    """save_optimizer's files (and an optimizer.pt that earlier releases wrote with torch.save) give back the
    optimizer's state_dict exactly: every moment, step count and param group entry."""
    engine = _engine(modeling.build_tiny_model("tiny-llama", seed=0)[0], "torch")
    _train(engine, _batches()[:2])
    saved = engine.optimizer.state_dict()
    (tmp_path / "moments").mkdir()
    if legacy:
        torch.save(saved, tmp_path / "moments" / "optimizer.pt")
    else:
        engine.save_optimizer(tmp_path / "moments")
    other = _engine(modeling.build_tiny_model("tiny-llama", seed=1)[0], "torch")
    other.load_optimizer(tmp_path / "moments")
    loaded = other.optimizer.state_dict()
    plain = lambda groups: [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]  # noqa: E731
    assert plain(loaded["param_groups"]) == plain(saved["param_groups"])
    assert sorted(loaded["state"]) == sorted(saved["state"]) and len(saved["state"]) > 0
    for i, entries in saved["state"].items():
        assert sorted(loaded["state"][i]) == sorted(entries)
        for key, value in entries.items():
            torch.testing.assert_close(loaded["state"][i][key], value, rtol=0, atol=0, msg=f"{i}.{key}")


def test_moments_of_another_model_are_refused(tmp_path):
    small = _engine(modeling.build_tiny_model("tiny-llama", seed=0)[0], "torch")
    _train(small, _batches()[:1])
    small.save_optimizer(tmp_path / "moments")
    other = _engine(modeling.build_tiny_model("tiny-llama", seed=0, num_hidden_layers=2)[0], "torch")
    with pytest.raises(ModelLoadError, match="other parameters"):
        other.load_optimizer(tmp_path / "moments")
    with pytest.raises(ModelLoadError, match="no optimizer state"):
        other.load_optimizer(tmp_path / "nowhere")


# --- the step's gradient norm and a discarded step, on every backend -------------------------------

BACKENDS = [("torch", 0), ("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]


def _accumulate(engine: TrainEngine, batches) -> None:
    """One optimizer step's backward calls: each micro-batch's loss as its share of the step."""
    for ids in batches:
        engine.backward(engine(input_ids=ids, labels=ids).loss / len(batches))


@pytest.mark.parametrize("backend,zero", BACKENDS[1:])
def test_grad_norm_equals_the_torch_backends(backend, zero):
    """The pre-clip gradient norm of one step of two micro-batches: ZeRO-0 included (DeepSpeed does not
    report one there; the engine computes it), independent of the backend."""
    norms = {}
    for key in (("torch", 0), (backend, zero)):
        engine = TrainEngine(modeling.build_tiny_model("tiny-llama", seed=0)[0], EngineConfig(*key),
                             OptimSettings(lr=1e-2, total_steps=4, max_grad_norm=0.5), micro_batch_size=4, grad_accum=2)
        engine.train()
        _accumulate(engine, _batches()[:2])
        norms[key] = engine.step()
    assert norms[(backend, zero)] == pytest.approx(norms[("torch", 0)], rel=1e-5)
    assert norms[("torch", 0)] > 0.5  # clipping was active: the norm is the one before clipping


@pytest.mark.parametrize("backend,zero", BACKENDS)
def test_discarded_step_leaves_no_trace(backend, zero):
    """discard() after a micro-batch (and, where the gradients are visible, after a whole step whose
    gradient is NaN although its loss is finite): the next steps land where they land without it."""
    def run(discard: bool) -> dict[str, torch.Tensor]:
        engine = TrainEngine(modeling.build_tiny_model("tiny-llama", seed=0)[0], EngineConfig(backend, zero),
                             OptimSettings(lr=1e-2, total_steps=4, schedule="linear"), micro_batch_size=4, grad_accum=2)
        engine.train()
        batches = _batches()
        if discard:
            engine.backward(engine(input_ids=batches[3], labels=batches[3]).loss)  # half a step, then dropped
            engine.discard()
            if zero == 0:  # ZeRO-0 and torch keep p.grad: a finite loss with a NaN gradient is caught
                p = next(q for q in engine.module.parameters() if q.requires_grad)
                for _ in range(2):
                    engine.backward(torch.sqrt((p - p.detach()).abs()).sum())  # value 0, gradient NaN
                assert not engine.grads_finite()
                engine.discard()
        for k in range(2):
            _accumulate(engine, batches[2 * k:2 * k + 2])
            assert engine.grads_finite()
            engine.step()
        assert engine.lr == pytest.approx(1e-2 * 2 / 4)  # the schedule took exactly the two real steps
        with engine.gathered():
            return _params(engine)

    with_discard, without = run(True), run(False)
    for name, value in without.items():
        torch.testing.assert_close(with_discard[name], value, rtol=0, atol=0, msg=name)
