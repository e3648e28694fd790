"""PPO update: train the policy (and optionally a critic) on one batch of rollouts with advantages.

    prmflow ppo --policy_path outputs/sft --advantages outputs/advantages-0 --output outputs/ppo-0
    prmflow ppo --config configs/quickstart-cpu.yaml --set iteration=3 --set kl_state=outputs/ppo-2
    prmflow ppo ... --critic true --critic_warmup_updates 4 --engine.zero_stage 2    # GAE

Reads an advantages hand-off (prompt_ids, response_ids, old_logprobs, advantages; returns/values
for the critic, ref_logprobs for a KL loss). Writes OUTPUT/policy (HF), OUTPUT/critic (HF, with
--critic), OUTPUT/policy_ema (with ema_decay), OUTPUT/kl_state.json (the KL coefficient for the
next iteration) and OUTPUT/updates.jsonl (one line of metrics per update), atomically.

Choices: `epochs` passes over the batch, each cut into shuffled minibatches of `minibatch_size`
responses (one optimizer update each), each minibatch cut into micro-batches whose losses are
their exact shares of the minibatch loss (gradient accumulation changes nothing but memory).
Log-probabilities of the response tokens are recomputed under the current policy in every
micro-batch; the ratio's denominator is the hand-off's old_logprobs (or a recompute with
recompute_old_logprobs). Clipped surrogate with separate low/high clip and optional dual clip;
aggregation token-mean (default), seq-mean-token-mean or Dr. GRPO; entropy bonus; KL loss to the
reference (k1/k2/k3); SFT (ptx) loss; advantage clamp; top-entropy token mask. Critic: a scalar-head
model with a clipped value loss, its own optimizer, and a warm-up where only it trains. A NaN/inf
loss (or gradient) skips the whole update and is counted; if every update is skipped the stage fails.
Prompts are left-padded and responses right-padded, so the logits of the response positions are a
single slice (the LM head never runs on prompt positions). Dropout is turned off (it would make the
ratio differ from 1 without any update). Resume: `.OUTPUT.work/latest` holds both engines' state;
on SIGTERM the update in progress finishes, the checkpoint is saved and the process exits 143. A
finished output with the same config and the same input fingerprints is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..common import checkpoint, config as config_lib, io, modeling, preemption, schema, tasks, tracking, vision
from ..common.engine import EngineConfig, OptimSettings, TrainEngine
from ..common.errors import ConfigError, DataError, ModelLoadError, PrmflowError
from ..common.tasks.arithmetic import ArithmeticConfig
from ..common.tensor_ops import entropy_from_logits, masked_sum, token_logprobs
from . import kl_control, losses

log = logging.getLogger(__name__)


class TrainingDivergedError(PrmflowError):
    """Every update of the run had a NaN/inf loss or gradient."""


@dataclass
class Config:
    policy_path: str = "outputs/sft"
    """Policy that generated the batch (HF dir); it is trained and written to OUTPUT/policy."""
    advantages: str = "outputs/advantages"
    """Advantages hand-off directory (the advantage stage's output; a parent of shard dirs works too)."""
    output: str = "outputs/ppo"
    """Output directory: policy/, critic/, policy_ema/, kl_state.json, updates.jsonl (written atomically)."""
    iteration: int = 0
    """RL iteration k: tags the MLflow run, seeds the minibatch order, positions the LR schedule."""
    seed: int = 0
    """Seed of the minibatch order and the ptx data order."""
    epochs: int = 2
    """Passes over the batch (PPO epochs); each pass reshuffles the minibatches. More reuse, more drift."""
    minibatch_size: int = 32
    """Responses per optimizer update; each epoch has floor(N / minibatch_size) updates (a remainder sits out)."""
    micro_batch_size: int = 8
    """Responses per forward/backward; must divide minibatch_size. Only memory changes with it."""
    lr: float = 1e-4
    """Policy learning rate (tiny CPU models; use ~1e-6 for billion-parameter models)."""
    lr_schedule: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    """LR schedule over the whole RL run (rl_iterations x updates per iteration)."""
    warmup_updates: int = 0
    """Linear LR warm-up, in updates counted over the whole RL run."""
    rl_iterations: int = 1
    """RL iterations the LR schedule spans; this run starts at iteration x its number of updates."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on norms and biases)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm of each model to this (0 = off)."""
    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + clip_eps_high (DAPO's clip-higher uses 0.28 to keep exploring)."""
    dual_clip: float = 0.0
    """Dual clip c > 1 bounds the loss of negative-advantage tokens at -c*A when the ratio exceeds c (0 = off)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number: over all tokens, per sequence then over sequences, or Dr. GRPO."""
    drgrpo_max_len: int = 0
    """Dr. GRPO's constant length (set it to the generation budget); 0 = the longest response of the batch."""
    advantage_clip: float = 0.0
    """Clamp advantages to [-advantage_clip, advantage_clip] (0 = off); guards against outlier rewards."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy); costs a softmax over the vocabulary with gradient."""
    kl_loss_coef: float = 0.0
    """KL loss to the reference model (GRPO style; needs ref_logprobs); 0 = KL only in the reward."""
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL loss: k1 = x, k2 = x^2/2, k3 = exp(-x)-1+x with x = logp - ref_logp."""
    top_entropy_frac: float = 1.0
    """Policy loss only on this fraction of the batch's highest-entropy tokens (Wang et al. 2025 use 0.2; 1 = all)."""
    recompute_old_logprobs: bool = False
    """Recompute old_logprobs with this stage's engine instead of trusting the hand-off (one extra forward pass)."""
    ptx_coef: float = 0.0
    """Coefficient of an SFT (ptx) loss on reference solutions, added to every policy update (0 = off)."""
    ptx_task: str = "arithmetic"
    """Supervised data for the ptx loss: 'arithmetic' (reference solutions) or a .jsonl/.parquet with responses."""
    ptx_batch_size: int = 16
    """Supervised examples per update for the ptx loss (at least minibatch_size / micro_batch_size)."""
    ptx_size: int = 2000
    """Supervised examples drawn from ptx_task."""
    max_seq_len: int = 256
    """Supervised (ptx) examples longer than this are dropped."""
    chat_template: bool = True
    """Wrap ptx prompts in the tokenizer's chat template when it has one (as sft does)."""
    critic: bool = False
    """Train a value model (needed by GAE advantages); reads 'returns' (and 'values' as V_old) from the batch."""
    critic_path: str = ""
    """Critic to continue training (the previous iteration's OUTPUT/critic); empty = a new one from critic_init."""
    critic_init: Literal["policy", "prm"] = "policy"
    """Backbone of a new critic: the policy (policy_path) or the PRM (prm_path); its value head starts at 0."""
    prm_path: str = ""
    """PRM directory, for critic_init=prm."""
    critic_lr: float = 1e-3
    """Critic learning rate (tiny CPU models; ~1e-5 for billion-parameter models)."""
    value_clip: float = 0.2
    """Value clipping: V may move at most this far from V_old before its error stops counting (0 = off)."""
    critic_warmup_updates: int = 0
    """The first updates of this run train only the critic (actor frozen); use it while a new critic is meaningless."""
    kl_control: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient of the reward: fixed, or adapted toward kl_target (Ziegler et al. 2019)."""
    kl_coef: float = 0.0
    """KL coefficient beta of this batch's rewards when neither the advantages manifest (kl_coef_used) nor kl_state says."""
    kl_target: float = 6.0
    """Adaptive control: target KL per response (nats, summed over its tokens)."""
    kl_horizon: int = 10000
    """Adaptive control: responses over which beta may change by at most 20% per unit of error."""
    kl_state: str = ""
    """Previous iteration's ppo output (or its kl_state.json), read when the advantages manifest lacks kl_coef_used."""
    optimizer_state: str = ""
    """Optimizer moments to continue from: the previous iteration's OUTPUT/optimizer, so the RL iterations train as one long run. Empty = a fresh optimizer, whose first bias-corrected updates are sign-like steps of size lr on every parameter (noisy when an iteration has few updates)."""
    save_optimizer: bool = True
    """Write the optimizer moments to OUTPUT/optimizer for the next iteration (costs 2x the trainable parameters in fp32 on disk; turn off for very large models)."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the policy weights (e.g. 0.99) and write it to OUTPUT/policy_ema (0 = off)."""
    save_every: int = 0
    """Write a resume checkpoint every this many updates (0 = never)."""
    resume: bool = True
    """Continue from the checkpoint beside the output when one with the same config exists."""
    overwrite: bool = False
    """Replace an existing output written with a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the arithmetic task (for ptx_task=arithmetic)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend (policy and critic alike)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes of the policy kept frozen (e.g. model.vision_tower, as the SFT warm-up froze them)."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("epochs", "minibatch_size", "micro_batch_size", "rl_iterations", "kl_horizon", "ptx_batch_size",
                    "ptx_size", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.minibatch_size % self.micro_batch_size:
            raise ConfigError(f"micro_batch_size ({self.micro_batch_size}) must divide minibatch_size "
                              f"({self.minibatch_size}); e.g. set micro_batch_size to a divisor of it.")
        for key in ("lr", "critic_lr"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be positive.")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ConfigError(f"clip_eps_low must be in [0, 1) and clip_eps_high >= 0 (got {self.clip_eps_low}, "
                              f"{self.clip_eps_high}).")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip is {self.dual_clip}; use 0 (off) or a bound c > 1 (3.0 is usual).")
        if not 0 < self.top_entropy_frac <= 1:
            raise ConfigError(f"top_entropy_frac is {self.top_entropy_frac}; it must be in (0, 1].")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"ema_decay is {self.ema_decay}; use 0 (off) or a decay in (0, 1).")
        for key in ("advantage_clip", "entropy_coef", "kl_loss_coef", "ptx_coef", "value_clip", "kl_coef",
                    "critic_warmup_updates", "warmup_updates", "save_every", "drgrpo_max_len", "iteration"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must not be negative.")
        if self.kl_target <= 0:
            raise ConfigError(f"kl_target is {self.kl_target}; it must be positive.")
        if self.critic_warmup_updates and not self.critic:
            raise ConfigError("critic_warmup_updates needs critic=true (only a critic can train while the actor is frozen).")
        if self.critic and self.critic_init == "prm" and not self.critic_path and not self.prm_path:
            raise ConfigError("critic_init=prm needs prm_path (the PRM directory), or set critic_init=policy.")
        if self.lr_schedule != "constant" and self.iteration >= self.rl_iterations:
            raise ConfigError(f"iteration ({self.iteration}) is past the end of the LR schedule (rl_iterations="
                              f"{self.rl_iterations}); raise rl_iterations or use lr_schedule=constant.")
        if self.ptx_coef and self.ptx_batch_size < self.minibatch_size // self.micro_batch_size:
            raise ConfigError(f"ptx_batch_size ({self.ptx_batch_size}) must be at least the number of micro-batches "
                              f"per update ({self.minibatch_size // self.micro_batch_size}).")


# --- the batch ------------------------------------------------------------------------------

#: Per-token columns of the hand-off this stage may read, aligned with response_ids.
TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "returns", "values")


def _needed_columns(cfg: Config) -> list[str]:
    need = ["prompt_ids", "response_ids", "advantages"]
    need += [] if cfg.recompute_old_logprobs else ["old_logprobs"]
    need += ["returns"] if cfg.critic else []
    need += ["ref_logprobs"] if cfg.kl_loss_coef else []
    return need


def load_batch(cfg: Config) -> list[dict]:
    """The advantages hand-off as one dict per response: prompt_ids, response_ids and per-token lists."""
    table = schema.open_dataset(cfg.advantages, "advantages").read()
    if table.num_rows == 0:
        raise DataError(f"'{cfg.advantages}' holds no rows; the ppo stage needs at least "
                        f"minibatch_size={cfg.minibatch_size}.")
    for name in _needed_columns(cfg):
        col = table.column(name)
        if col.null_count:
            first = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
            why = {"returns": " (critic=true needs GAE returns)", "ref_logprobs": " (kl_loss_coef > 0 needs them)",
                   "old_logprobs": " (or set recompute_old_logprobs=true)"}.get(name, "")
            raise DataError(f"'{cfg.advantages}': column '{name}' is null in row {first} (prompt_id="
                            f"{table.column('prompt_id')[first].as_py()!r}){why}.")
    cols = {name: table.column(name).to_pylist() for name in ("prompt_ids", "response_ids", *TOKEN_FIELDS, "kl", "images")}
    rows = [{name: cols[name][i] for name in cols} for i in range(table.num_rows)]
    for i, r in enumerate(rows):
        if not r["prompt_ids"]:
            raise DataError(f"'{cfg.advantages}': row {i} has empty prompt_ids; the first response token needs a prompt.")
    return rows


@dataclass
class MicroBatch:
    """Prompts left-padded, responses right-padded: response token t of every row sits at column P + t."""

    input_ids: torch.Tensor      # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor   # (B, P + R), following the attention mask
    response_ids: torch.Tensor   # (B, R)
    mask: torch.Tensor           # (B, R) bool: real response tokens
    fields: dict[str, torch.Tensor]  # (B, R) float per-token columns, 0 where masked
    rows: list[int]
    pixels: dict[str, torch.Tensor] = field(default_factory=dict)  # the prompts' images (vision-language)

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "MicroBatch":
        move = lambda t: t.to(device)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                          move(self.response_ids), move(self.mask), {k: move(v) for k, v in self.fields.items()}, self.rows,
                          {k: move(v) for k, v in self.pixels.items()})

    def model_kwargs(self, model) -> dict:
        """What the forward pass takes besides ids and mask: 1-D positions (unless the model places
        its tokens itself, Qwen2-VL's multimodal rope) and the pixel inputs."""
        pos = {} if vision.own_positions(model) else {"position_ids": self.position_ids}
        return {**pos, **self.pixels}


def collate(samples: list[dict], rows: list[int], pad_id: int, fields=TOKEN_FIELDS + ("pg_mask",)) -> MicroBatch:
    P = max(len(samples[i]["prompt_ids"]) for i in rows)
    R = max(max(len(samples[i]["response_ids"]) for i in rows), 1)
    B = len(rows)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.bool)
    out = {k: torch.zeros((B, R), dtype=torch.float32) for k in fields
           if all(samples[i].get(k) is not None for i in rows)}
    for b, i in enumerate(rows):
        s = samples[i]
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        ids[b, P - p:P] = torch.tensor(s["prompt_ids"])
        ids[b, P:P + r] = torch.tensor(s["response_ids"], dtype=torch.long)
        attn[b, P - p:P + r] = 1
        mask[b, :r] = True
        for k in out:
            out[k][b, :r] = torch.as_tensor(s[k], dtype=torch.float32)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    pixels = vision.batch_pixels([samples[i].get("pixels") or {} for i in rows])
    return MicroBatch(ids, attn, position_ids, ids[:, P:], mask, out, list(rows), pixels)


def minibatch_plan(n: int, cfg: Config) -> list[list[int]]:
    """Row indices of every update: `epochs` shuffles (fixed by seed and iteration), each cut into minibatches."""
    per_epoch = n // cfg.minibatch_size
    plan = []
    for epoch in range(cfg.epochs):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + cfg.iteration * 1_009 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        plan += [perm[k * cfg.minibatch_size:(k + 1) * cfg.minibatch_size] for k in range(per_epoch)]
    return plan


def micro_split(rows: list[int], size: int) -> list[list[int]]:
    return [rows[j:j + size] for j in range(0, len(rows), size)]


# --- models ---------------------------------------------------------------------------------

def disable_dropout(model: torch.nn.Module) -> None:
    """PPO needs ratio = 1 before any update; dropout would make two forwards of the same policy differ."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def _accepts_logits_to_keep(model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(modeling.unwrap(model).forward).parameters


def response_logits(engine, mb: MicroBatch, keep: bool) -> torch.Tensor:
    """Logits of the positions that predict the response tokens: (B, R, V)."""
    R = mb.response_ids.shape[1]
    extra = {"logits_to_keep": R + 1} if keep else {}
    out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                 **mb.model_kwargs(engine), **extra)
    return out.logits[:, -(R + 1):-1]


def response_values(engine, mb: MicroBatch) -> torch.Tensor:
    """Critic values at the positions that predict the response tokens: (B, R) float32."""
    R = mb.response_ids.shape[1]
    out = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False)
    return out.logits[:, -(R + 1):-1, 0].float()


def _gathered(engine):
    """Context in which the module's parameters are whole (ZeRO-3 partitions them)."""
    if engine.cfg.backend == "deepspeed" and engine.cfg.zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def load_critic(cfg: Config, policy_vocab: int):
    if modeling.is_vision(cfg.policy_path):
        raise ConfigError(f"critic=true, but the policy '{cfg.policy_path}' is a vision-language model; critics are "
                          f"text-only so far. Use a critic-free estimator (grpo, rloo, reinforce_baseline, grpo_process).")
    fresh = not cfg.critic_path
    path = cfg.critic_path or (cfg.policy_path if cfg.critic_init == "policy" else cfg.prm_path)
    critic, _ = modeling.load_scalar_model(path, cfg.engine.dtype)
    if fresh:  # a PRM's head scores step correctness, not values: a new critic starts at V = 0
        with torch.no_grad():
            critic.score.weight.zero_()
            if getattr(critic.score, "bias", None) is not None:
                critic.score.bias.zero_()
    if critic.config.vocab_size != policy_vocab:
        raise ConfigError(f"critic '{path}' has a vocabulary of {critic.config.vocab_size} tokens, the policy "
                          f"{policy_vocab}; the critic must share the policy's tokenizer.")
    disable_dropout(critic)
    return critic


def _engine(model, cfg: Config, lr: float, total: int, offset: int, micro: int) -> TrainEngine:
    engine = TrainEngine(model, cfg.engine, OptimSettings(
        lr=lr, total_steps=max(total, 1), warmup_steps=cfg.warmup_updates, schedule=cfg.lr_schedule,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm), micro, cfg.minibatch_size // micro)
    with warnings.catch_warnings():  # stepping a scheduler before its optimizer is what we mean here
        warnings.simplefilter("ignore")
        for _ in range(offset):
            engine.scheduler.step()
    engine.train()
    return engine


# --- one update -----------------------------------------------------------------------------

def _backward(engine: TrainEngine, loss: torch.Tensor, boundary: bool) -> None:
    if engine.cfg.backend == "deepspeed":
        # We own the accumulation boundary: DeepSpeed then steps only after the last micro-batch,
        # which runs only once every loss of the update was checked to be finite.
        engine.model.set_gradient_accumulation_boundary(boundary)
    engine.backward(loss)


def _discard(engine: TrainEngine) -> None:
    """Drop the gradients accumulated so far in this update (no optimizer or scheduler step)."""
    engine.skip_step()
    if engine.cfg.backend == "deepspeed":
        opt = engine.model.optimizer
        if hasattr(opt, "bit16_groups"):  # ZeRO 1/2 keep their own accumulators
            opt.zero_grad(set_to_none=True)
            if isinstance(getattr(opt, "all_grad_tensors", None), dict):
                opt.all_grad_tensors.clear()
        elif hasattr(opt, "zero_grad"):
            opt.zero_grad(set_to_none=True)


def _finite_grad_norm(engine: TrainEngine) -> bool:
    grads = [p.grad for p in engine.trainable if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


class Updater:
    """Runs one optimizer update of the actor and/or the critic on one minibatch."""

    def __init__(self, cfg: Config, actor: TrainEngine, critic: TrainEngine | None, max_len: int):
        self.cfg, self.actor, self.critic, self.max_len = cfg, actor, critic, max_len  # max_len: Dr. GRPO's constant
        self.keep = _accepts_logits_to_keep(actor.module)

    def actor_loss(self, mb: MicroBatch, norm: losses.Normalizer, pg_norm: losses.Normalizer, ptx_mb, ptx_tokens):
        """This micro-batch's share of the policy objective and its statistics (sums over its tokens)."""
        cfg, f, mask = self.cfg, mb.fields, mb.mask
        logits = response_logits(self.actor, mb, self.keep)                       # (B, R, V)
        logp = token_logprobs(logits, mb.response_ids)                            # (B, R)
        adv = f["advantages"].clamp(-cfg.advantage_clip, cfg.advantage_clip) if cfg.advantage_clip else f["advantages"]
        # policy loss
        pg = losses.ppo_policy_loss(logp, f["old_logprobs"], adv, mask, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
        pg_mask = mask & (f["pg_mask"] > 0) if "pg_mask" in f else mask
        pg_loss = losses.aggregate(cfg.loss_agg, pg.loss, pg_mask, pg_norm)
        loss = pg_loss
        # entropy bonus (the metric is computed without a graph when there is no bonus)
        with torch.set_grad_enabled(cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if cfg.entropy_coef > 0 else logits.detach())
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * losses.aggregate(cfg.loss_agg, entropy, mask, norm)
        stats = {"policy_loss": float(pg_loss.detach()), "entropy": float(masked_sum(entropy.detach(), mask)),
                 "clip_frac": float(pg.clipped.sum()), "dual_clip_frac": float(pg.dual_clipped.sum()),
                 "approx_kl": float(masked_sum(losses.kl_estimate("k3", f["old_logprobs"], logp.detach(), mask), mask)),
                 "ratio_max": float(torch.where(mask, pg.ratio.detach(), 0).max()),
                 "ratio_min": float(torch.where(mask, pg.ratio.detach(), float("inf")).min())}
        # KL loss to the reference
        if cfg.kl_loss_coef > 0:
            kl = losses.kl_estimate(cfg.kl_loss_estimator, logp, f["ref_logprobs"], mask)
            kl_loss = losses.aggregate(cfg.loss_agg, kl, mask, norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["kl_loss"] = float(kl_loss.detach())
        # SFT (ptx) loss on reference solutions
        if ptx_mb is not None:
            from ..sft import data as sft_data

            ptx_mb = {k: v.to(self.actor.device) for k, v in ptx_mb.items()}
            logits = self.actor(**sft_data.model_inputs(ptx_mb), use_cache=False).logits
            ce_sum, _ = sft_data.response_loss(logits, ptx_mb["labels"])
            loss = loss + cfg.ptx_coef * ce_sum / max(ptx_tokens, 1)
            stats["ptx_loss"] = float(ce_sum.detach()) / max(ptx_tokens, 1)
        return loss, stats

    def critic_loss(self, mb: MicroBatch, norm: losses.Normalizer):
        f = mb.fields
        values = response_values(self.critic, mb)                                 # (B, R)
        vl = losses.clipped_value_loss(values, f["values"], f["returns"], mb.mask, self.cfg.value_clip)
        loss = losses.token_mean(vl.loss, mb.mask, norm)
        return loss, {"value_loss": float(loss.detach()), "value_clip_frac": float(vl.clipped.sum())}

    def update(self, micro: list[MicroBatch], train_actor: bool, ptx_batch=None) -> dict | None:
        """One optimizer update over the micro-batches of a minibatch; None when it was skipped."""
        cfg = self.cfg
        norm = losses.Normalizer.of([m.mask for m in micro], self.max_len)
        pg_norm = (losses.Normalizer.of([m.mask & (m.fields["pg_mask"] > 0) for m in micro], self.max_len)
                   if "pg_mask" in micro[0].fields else norm)
        engines = ([self.actor] if train_actor else []) + ([self.critic] if self.critic is not None else [])
        sums: dict[str, float] = {}
        ptx_micro, ptx_tokens = ptx_batch if (train_actor and ptx_batch is not None) else ([None] * len(micro), 0)
        finite = True
        for j, mb in enumerate(micro):
            mb = mb.to(self.actor.device)
            pending = []
            if train_actor:
                loss, stats = self.actor_loss(mb, norm, pg_norm, ptx_micro[j], ptx_tokens)
                pending.append((self.actor, loss))
                _accumulate(sums, stats)
            if self.critic is not None:
                loss, stats = self.critic_loss(mb, norm)
                pending.append((self.critic, loss))
                _accumulate(sums, stats)
            if not all(bool(torch.isfinite(loss.detach())) for _, loss in pending):
                finite = False
                break
            for engine, loss in pending:
                _backward(engine, loss, boundary=j == len(micro) - 1)
            sums["tokens"] = sums.get("tokens", 0) + mb.tokens
        if finite and not all(e.cfg.backend == "deepspeed" or _finite_grad_norm(e) for e in engines):
            finite = False
        if not finite:
            for engine in engines:
                _discard(engine)
            return None
        out = {k: v for k, v in sums.items() if k in ("policy_loss", "kl_loss", "ptx_loss", "value_loss", "tokens")}
        for k in ("entropy", "clip_frac", "dual_clip_frac", "approx_kl", "value_clip_frac"):
            if k in sums:
                out[k] = sums[k] / max(norm.tokens, 1)
        if train_actor:
            out.update(ratio_max=sums["ratio_max"], ratio_min=sums["ratio_min"], lr=self.actor.lr)
            out["grad_norm"] = self.actor.step()
        if self.critic is not None:
            out["critic_lr"] = self.critic.lr
            out["critic_grad_norm"] = self.critic.step()
        # DeepSpeed without ZeRO reports no gradient norm (NaN): leave it out rather than log NaN
        return {k: v for k, v in out.items() if not (k.endswith("grad_norm") and not math.isfinite(v))}


def _accumulate(sums: dict, stats: dict) -> None:
    for k, v in stats.items():
        if k == "ratio_max":
            sums[k] = max(sums.get(k, -math.inf), v)
        elif k == "ratio_min":
            sums[k] = min(sums.get(k, math.inf), v)
        else:
            sums[k] = sums.get(k, 0.0) + v


# --- passes before training -----------------------------------------------------------------

@torch.no_grad()
def precompute(cfg: Config, samples: list[dict], plan: list[list[int]], actor: TrainEngine,
               critic: TrainEngine | None, pad_id: int) -> None:
    """Fill what the hand-off lacks or what the config asks to recompute, with the starting weights.

    Runs the micro-batches of the first epoch in training order, so a recomputed old_logprobs is
    bit-identical to what the first update computes (its ratio is exactly 1).
    """
    need_logp = cfg.recompute_old_logprobs
    need_entropy = cfg.top_entropy_frac < 1
    need_values = critic is not None and any(s["values"] is None for s in samples)
    if not (need_logp or need_entropy or need_values):
        return
    per_epoch = len(samples) // cfg.minibatch_size
    seen = [i for rows in plan[:per_epoch] for i in rows]
    rest = sorted(set(range(len(samples))) - set(seen))
    chunks = [c for rows in plan[:per_epoch] for c in micro_split(rows, cfg.micro_batch_size)]
    chunks += micro_split(rest, cfg.micro_batch_size)
    keep = _accepts_logits_to_keep(actor.module)
    entropies: dict[int, torch.Tensor] = {}
    for rows in chunks:
        rows = [i for i in rows if not samples[i].get("image_mismatch")]  # their batches are skipped
        if not rows:
            continue
        mb = collate(samples, rows, pad_id, fields=()).to(actor.device)
        if need_logp or need_entropy:
            logits = response_logits(actor, mb, keep)
            logp, ent = token_logprobs(logits, mb.response_ids).cpu(), entropy_from_logits(logits).cpu()
        if need_values:
            values = response_values(critic, mb).cpu()
        for b, i in enumerate(rows):
            r = len(samples[i]["response_ids"])
            if need_logp:
                samples[i]["old_logprobs"] = logp[b, :r].tolist()
            if need_entropy:
                entropies[i] = ent[b, :r]
            if need_values:
                samples[i]["values"] = values[b, :r].tolist()
    if need_entropy:  # threshold over every token of the batch, not per micro-batch
        order = sorted(entropies)
        keep_mask = losses.top_fraction(torch.cat([entropies[i] for i in order]), cfg.top_entropy_frac)
        start = 0
        for i in order:
            r = entropies[i].numel()
            samples[i]["pg_mask"] = keep_mask[start:start + r].float().tolist()
            start += r


def attach_pixels(cfg: Config, samples: list[dict], vis: "vision.Vision | None") -> None:
    """Re-feed the prompts' images: each sample gets the pixel inputs of its `images` (decoded and
    processed again with the policy's image processor) and, when its image tokens do not match
    them, the reason (`image_mismatch`): the update of any minibatch holding it is skipped."""
    if not any(s.get("images") for s in samples):
        return
    if vis is None:
        raise DataError(f"'{cfg.advantages}' has rows with images, but the policy '{cfg.policy_path}' is text-only; "
                        f"train a vision-language policy on them.")
    cache: dict[tuple, dict] = {}
    for i, s in enumerate(samples):
        images = s.get("images") or []
        key = tuple(images)
        if key not in cache:
            cache[key] = vis.pixels(images, f"'{cfg.advantages}', row {i}")
        s["pixels"] = cache[key]
        s["image_mismatch"] = vis.mismatch(s["prompt_ids"] + s["response_ids"], s["pixels"])  # what the model sees


def load_ptx(cfg: Config, tokenizer):
    """Tokenized supervised examples for the ptx loss (prompt masked, response + EOS trained on)."""
    from ..sft import data as sft_data

    akw = config_lib.to_dict(cfg.arithmetic)
    records = tasks.load(cfg.ptx_task, "train", cfg.ptx_size, cfg.seed, **akw) if cfg.ptx_task in tasks.TASKS \
        else tasks.load(cfg.ptx_task, n=cfg.ptx_size)
    examples, _ = sft_data.tokenize(records, tokenizer, cfg.max_seq_len, cfg.chat_template, where=cfg.ptx_task)
    return examples


def ptx_batch(cfg: Config, examples, update: int, n_micro: int, pad_id: int):
    """The ptx examples of update `update` (a fixed function of it, so resume replays it), split in n_micro."""
    from ..sft import data as sft_data

    n, per = len(examples), cfg.ptx_batch_size
    picked, orders = [], {}
    for pos in range(update * per, (update + 1) * per):
        epoch, k = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = sft_data.epoch_order(n, cfg.seed, epoch)
        picked.append(examples[orders[epoch][k]])
    bounds = [round(j * per / n_micro) for j in range(n_micro + 1)]
    micro = [sft_data.collate(picked[a:b], pad_id) for a, b in zip(bounds, bounds[1:])]
    tokens = sum(int((m["labels"][:, 1:] != sft_data.IGNORE).sum()) for m in micro)
    return micro, tokens


# --- the stage ------------------------------------------------------------------------------

def _inputs(cfg: Config) -> dict[str, str]:
    """Fingerprints of the committed inputs (the advantages shards, and the policy/critic when they
    are prmflow outputs): a re-run or a resume with the same config but other data starts afresh."""
    dirs = [str(d) for d in schema.open_dataset(cfg.advantages, "advantages", verify_checksums=False).dirs]
    dirs += [d for d in (cfg.policy_path, cfg.critic_path) if d and (Path(d) / io.MANIFEST).is_file()]
    return io.fingerprint(dirs)


def run(cfg: Config) -> dict:
    """Train on the batch and write the new policy (and critic, KL state) to `cfg.output`. Returns metrics."""
    cfg_dict = {**config_lib.to_dict(cfg), "inputs": _inputs(cfg)}  # the identity of this run's result
    done = io.completed_output(cfg.output, {"config": io.config_identity(cfg_dict)}, cfg.overwrite, "ppo")
    if done is not None:
        print(f"ppo: '{cfg.output}' is already complete for this config and these inputs; nothing to do.")
        checkpoint.clear(checkpoint.work_dir_for(cfg.output))  # left if killed between commit and cleanup
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, cfg_dict, stop)


def _run(cfg: Config, cfg_dict: dict, stop: preemption.Preemption) -> dict:
    samples = load_batch(cfg)
    if len(samples) < cfg.minibatch_size:
        raise ConfigError(f"'{cfg.advantages}' has {len(samples)} responses, fewer than minibatch_size="
                          f"{cfg.minibatch_size}; lower minibatch_size or generate more rollouts.")
    plan = minibatch_plan(len(samples), cfg)
    n_updates = len(plan)
    if cfg.critic_warmup_updates >= n_updates:
        raise ConfigError(f"critic_warmup_updates ({cfg.critic_warmup_updates}) leaves no update for the policy "
                          f"(this run has {n_updates}); lower it.")
    actor_updates = n_updates - cfg.critic_warmup_updates

    torch.manual_seed(cfg.seed)
    model, tokenizer = modeling.load_causal_lm(cfg.policy_path, cfg.engine.dtype)
    attach_pixels(cfg, samples, vision.Vision.of(tokenizer, model.config))
    modeling.freeze(model, cfg.freeze)
    disable_dropout(model)
    critic_model = load_critic(cfg, getattr(model.config, "vocab_size", None)) if cfg.critic else None
    actor = _engine(model, cfg, cfg.lr, cfg.rl_iterations * actor_updates, cfg.iteration * actor_updates,
                    cfg.micro_batch_size)
    critic = (_engine(critic_model, cfg, cfg.critic_lr, cfg.rl_iterations * n_updates, cfg.iteration * n_updates,
                      cfg.micro_batch_size) if critic_model is not None else None)
    precompute(cfg, samples, plan, actor, critic, tokenizer.pad_token_id)  # with the starting weights, before a resume
    ptx_examples = load_ptx(cfg, tokenizer) if cfg.ptx_coef else None
    ema = None
    if cfg.ema_decay:
        with _gathered(actor):
            ema = {n: p.detach().float().cpu().clone() for n, p in actor.module.named_parameters()}

    work = checkpoint.work_dir_for(cfg.output)
    state = {"update": 0, "skipped": 0, "history": []}
    resume_from = checkpoint.find(work, cfg_dict) if cfg.resume else None
    if resume_from is None and cfg.optimizer_state:
        _load_moments(Path(cfg.optimizer_state), actor, critic if cfg.critic_path else None)
    if resume_from is not None:
        state = actor.load_state(resume_from / "actor")
        if critic is not None:
            critic.load_state(resume_from / "critic")
        if ema is not None:
            from safetensors.torch import load_file

            ema = load_file(str(resume_from / "ema.safetensors"))
        print(f"ppo: resuming from update {state['update']} ({resume_from})")

    tracker = tracking.start_stage_run(cfg.tracking, "ppo", params=config_lib.flat_dict(cfg), iteration=cfg.iteration,
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker:
        tracker.log_metrics({"data/responses": len(samples), "data/updates": n_updates}, step=state["update"])
        updater = Updater(cfg, actor, critic, max_len=cfg.drgrpo_max_len or max(len(s["response_ids"]) for s in samples))
        tokens, seconds = _train(cfg, cfg_dict, updater, samples, plan, ptx_examples, tokenizer, ema, state, work,
                                 tracker, stop)
        applied = [h for h in state["history"] if not h.get("skipped")]
        if not any(h["actor"] for h in applied):
            if state.get("image_skipped"):
                raise DataError(f"ppo: every policy update of this run was skipped, {state['image_skipped']} of them "
                                f"because image tokens did not match the images (first: "
                                f"{next(h['reason'] for h in state['history'] if h.get('reason'))}). Nothing was written "
                                f"to '{cfg.output}'. Write the rollouts with the policy's own processor.")
            raise TrainingDivergedError(
                f"ppo: every policy update of this run ({actor_updates}) was skipped because a loss or gradient "
                f"was NaN/inf. Nothing was written to '{cfg.output}'. Lower lr, clamp advantages "
                f"(advantage_clip), turn on dual_clip, or check the advantages hand-off '{cfg.advantages}'.")
        metrics = _summary(state, n_updates, tokens, seconds)
        kl_state = _kl_control(cfg, samples)
        metrics["train/kl_coef"] = kl_state["kl_coef"]
        metrics["train/rollout_kl"] = kl_state["measured_kl"]
        _write_output(cfg, cfg_dict, tokenizer, actor, critic, ema, kl_state, state, metrics)
        checkpoint.clear(work)
        tracker.log_metrics(metrics, step=n_updates)
        tracker.log_parent_metrics(metrics, step=cfg.iteration)  # one point per RL iteration on the pipeline run
    nan = float("nan")
    print(f"ppo: {n_updates - state['skipped']}/{n_updates} updates, policy loss "
          f"{metrics.get('train/policy_loss', nan):.4f}, clip frac {metrics.get('train/clip_frac', nan):.3f}, "
          f"kl_coef {kl_state['kl_coef']:.4g} -> {cfg.output}")
    return metrics


def _train(cfg, cfg_dict, updater: Updater, samples, plan, ptx_examples, tokenizer, ema, state, work, tracker,
           stop: preemption.Preemption) -> tuple[int, float]:
    """The update loop from `state["update"]` to the end; returns (tokens trained on, seconds)."""
    actor, n_updates = updater.actor, len(plan)
    n_micro = cfg.minibatch_size // cfg.micro_batch_size
    bar = tqdm(total=n_updates, initial=state["update"], desc="ppo", unit="update", dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 10.0)
    t0, tokens = time.perf_counter(), 0
    while state["update"] < n_updates:
        u = state["update"]
        train_actor = u >= cfg.critic_warmup_updates
        bad = next((i for i in plan[u] if samples[i].get("image_mismatch")), None)
        if bad is not None:  # the image tokens of a prompt do not match its images: skip, with the reason
            why = f"row {bad}: {samples[bad]['image_mismatch']}"
            log.warning("ppo: update %d skipped: %s", u + 1, why)
            bar.write(f"update {u + 1}: skipped ({why})")
            state["update"] += 1
            state["skipped"] += 1
            state["image_skipped"] = state.get("image_skipped", 0) + 1
            state["history"].append({"skipped": True, "reason": why, "update": u + 1,
                                     "epoch": u // (n_updates // cfg.epochs), "actor": train_actor})
            tracker.log_metrics({"train/skipped_updates": state["skipped"],
                                 "train/skipped_image_mismatch": state["image_skipped"]}, step=u + 1)
            bar.update(1)
            continue
        micro = [collate(samples, rows, tokenizer.pad_token_id) for rows in micro_split(plan[u], cfg.micro_batch_size)]
        ptx = (ptx_batch(cfg, ptx_examples, u, n_micro, tokenizer.pad_token_id)
               if ptx_examples is not None and train_actor else None)
        stats = updater.update(micro, train_actor, ptx)
        state["update"] += 1
        if stats is None:
            state["skipped"] += 1
            log.warning("ppo: update %d skipped: a loss or gradient was NaN/inf", u + 1)
            bar.write(f"update {u + 1}: skipped (NaN/inf loss or gradient)")
            stats = {"skipped": True}
        else:
            tokens += stats.pop("tokens")
            if ema is not None and train_actor:
                with torch.no_grad(), _gathered(actor):
                    for name, p in actor.module.named_parameters():
                        ema[name].mul_(cfg.ema_decay).add_(p.detach().float().cpu(), alpha=1 - cfg.ema_decay)
        stats.update(update=u + 1, epoch=u // (n_updates // cfg.epochs), actor=train_actor)
        state["history"].append(stats)
        tracker.log_metrics({**{f"train/{k}": v for k, v in stats.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("update", "epoch")},
                             "train/skipped_updates": state["skipped"],
                             "perf/tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9)}, step=u + 1)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.get('policy_loss', float('nan')):.4f}", skipped=state["skipped"], refresh=False)
        more = state["update"] < n_updates
        if more and (stop.requested or (cfg.save_every and state["update"] % cfg.save_every == 0)):
            _save_resume(work, cfg_dict, actor, updater.critic, ema, state)
        if more and stop.requested:  # preempted (SIGTERM): the checkpoint is saved, exit 143
            bar.close()
            stopped = preemption.Preempted("ppo", state["update"], str(work / "latest"))
            log.warning("%s", stopped)
            print(stopped, file=sys.stderr)
            raise stopped
    bar.close()
    return tokens, time.perf_counter() - t0


def _summary(state: dict, n_updates: int, tokens: int, seconds: float) -> dict:
    """Means over the applied updates of the last epoch that trained the actor, plus counts."""
    applied = [h for h in state["history"] if not h.get("skipped")]
    last_epoch = max(h["epoch"] for h in applied)
    recent = [h for h in applied if h["epoch"] == last_epoch]
    keys = sorted({k for h in recent for k, v in h.items() if isinstance(v, float)})
    metrics = {f"train/{k}": sum(h[k] for h in recent if k in h) / sum(1 for h in recent if k in h) for k in keys}
    metrics.update({"train/updates": n_updates, "train/skipped_updates": state["skipped"],
                    "train/skipped_image_mismatch": state.get("image_skipped", 0),
                    "perf/tokens_per_s": tokens / max(seconds, 1e-9)})
    return metrics


def _beta_used(cfg: Config) -> float:
    """The KL coefficient the advantage stage built this batch's rewards with.

    Its manifest records it (`kl_coef_used`); otherwise the kl_state file, otherwise kl_coef.
    """
    manifests = schema.open_dataset(cfg.advantages, "advantages", verify_checksums=False).manifests
    used = {m.get("kl_coef_used") for m in manifests}
    used.discard(None)
    if len(used) == 1:
        return float(used.pop())
    if len(used) > 1:
        raise DataError(f"'{cfg.advantages}' mixes shards built with different KL coefficients {sorted(used)}.")
    return float(kl_control.read_state(cfg.kl_state)["kl_coef"]) if cfg.kl_state else cfg.kl_coef


def _kl_control(cfg: Config, samples: list[dict]) -> dict:
    """Update beta with this batch's KL per response and return the state for the next iteration."""
    beta = _beta_used(cfg)
    if cfg.kl_control == "adaptive" and beta == 0:
        log.warning("ppo: adaptive KL control of a zero coefficient keeps it at zero (the rule is multiplicative); "
                    "start the advantage stage with kl_coef > 0")
    controller = kl_control.make_controller(cfg.kl_control, beta, cfg.kl_target, cfg.kl_horizon)
    per_token = []
    for s in samples:  # the hand-off's kl column when present, else k1 of old vs reference
        if s["kl"] is not None:
            per_token.append(s["kl"])
        elif s["ref_logprobs"] is not None and s["old_logprobs"] is not None:
            per_token.append([a - b for a, b in zip(s["old_logprobs"], s["ref_logprobs"])])
    measured = kl_control.kl_per_response(per_token)
    if per_token:
        controller.update(measured, len(per_token))
    elif cfg.kl_control == "adaptive":
        log.warning("ppo: the batch has neither 'kl' nor 'ref_logprobs'; the adaptive KL coefficient is unchanged")
    return {**controller.state(), "previous_kl_coef": beta, "measured_kl": measured,
            "n_samples": len(per_token), "iteration": cfg.iteration}


def _load_moments(root: Path, actor, critic) -> None:
    """Continue the previous iteration's optimizers (OUTPUT/optimizer/{actor,critic})."""
    if not (root / "actor").is_dir():
        raise ModelLoadError(f"optimizer_state '{root}' has no actor/ directory; point it at a ppo output's "
                             f"optimizer/ directory, or leave it empty for a fresh optimizer.")
    actor.load_optimizer(root / "actor")
    if critic is not None and (root / "critic").is_dir():  # (a critic new in this iteration starts fresh)
        critic.load_optimizer(root / "critic")


def _save_resume(work: Path, cfg_dict: dict, actor, critic, ema, state: dict) -> None:
    """`work/latest` (atomically): both engines' state (weights, optimizer, schedule), EMA, trainer state."""
    with io.atomic_output_dir(Path(work) / "latest", "resume-checkpoint", overwrite=True,
                              manifest={"trainer_state": {"update": state["update"]},
                                        "config": io.config_identity(cfg_dict)}) as tmp:
        actor.save_state(tmp / "actor", state)
        if critic is not None:
            critic.save_state(tmp / "critic", {"update": state["update"]})
        if ema is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))


def _write_output(cfg, cfg_dict, tokenizer, actor, critic, ema, kl_state, state, metrics) -> None:
    parents = [cfg.policy_path, cfg.advantages] + [p for p in (cfg.critic_path, cfg.optimizer_state) if p]
    extra = {"stage": "ppo", "iteration": cfg.iteration, "metrics": metrics}
    with io.atomic_output_dir(cfg.output, "ppo", overwrite=True, manifest={
            "config": io.config_identity(cfg_dict), "metrics": metrics, "parents": parents}) as tmp:
        with _gathered(actor):
            modeling.save_pretrained(actor.module, tokenizer, tmp / "policy", extra=extra)
        if critic is not None:
            with _gathered(critic):
                modeling.save_pretrained(critic.module, tokenizer, tmp / "critic", extra=extra)
        if ema is not None:
            with _gathered(actor):
                params = dict(actor.module.named_parameters())
                saved = {n: p.detach().clone() for n, p in params.items()}
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(ema[n].to(p.dtype))
                    modeling.save_pretrained(actor.module, tokenizer, tmp / "policy_ema",
                                             extra={**extra, "ema_decay": cfg.ema_decay})
                    for n, p in params.items():
                        p.copy_(saved[n])
        if cfg.save_optimizer:
            actor.save_optimizer(tmp / "optimizer" / "actor")
            if critic is not None:
                critic.save_optimizer(tmp / "optimizer" / "critic")
        kl_control.write_state(tmp / kl_control.KL_STATE_FILE, kl_state)
        (tmp / "updates.jsonl").write_text("".join(json.dumps(h, sort_keys=True) + "\n" for h in state["history"]))
