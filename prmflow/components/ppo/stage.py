"""PPO update: train the policy (and optionally a critic) on one batch of rollouts with advantages.

    prmflow ppo --policy outputs/sft --input outputs/advantages-0 --output outputs/ppo-0
    prmflow ppo --config configs/quickstart-cpu.yaml --set iteration=1 --set policy=outputs/quickstart/ppo-0/policy \
        --set input=outputs/quickstart/advantages-1 --set output=outputs/quickstart/ppo-1 \
        --set optimizer_state=outputs/quickstart/ppo-0/optimizer    # the quickstart's next iteration, Adam moments kept
    prmflow ppo ... --train_critic true --critic_warmup_steps 4 --engine.zero_stage 2    # GAE

Reads an advantages hand-off (prompt_ids, response_ids, old_logprobs, advantages; returns/values
for the critic, ref_logprobs for a KL loss). Writes OUTPUT/policy (HF), OUTPUT/critic (HF, with
--train_critic), OUTPUT/policy_ema (with ema_decay), OUTPUT/kl_state.json (the KL coefficient for the
next iteration) and OUTPUT/updates.jsonl (one line of metrics per update), atomically.

Choices: `epochs` passes over the batch, each cut into shuffled minibatches of `minibatch_size`
responses (one optimizer update each), each minibatch cut into micro-batches whose losses are
their exact shares of the minibatch loss (gradient accumulation changes nothing but memory).
Log-probabilities of the response tokens are recomputed under the current policy in every
micro-batch; the ratio's denominator is the hand-off's old_logprobs, or their recompute by this
stage's engine (recompute_old_logprobs; by default on a GPU or in bf16). Clipped surrogate with separate low/high
clip and optional dual clip; aggregation token-mean (default), seq-mean-token-mean or Dr. GRPO; entropy bonus; KL loss to the
reference (k1/k2/k3); SFT (ptx) loss; advantage clamp; top-entropy token mask. Critic: a scalar-head
model with a clipped value loss, its own optimizer, and a warm-up where only it trains. A NaN/inf
loss (or gradient) skips the whole update and is counted; if every update is skipped the stage fails.
Prompts are left-padded and responses right-padded, so the logits of the response positions are a
single slice (the LM head never runs on prompt positions). Dropout is turned off (it would make the
ratio differ from 1 without any update). Resume: `.OUTPUT.work/latest` holds both engines' state;
on SIGTERM the update in progress finishes, the checkpoint is saved and the process exits 143. A
finished output with the same config and the same input fingerprints is left alone.

This file is the run: loading, the update loop, resume and output. The rest of the stage:
config.py (the knobs), minibatches.py (hand-off rows -> minibatches -> micro-batches), actor_critic.py (policy
and critic forward passes, their engines), prepass.py (old log-probs, entropy mask, V_old, images),
ptx.py (the supervised data), update.py (one update: the losses, top to bottom), losses.py (the
formulas as tensor functions), kl_control.py (beta for the next iteration), ema.py (the policy's EMA).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..training import checkpoint
from .. import config as config_lib
from ..runtime import distributed, preemption
from ..data import io, schema
from ..models import modeling, vision
from ..training.engine import TrainEngine
from ... import tracking
from ..training.engine import init_distributed
from ...errors import ConfigError, DataError, ModelLoadError, PrmflowError
from ..training import kl_state as kl_state_file
from . import kl_control
from .minibatches import Sample, collate, dr_grpo_length, load_batch, micro_split, minibatch_plan, shard_ptx
from .config import Config
from .ema import PolicyEMA
from .actor_critic import disable_dropout, load_critic, make_engine
from .prepass import attach_pixels, precompute
from .ptx import load_ptx, ptx_batch
from .update import Updater

__all__ = ["Config", "TrainingDivergedError", "run"]

log = logging.getLogger(__name__)


class TrainingDivergedError(PrmflowError):
    """Every update of the run had a NaN/inf loss or gradient."""


@dataclass
class TrainerState:
    """How far the update loop is: what a resume checkpoint stores (actor/trainer_state.json)."""

    update: int = 0
    """Updates done (applied or skipped); the next one is plan[update]."""
    skipped: int = 0
    """Updates skipped: a NaN/inf loss or gradient, or image tokens that do not match the images."""
    image_skipped: int = 0
    """Of those, the updates skipped for image tokens that do not match the images."""
    history: list[dict] = field(default_factory=list)
    """One record per update: its statistics (or skipped and why), update, epoch, actor (OUTPUT/updates.jsonl)."""

    @classmethod
    def from_dict(cls, d: dict) -> "TrainerState":
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Training:
    """What the update loop works on, set up once before it starts."""

    cfg: Config
    identity: dict
    """The config and input fingerprints: the identity of this run's result (resume checkpoints carry it)."""
    samples: list[Sample]
    plan: list[list[int]]
    """Row indices of every update (`minibatch_plan`)."""
    updater: Updater
    tokenizer: Any
    ptx_examples: list | None
    """The supervised (ptx) examples, when ptx_coef > 0."""
    ema: PolicyEMA | None
    """The policy's exponential moving average, when ema_decay > 0."""
    work: Path
    """Where the resume checkpoint goes (`.OUTPUT.work`)."""
    prepass_metrics: dict[str, float]
    """The prepass's metrics (`prepass.precompute`: the hand-off's old_logprobs against this engine's, train/is_*)."""

    @property
    def actor(self) -> TrainEngine:
        return self.updater.actor

    @property
    def critic(self) -> TrainEngine | None:
        return self.updater.critic

    @property
    def base(self) -> int:
        """The updates of the earlier RL iterations (as the lr schedule counts): metrics of update u are
        logged at step base + u, so iterations chart one after another."""
        return self.cfg.iteration * len(self.plan)


