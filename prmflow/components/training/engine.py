"""The training engine shared by sft, prm and ppo: DeepSpeed or plain PyTorch behind one API.

    engine = TrainEngine(model, cfg.engine, OptimSettings(lr=..., total_steps=..., ...), micro, grad_accum)
    for micro_batch in optimizer_step_batches:          # grad_accum of them
        loss = per_token_loss.sum() / tokens_in_whole_optimizer_step   # the caller's share
        engine.backward(loss)
    if engine.grads_finite():
        grad_norm = engine.step()      # clip, optimizer step, LR schedule, zero grads
    else:
        engine.discard()               # as if the step's micro-batches had never been seen

The caller scales each micro-batch loss as its share of the optimizer step's objective, so a
token-mean over the whole accumulated batch is exact (DeepSpeed's own 1/gas scaling is turned off).
The engine counts backward calls against grad_accum and tells DeepSpeed where the accumulation
boundary is, so a discarded step never leaves DeepSpeed's own micro-step count out of phase.
DeepSpeed runs ZeRO 0-3 (optionally with optimizer offload) and initializes torch.distributed with
gloo on CPU machines and nccl on GPUs; a single process needs no launcher. Both backends give the
same parameters and the same gradient norms up to floating-point noise (tests check this).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..runtime import distributed
from ...errors import ConfigError, ModelLoadError
from .optim import OptimConfig

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    """Training backend: DeepSpeed (ZeRO, offload, multi-GPU launch) or plain PyTorch (simplest, one process)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3: higher shards more state across GPUs, costs more communication."""
    offload_optimizer: bool = False
    """DeepSpeed: keep optimizer state in CPU memory (ZeRO >= 1); saves GPU memory, costs speed."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16: forward and backward in bf16, the optimizer on fp32 master weights (torch: autocast over
    fp32 parameters; DeepSpeed: bf16 parameters, fp32 master copy and gradients), so small updates are not lost. float32
    is exact and fine on CPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""
    nproc_per_node: int = 0
    """Data-parallel ranks on this machine: 0 = one per visible GPU (1 on CPU); N > 1 starts N ranks through
    torch.distributed.run (on CPU, N gloo processes). The result is one process's up to float rounding. Ignored under an
    outside torchrun."""
    collective_timeout_s: float = 900.0
    """Seconds a collective (gradient reduce, barrier, checkpoint) waits for the other ranks before the job fails:
    bounds the time a hung or dead rank can stall the others. Must cover the slowest checkpoint save."""

    def __post_init__(self):
        if self.nproc_per_node < 0:
            raise ConfigError(f"engine.nproc_per_node is {self.nproc_per_node}; use 0 (one rank per GPU) or a count.")
        if self.nproc_per_node > 1 and self.backend != "deepspeed":
            raise ConfigError(f"engine.nproc_per_node={self.nproc_per_node} needs engine.backend=deepspeed; the torch "
                              f"backend is one process.")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"engine.collective_timeout_s is {self.collective_timeout_s}; it must be positive.")
        if not 0 <= self.zero_stage <= 3:
            raise ConfigError(f"engine.zero_stage is {self.zero_stage}; DeepSpeed ZeRO stages are 0, 1, 2 or 3.")
        if self.offload_optimizer and (self.backend != "deepspeed" or self.zero_stage == 0):
            raise ConfigError("engine.offload_optimizer needs engine.backend=deepspeed and engine.zero_stage >= 1.")
        if self.backend == "deepspeed" and self.dtype == "bfloat16" and self.zero_stage == 0:
            # DeepSpeed without ZeRO refuses bf16 parameters with fp32 gradient accumulation (NotImplementedError
            # "unsupported mix"), and bf16 accumulation over grad_accum micro-batches loses the small gradients
            raise ConfigError("engine.dtype=bfloat16 with engine.backend=deepspeed needs engine.zero_stage >= 1 (fp32 master "
                              "weights and fp32 gradient accumulation); or use engine.backend=torch (autocast over fp32 "
                              "weights, one process).")