@dataclass
class Result:
    """What the run writes to OUTPUT besides the weights (`_write_output`)."""

    kl_state: dict
    """The KL coefficient for the next iteration (OUTPUT/kl_state.json)."""
    history: list[dict]
    """One record per update (OUTPUT/updates.jsonl)."""
    metrics: dict
    """The run's summary (the manifest's and each model's `metrics`)."""


def _inputs(cfg: Config) -> dict:
    """Fingerprints of the committed inputs (the advantages shards, and the policy/critic when they
    are prmflow outputs): a re-run or a resume with the same config but other data starts afresh.
    The advantages count by content, not by where they lie: a pipeline re-run hands the same
    advantages over at a new artifact path and must find its finished output on the workspace."""
    shards = [str(d) for d in schema.open_dataset(cfg.input, "advantages", verify_checksums=False).dirs]
    models = [d for d in (cfg.policy, cfg.critic) if d and (Path(d) / io.MANIFEST).is_file()]
    return {"advantages": sorted(io.fingerprint(shards).values()), **io.fingerprint(models)}


#: Keys read only by a part of the stage that a setting turns off: (is the part on?, its keys).
_PARTS = (
    (lambda c: bool(c.ptx_coef), ("ptx_task", "ptx_batch_size", "ptx_num_prompts", "max_seq_len", "chat_template")),
    (lambda c: bool(c.ptx_coef) and c.ptx_task == "arithmetic", ("arithmetic.",)),
    (lambda c: c.train_critic, ("critic", "critic_init", "prm", "critic_lr", "value_clip")),
    (lambda c: c.kl_control == "adaptive", ("kl_target", "kl_horizon")),
)


def used_params(cfg: Config) -> dict:
    """The run's MLflow params: the flattened config less the keys of parts that are off (the ptx loss and
    its task, the critic, adaptive KL control). Nothing reads those, and logged they mislead whoever
    compares runs (a task's `arithmetic.prompt_prefix` that no prompt of this run was built with)."""
    unused = tuple(k for on, keys in _PARTS if not on(cfg) for k in keys)
    return {k: v for k, v in config_lib.flat_dict(cfg).items()
            if not any(k == u or (u.endswith(".") and k.startswith(u)) for u in unused)}


def run(cfg: Config) -> dict:
    """Train on the batch and write the new policy (and critic, KL state) to `cfg.output`. Returns metrics."""
    if n := distributed.should_launch(cfg.engine):  # engine.nproc_per_node > 1: run as n torchrun ranks
        distributed.launch("ppo", cfg, n)
        return io.read_manifest(cfg.output).get("metrics", {})
    if distributed.under_launcher():
        init_distributed(cfg.engine)  # the ranks decide together from here on
        distributed.check_divides(cfg.micro_batch_size)
    # the identity of this run's result: the config (but where the advantages lie) and the inputs' content
    cfg_dict = {**{k: v for k, v in config_lib.to_dict(cfg).items() if k != "input"}, "inputs": _inputs(cfg)}
    done = io.finished_output("ppo", cfg.output, cfg_dict, cfg.overwrite)  # (the inputs are in cfg_dict)
    if done is not None:
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, cfg_dict, stop)


def _run(cfg: Config, cfg_dict: dict, stop: preemption.Preemption) -> dict:
    t = _setup(cfg, cfg_dict)
    state = _resume_or_start(t)
    n_updates = len(t.plan)
    tracker = tracking.start_stage_run(cfg.tracking, "ppo", params=used_params(cfg), iteration=cfg.iteration,
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())}) \
        if distributed.is_main() else tracking.NullTracker()  # one MLflow run, from rank 0
    with tracker:
        tracker.log_metrics({"data/responses": len(t.samples), "data/updates": n_updates}, step=t.base + state.update)
        tokens, seconds = _train(t, state, tracker, stop)
        _check_some_applied(cfg, state, n_updates - cfg.critic_warmup_steps)
        kl_state = kl_control.next_state(cfg, t.samples)
        metrics = {**_summary(state, n_updates, tokens, seconds), "train/kl_coef": kl_state["kl_coef"],
                   "train/rollout_kl": kl_state["measured_kl"], **t.prepass_metrics}
        _write_output(t, Result(kl_state, state.history, metrics))
        checkpoint.clear(t.work)
        # the iteration's summary as ppo/* (the per-update train/* curve keeps its own last point)
        tracker.log_metrics({f"ppo/{k.split('/', 1)[1]}": v for k, v in metrics.items()}, step=t.base + n_updates)
        tracker.log_parent_metrics({k: v for k, v in metrics.items() if k.startswith("train/")},
                                   step=cfg.iteration)  # one point per RL iteration on the pipeline run (pipeline/*)
    if distributed.is_main():
        nan = float("nan")
        print(f"ppo: {n_updates - state.skipped}/{n_updates} updates, policy loss "
              f"{metrics.get('train/policy_loss', nan):.4f}, clip frac {metrics.get('train/clip_frac', nan):.3f}, "
              f"kl_coef {kl_state['kl_coef']:.4g} -> {cfg.output}")
    return metrics


def _setup(cfg: Config, cfg_dict: dict) -> Training:
    """The batch and its plan, the models and their engines, the prepass over the batch (with the starting
    weights, before a resume), the ptx examples and the EMA."""
    samples = load_batch(cfg)
    if len(samples) < cfg.minibatch_size:
        raise ConfigError(f"'{cfg.input}' has {len(samples)} responses, fewer than minibatch_size="
                          f"{cfg.minibatch_size}; lower minibatch_size or generate more rollouts.")
    plan = minibatch_plan(len(samples), cfg)
    max_len = dr_grpo_length(cfg)  # (before any model is loaded: a missing budget fails at once)
    n_updates = len(plan)
    if cfg.critic_warmup_steps >= n_updates:
        raise ConfigError(f"critic_warmup_steps ({cfg.critic_warmup_steps}) leaves no update for the policy "
                          f"(this run has {n_updates}); lower it.")
    actor_updates = n_updates - cfg.critic_warmup_steps

    torch.manual_seed(cfg.seed)
    model, tokenizer = modeling.load_causal_lm(cfg.policy, cfg.engine.dtype)
    attach_pixels(cfg, samples, vision.Vision.of(tokenizer, model.config))
    modeling.freeze(model, cfg.freeze)
    disable_dropout(model)
    critic_model = load_critic(cfg, getattr(model.config, "vocab_size", None)) if cfg.train_critic else None
    actor = make_engine(model, cfg, cfg.optim.lr, cfg.rl_iterations * actor_updates, cfg.iteration * actor_updates,
                        cfg.micro_batch_size)
    critic = (make_engine(critic_model, cfg, cfg.critic_lr, cfg.rl_iterations * n_updates, cfg.iteration * n_updates,
                          cfg.micro_batch_size) if critic_model is not None else None)
    prepass_metrics = precompute(cfg, samples, plan, actor, critic, tokenizer.pad_token_id)
    ptx_examples = load_ptx(cfg, tokenizer) if cfg.ptx_coef else None
    ema = PolicyEMA(actor, cfg.ema_decay) if cfg.ema_decay else None
    updater = Updater(cfg, actor, critic, max_len=max_len)
    return Training(cfg, cfg_dict, samples, plan, updater, tokenizer, ptx_examples, ema,
                    checkpoint.work_dir_for(cfg.output), prepass_metrics)