@dataclass
class OptimSettings:
    lr: float
    """Peak learning rate of AdamW."""
    total_steps: int
    """Optimizer steps the LR schedule spans (over a whole RL run for ppo, not just this process)."""
    warmup_steps: int = 0
    """Linear warm-up steps at the start of the schedule."""
    schedule: str = "cosine"
    """A transformers scheduler name: constant, constant_with_warmup, linear, cosine."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on norms and biases)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon (added to sqrt(v))."""
    start_step: int = 0
    """Steps of the schedule already taken by earlier runs (ppo iteration k starts at k x its updates)."""

    @classmethod
    def of(cls, optim: OptimConfig, total_steps: int, start_step: int = 0, lr: float | None = None) -> "OptimSettings":
        """The settings of a stage's `optim` section, for a schedule of `total_steps` (lr overrides optim.lr)."""
        return cls(lr=optim.lr if lr is None else lr, total_steps=total_steps, warmup_steps=optim.warmup_steps,
                   schedule=optim.lr_schedule, weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
                   eps=optim.eps, start_step=start_step)


def init_distributed(cfg: EngineConfig | None = None) -> None:
    """Join the process group (one process unless a launcher set RANK etc.), collectives timing out
    after cfg.collective_timeout_s."""
    distributed.init((cfg or EngineConfig()).collective_timeout_s)


#: The torch backend's moments (`save_optimizer`): tensors in safetensors, the rest (param_groups) in JSON.
MOMENTS_TENSORS, MOMENTS_REST, MOMENTS_LEGACY = "optimizer.safetensors", "optimizer.json", "optimizer.pt"