def _resume_or_start(t: Training) -> TrainerState:
    """The state of a matching resume checkpoint loaded into the engines and the EMA; else a fresh state,
    with the previous iteration's optimizer moments when `optimizer_state` names them."""
    cfg = t.cfg
    resume_from = checkpoint.find(t.work, t.identity) if cfg.resume else None
    if resume_from is None:
        if cfg.optimizer_state:
            _load_moments(Path(cfg.optimizer_state), t.actor, t.critic if cfg.critic else None)
        return TrainerState()
    state = TrainerState.from_dict(t.actor.load_state(resume_from / "actor"))
    if t.critic is not None:
        t.critic.load_state(resume_from / "critic")
    if t.ema is not None:
        t.ema.load(resume_from)
    if distributed.is_main():
        print(f"ppo: resuming from update {state.update} ({resume_from})")
    return state


def _train(t: Training, state: TrainerState, tracker, stop: preemption.Preemption) -> tuple[int, float]:
    """The update loop from `state.update` to the end; returns (tokens trained on, seconds).

    Metrics are logged at step t.base + update (t.base: the updates of the earlier RL iterations)."""
    n_updates = len(t.plan)
    bar = tqdm(total=n_updates, initial=state.update, desc="ppo", unit="update", dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 10.0, disable=not distributed.is_main())
    t0, tokens = time.perf_counter(), 0
    while state.update < n_updates:
        u = state.update
        train_actor = u >= t.cfg.critic_warmup_steps
        stats = _update(t, u, train_actor)
        tokens += stats.pop("tokens", 0)

        # its record and metrics, applied or skipped alike
        state.update += 1
        if stats.get("skipped"):
            state.skipped += 1
            if "reason" in stats:  # a row's image tokens do not match its images
                state.image_skipped += 1
            why = stats.get("reason", "NaN/inf loss or gradient")
            log.warning("ppo: update %d skipped: %s", u + 1, why)
            bar.write(f"update {u + 1}: skipped ({why})")
        stats.update(update=u + 1, epoch=u // (n_updates // t.cfg.epochs), actor=train_actor)
        state.history.append(stats)
        tracker.log_metrics({**{f"train/{k}": v for k, v in stats.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("update", "epoch")},
                             "train/skipped_updates": state.skipped, "train/skipped_image_mismatch": state.image_skipped,
                             "perf/tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9)}, step=t.base + u + 1)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.get('policy_loss', float('nan')):.4f}", skipped=state.skipped, refresh=False)
        _checkpoint_or_stop(t, state, stop, bar)
    bar.close()
    return tokens, time.perf_counter() - t0


def _update(t: Training, u: int, train_actor: bool) -> dict:
    """Update u (and the EMA after it): its statistics, or {"skipped": True} (with the "reason" when a row's
    image tokens do not match its images) when it was skipped."""
    cfg, samples, pad_id = t.cfg, t.samples, t.tokenizer.pad_token_id
    bad = next((i for i in t.plan[u] if samples[i].image_mismatch), None)
    if bad is not None:
        return {"skipped": True, "reason": f"row {bad}: {samples[bad].image_mismatch}"}
    # this rank's share of every micro-batch of the minibatch (and of the ptx batch)
    whole = [collate(samples, rows, pad_id) for rows in micro_split(t.plan[u], cfg.micro_batch_size)]
    micro = whole if distributed.world_size() == 1 else [
        collate(samples, distributed.shard(rows), pad_id) for rows in micro_split(t.plan[u], cfg.micro_batch_size)]
    ptx = (ptx_batch(cfg, t.ptx_examples, u, cfg.minibatch_size // cfg.micro_batch_size, pad_id)
           if t.ptx_examples is not None and train_actor else None)
    stats = t.updater.update(micro, train_actor, shard_ptx(ptx), whole=whole)
    if stats is None:
        return {"skipped": True}
    if t.ema is not None and train_actor:
        t.ema.update(t.actor)
    return stats


def _checkpoint_or_stop(t: Training, state: TrainerState, stop: preemption.Preemption, bar) -> None:
    """A resume checkpoint every save_every updates, and on SIGTERM/SIGINT (then exit 143/130)."""
    more = state.update < len(t.plan)
    stopping = distributed.any_rank(stop.requested)  # the ranks stop at the same update, or none does
    if more and (stopping or (t.cfg.save_every and state.update % t.cfg.save_every == 0)):
        _save_resume(t, state)
    if more and stopping:
        bar.close()
        raise preemption.stopped("ppo", state.update, str(t.work / "latest"), stop.signum)


def _check_some_applied(cfg: Config, state: TrainerState, actor_updates: int) -> None:
    """Fail, writing nothing, when no policy update of the run was applied."""
    if any(h["actor"] for h in state.history if not h.get("skipped")):
        return
    if state.image_skipped:
        raise DataError(f"ppo: every policy update of this run was skipped, {state.image_skipped} of them "
                        f"because image tokens did not match the images (first: "
                        f"{next(h['reason'] for h in state.history if h.get('reason'))}). Nothing was written "
                        f"to '{cfg.output}'. Write the rollouts with the policy's own processor.")
    raise TrainingDivergedError(
        f"ppo: every policy update of this run ({actor_updates}) was skipped because a loss or gradient "
        f"was NaN/inf. Nothing was written to '{cfg.output}'. Lower lr, clamp advantages "
        f"(advantage_clip), turn on dual_clip, or check the advantages hand-off '{cfg.input}'.")


def _summary(state: TrainerState, n_updates: int, tokens: int, seconds: float) -> dict:
    """Means over the applied updates of the last epoch that trained the actor, plus counts."""
    applied = [h for h in state.history if not h.get("skipped")]
    last_epoch = max(h["epoch"] for h in applied)
    recent = [h for h in applied if h["epoch"] == last_epoch]
    keys = sorted({k for h in recent for k, v in h.items() if isinstance(v, float)})
    metrics = {f"train/{k}": sum(h[k] for h in recent if k in h) / sum(1 for h in recent if k in h) for k in keys}
    metrics.update({"train/updates": n_updates, "train/skipped_updates": state.skipped,
                    "train/skipped_image_mismatch": state.image_skipped,
                    "perf/tokens_per_s": tokens / max(seconds, 1e-9)})
    return metrics


def _load_moments(root: Path, actor, critic) -> None:
    """Continue the previous iteration's optimizers (OUTPUT/optimizer/{actor,critic})."""
    if not (root / "actor").is_dir():
        raise ModelLoadError(f"optimizer_state '{root}' has no actor/ directory; point it at a ppo output's "
                             f"optimizer/ directory, or leave it empty for a fresh optimizer.")
    actor.load_optimizer(root / "actor")
    if critic is not None and (root / "critic").is_dir():  # (a critic new in this iteration starts fresh)
        critic.load_optimizer(root / "critic")


def _save_resume(t: Training, state: TrainerState) -> None:
    """`work/latest` (atomically): both engines' state (weights, optimizer, schedule), EMA, trainer state."""
    with io.shared_output_dir(Path(t.work) / "latest", "resume-checkpoint", overwrite=True,
                              manifest={"trainer_state": {"update": state.update},
                                        "config": io.config_identity(t.identity)}) as tmp:
        t.actor.save_state(tmp / "actor", state.to_dict())  # collective: every rank's partition
        if t.critic is not None:
            t.critic.save_state(tmp / "critic", {"update": state.update})
        if t.ema is not None:
            t.ema.save(tmp)


def _write_output(t: Training, result: Result) -> None:
    """OUTPUT: policy/, critic/, policy_ema/ (HF), optimizer/, kl_state.json, updates.jsonl, atomically."""
    cfg = t.cfg
    parents = [cfg.policy, cfg.input] + [p for p in (cfg.critic, cfg.optimizer_state) if p]
    extra = {"stage": "ppo", "iteration": cfg.iteration, "metrics": result.metrics}
    main = distributed.is_main()  # writes the files; every rank takes part in gathers and DeepSpeed saves
    with io.shared_output_dir(cfg.output, "ppo", overwrite=True, manifest={
            "config": io.config_identity(t.identity), "metrics": result.metrics, "parents": parents}) as tmp:
        for name, engine in (("policy", t.actor), ("critic", t.critic)):
            if engine is not None:
                with engine.gathered():  # ZeRO-3 weights gathered once
                    if main:
                        modeling.save_pretrained(engine.module, t.tokenizer, tmp / name, extra=extra)
        if t.ema is not None:
            with t.ema.swapped_in(t.actor) as module:
                if main:
                    modeling.save_pretrained(module, t.tokenizer, tmp / "policy_ema",
                                             extra={**extra, "ema_decay": cfg.ema_decay})
        if cfg.save_optimizer:
            for name, engine in (("actor", t.actor), ("critic", t.critic)):
                if engine is not None:
                    engine.save_optimizer(tmp / "optimizer" / name)
        if main:
            kl_state_file.write(tmp / kl_state_file.KL_STATE_FILE, result.kl_state)
            (tmp / "updates.jsonl").write_text("".join(json.dumps(h, sort_keys=True) + "\n" for h in result.history))