def save_moments(state_dict: dict, directory: Path) -> None:
    """An optimizer's state_dict as `optimizer.safetensors` (every tensor, named `<param index>.<key>`) and
    `optimizer.json` (param_groups and any non-tensor state). Why not torch.save: PPO writes and reads the
    moments (twice the trainable weights in float32) every RL iteration, and torch.save's zip runs a CRC32
    over every byte on write and again on read, then unpickles into fresh memory; safetensors is raw bytes
    behind a header (the timings: benchmarks/README.md, "prmflow vs TRL"). The output's manifest holds the
    file's sha256, as it does for the weights' safetensors."""
    from safetensors.torch import save_file

    tensors, rest = {}, {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest.setdefault(str(index), {})[key] = value
    save_file(tensors, str(directory / MOMENTS_TENSORS))
    (directory / MOMENTS_REST).write_text(json.dumps({"param_groups": state_dict["param_groups"], "state": rest}))


def load_moments(directory: Path) -> tuple[Path, dict]:
    """(the file read, the optimizer state_dict) that `save_moments` wrote, or an earlier `optimizer.pt`."""
    tensors = directory / MOMENTS_TENSORS
    if tensors.is_file() and (directory / MOMENTS_REST).is_file():
        from safetensors.torch import load_file

        meta = json.loads((directory / MOMENTS_REST).read_text())
        state: dict[int, dict] = {int(i): dict(v) for i, v in meta["state"].items()}
        for name, value in load_file(str(tensors)).items():  # memory-mapped: copied out, so the file is left alone
            index, key = name.split(".", 1)
            state.setdefault(int(index), {})[key] = value.clone()
        return tensors, {"state": state, "param_groups": meta["param_groups"]}
    legacy = directory / MOMENTS_LEGACY
    if legacy.is_file():
        return legacy, torch.load(legacy, weights_only=True)
    raise ModelLoadError(f"'{directory}' holds no optimizer state ({MOMENTS_TENSORS} with {MOMENTS_REST}, or "
                         f"{MOMENTS_LEGACY}); written by the deepspeed backend?")


def _rng_file() -> str:
    """rng.pt for one process (as before ranks existed), rng-RANK.pt for each of N ranks."""
    return "rng.pt" if distributed.world_size() == 1 else f"rng-{distributed.rank()}.pt"


class TrainEngine:
    """One model, its optimizer and LR schedule, stepped by DeepSpeed or plain PyTorch."""

    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, optim: OptimSettings, micro_batch_size: int = 1,
                 grad_accum: int = 1, params: list | None = None):
        from transformers import get_scheduler

        self.cfg = cfg
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
                       else torch.device("cpu"))
        if cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        model.to(self.device)
        # torch backend, bfloat16: the parameters stay (or become) fp32 master weights that AdamW updates; the
        # passes run under autocast in bf16. AdamW on bf16 weights would round an lr-1e-6 update away.
        self.autocast = cfg.backend == "torch" and cfg.dtype == "bfloat16"
        if self.autocast:
            model.float()
        trainable = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
        scheduler = get_scheduler(optim.schedule, optimizer, num_warmup_steps=optim.warmup_steps,
                                  num_training_steps=max(optim.total_steps, 1))
        self.max_grad_norm = optim.max_grad_norm
        self.grad_accum = grad_accum
        self._micro = 0
        self.trainable = trainable
        self.world_size = distributed.world_size() if cfg.backend == "deepspeed" else 1
        if cfg.backend == "deepspeed":
            import deepspeed

            init_distributed(cfg)
            ds_config = {
                "train_micro_batch_size_per_gpu": micro_batch_size,
                "gradient_accumulation_steps": grad_accum,
                "gradient_clipping": optim.max_grad_norm if optim.max_grad_norm > 0 else 0.0,
                "zero_optimization": {"stage": cfg.zero_stage},
                "bf16": {"enabled": cfg.dtype == "bfloat16"},
                # bf16 gradients summed over grad_accum micro-batches lose the small ones: accumulate in fp32
                # (ZeRO 1-3 keep fp32 master weights for the update either way)
                **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg.dtype == "bfloat16" else {}),
                "steps_per_print": 10**9,
                "wall_clock_breakdown": False,
            }
            if cfg.offload_optimizer:
                ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
                ds_config["zero_force_ds_cpu_optimizer"] = False  # keep our torch AdamW (same math on every backend)
            self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                model_parameters=None, dist_init_required=False,
            )
        else:
            if distributed.world_size() > 1:
                raise ConfigError(f"{distributed.world_size()} ranks need engine.backend=deepspeed; the torch backend "
                                  f"is one process.")
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        with warnings.catch_warnings():  # stepping a scheduler before its optimizer is what we mean here
            warnings.simplefilter("ignore")
            for _ in range(optim.start_step):
                self.scheduler.step()

    @property
    def module(self) -> torch.nn.Module:
        """The bare model (what to save, generate with, or evaluate)."""
        return getattr(self.model, "module", self.model)

    def __call__(self, *args, **kwargs):
        if self.autocast:  # bf16 compute over the fp32 master weights; backward follows the same casts
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (already scaled by the caller as its share of the step).

        The grad_accum-th call since the last step() or discard() is the accumulation boundary
        (DeepSpeed reduces gradients there); the optimizer steps only in step(), so the gradients
        can be checked in between.
        """
        boundary = self._micro + 1 == self.grad_accum
        if self.cfg.backend == "deepspeed":
            self.model.set_gradient_accumulation_boundary(boundary)
            # DeepSpeed averages the ranks' gradients; each rank's loss is its share of the global sum, so
            # scaling by the rank count makes the average the gradient of the global objective
            self.model.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)
            if not boundary:
                self.model.step()  # a micro-step: DeepSpeed expects one step() per backward
        else:
            loss.backward()
        self._micro += 1

    def grads_finite(self) -> bool:
        """Whether the gradients accumulated so far are all finite (call before step()).

        It reads the gradients where they live as `p.grad` (torch, DeepSpeed ZeRO-0). ZeRO 1-3 keep
        the reduced gradients in their own partitions, where this sees none and returns True: there
        the caller's check that every loss is finite before backward is the guard.
        """
        norm = self._grad_norm()
        return norm is None or bool(torch.isfinite(norm))

    def step(self) -> float:
        """Finish the optimizer step after `grad_accum` backward calls; returns the gradient norm
        before clipping (the same number on every backend)."""
        if self._micro != self.grad_accum:
            raise RuntimeError(f"step() after {self._micro} backward calls; expected grad_accum={self.grad_accum}")
        self._micro = 0
        if self.cfg.backend == "deepspeed":
            own = self._grad_norm()  # ZeRO-0 in fp32 clips p.grad without recording the norm
            self.model.step()
            norm = self.model.get_global_grad_norm()
            norm = norm if norm is not None else own
            return float(norm) if norm is not None else float("nan")
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        else:
            norm = self._grad_norm()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def discard(self) -> None:
        """Drop the gradients accumulated since the last step, with no optimizer or LR-schedule step
        (a loss or gradient was NaN/inf): the parameters, moments and schedule are as if the
        discarded micro-batches had never been seen."""
        self._micro = 0
        if self.cfg.backend == "deepspeed":
            self.model.zero_grad()
            opt = self.model.optimizer
            if hasattr(opt, "bit16_groups"):  # ZeRO 1/2 keep their own accumulators
                opt.zero_grad(set_to_none=True)
                if isinstance(getattr(opt, "all_grad_tensors", None), dict):
                    opt.all_grad_tensors.clear()
            elif hasattr(opt, "zero_grad"):
                opt.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def gathered(self) -> contextlib.AbstractContextManager:
        """Context in which `module`'s parameters are whole, to read or save them (ZeRO-3 partitions
        them across ranks; elsewhere they already are)."""
        if self.cfg.backend == "deepspeed" and self.cfg.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def _grad_norm(self) -> torch.Tensor | None:
        """2-norm of the gradients held in `p.grad` of the trainable parameters; None when there are none."""
        grads = [p.grad for p in self.trainable if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) if grads else None

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # --- resume state -------------------------------------------------------------------------

    def save_state(self, directory: Path, trainer_state: dict) -> None:
        """Optimizer, LR schedule, RNG and `trainer_state` (step, consumed samples...) for an exact resume."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
               "python_pos": random.getstate()[2]}
        torch.save(rng, directory / _rng_file())  # each rank's own generators
        if self.cfg.backend == "deepspeed":
            # collective: every rank writes its ZeRO partition into the same (shared) directory
            self.model.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)
        else:
            from safetensors.torch import save_file

            names = {id(p): n for n, p in self.module.named_parameters()}
            save_file({names[id(p)]: p.detach().cpu().contiguous() for p in self.trainable},
                      str(directory / "trainable.safetensors"))
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       directory / "optimizer.pt")
        if distributed.is_main():
            (directory / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))

    def save_optimizer(self, directory: Path) -> None:
        """Only the optimizer's moments (no schedule, no RNG): what a following run continues from."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.cfg.backend == "deepspeed":
            # DeepSpeed keeps the moments in its own (possibly partitioned) layout: its checkpoint is the format
            self.model.save_checkpoint(str(directory / "deepspeed"), tag="moments", save_latest=False)
        else:
            save_moments(self.optimizer.state_dict(), directory)

    def load_optimizer(self, directory: Path) -> None:
        """Continue from the moments `save_optimizer` wrote (for the same parameters, on the same backend)."""
        directory = Path(directory)
        if self.cfg.backend == "deepspeed":
            if not (directory / "deepspeed").is_dir():
                raise ModelLoadError(f"'{directory}' holds no DeepSpeed optimizer state (written by another backend?).")
            # the weights in that checkpoint are the ones the model was loaded with (the same run's output)
            self.model.load_checkpoint(str(directory / "deepspeed"), tag="moments", load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
        else:
            path, state = load_moments(directory)
            shapes = [tuple(p.shape) for g in self.optimizer.param_groups for p in g["params"]]
            sizes = [len(g["params"]) for g in state["param_groups"]]
            wrong = sizes != [len(g["params"]) for g in self.optimizer.param_groups] or any(
                int(i) >= len(shapes) or tuple(v["exp_avg"].shape) != shapes[int(i)] for i, v in state["state"].items())
            if wrong:
                raise ModelLoadError(f"optimizer state '{path}' is for other parameters than this model's trainable "
                                     f"ones; leave optimizer_state empty to start a fresh optimizer.")
            # keep this run's hyper-parameters (lr, weight decay): only the moments and step counts carry over
            groups = [{**saved_g, **{k: v for k, v in g.items() if k != "params"}}
                      for saved_g, g in zip(state["param_groups"], self.optimizer.param_groups)]
            self.optimizer.load_state_dict({"state": state["state"], "param_groups": groups})

    def load_state(self, directory: Path) -> dict:
        """Restore what `save_state` wrote (model weights too, for DeepSpeed); returns trainer_state."""
        directory = Path(directory)
        if self.cfg.backend == "deepspeed":
            self.model.load_checkpoint(str(directory / "deepspeed"), tag="state")
        else:
            from safetensors.torch import load_file

            weights = load_file(str(directory / "trainable.safetensors"))
            params = dict(self.module.named_parameters())
            with torch.no_grad():
                for name, value in weights.items():
                    params[name].copy_(value)
            state = torch.load(directory / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        rng_path = directory / _rng_file()
        if not rng_path.is_file():
            raise ModelLoadError(f"resume state '{directory}' has no {rng_path.name}: it was written by another number "
                                 f"of ranks; resume with the same engine.nproc_per_node, or delete it to start over.")
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["torch"])
        random.setstate((3, tuple(rng["python"]), rng["python_pos"]))
        return json.loads((directory / "trainer_state.json").read_text())
