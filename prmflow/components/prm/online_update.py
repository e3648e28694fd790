"""On-policy PRM update: the PRM follows the policy, from the rollouts' own checked outcomes.

    prmflow prm-update --prm outputs/prm --input outputs/rollouts/iter0 --output outputs/prm-iter1
    prmflow prm-update --prm outputs/prm-iter1 --input outputs/rollouts/iter1 --output outputs/prm-iter2 \\
        --replay '[outputs/rollouts/iter0]' --replay_share 0.25 --iteration 1

A PRM fitted once on the SFT policy's samples goes stale as RL moves the policy, and RL farms its
errors. This stage keeps it on-policy (the recipe of DeepSeekMath's iterative RL, arXiv 2402.03300:
retrain the reward model on the policy's samples with a replay share of older data):
- Warm start: the weights of `prm` (a prm or prm-update output), its head and step separator kept;
  only its top `train_layers` decoder layers, final norm and head train.
- Labels with no extra rollouts: every step prefix of a response gets that response's checked
  outcome (outcome_reward >= label_threshold), so the PRM learns P(success | prefix) under the
  current policy, the value whose differences the advantage stage's `progress` mode rewards; or
  (labels=shared_prefix) 1 when any sample of the same prompt that starts with the same steps
  succeeded: the group's other samples as the prefix's completions.
- Replay: older rollouts (`replay`) make `replay_share` of the training examples, so the PRM does not
  forget what earlier policies got wrong.
- Evidence: `held_out` of this iteration's prompts (all their responses, and their older responses
  in `replay` too) are not trained on; the updated PRM's step AUC on them (prm-update/eval_step_auc)
  is logged every iteration, and so is the incoming PRM's AUC on the same responses
  (prm-update/before_step_auc).
- Resume and re-runs as the prm stage: a finished output of the same config and inputs is kept; a
  killed run resumes from `.OUTPUT.work/latest` (the same loop, lib/supervised.py). One process
  (the update is small; no torchrun launch).

The rollouts' `prompt` column is the prompt as the policy saw it (after its chat template); the PRM
learns from that text, which is what its scorer reads when the PRM renders prompts the way the policy
does (a PRM on the policy's backbone, as the quickstart's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..training import checkpoint
from .. import config as config_lib
from ..data import io, schema, steps as steps_lib
from ..runtime import preemption
from ... import tracking
from ..training.engine import EngineConfig, OptimSettings, TrainEngine
from ...errors import ConfigError, DataError
from ..training.optim import OptimConfig
from ..training import supervised
from ..models.prm_model import PRM, HeadConfig, freeze_below, saved_chat_template, saved_head, saved_separator
from . import step_examples as data
from .stage import PRMObjective, evaluate

log = logging.getLogger(__name__)


@dataclass
class Config:
    prm: str = "outputs/prm"
    """PRM to start from (a prm or prm-update output directory); its head and step separator are kept."""
    input: str = ""
    """This iteration's scored rollouts (a rollout output directory): the training data and the held-out evidence."""
    output: str = ""
    """Directory the updated PRM is written to (HF format + prmflow.json + manifest with the metrics), atomically."""
    replay: list[str] = field(default_factory=list)
    """Older rollouts directories (earlier iterations) to replay from; empty: this iteration's only."""
    replay_share: float = 0.25
    """Share of the training examples drawn from `replay` (at most what it holds), in [0, 1)."""
    held_out: float = 0.2
    """Share of this iteration's prompts (all their responses, and their older responses in replay) kept out of training
    to measure the step AUC, in (0, 1)."""
    label_threshold: float = 0.5
    """A response is a success (every step prefix labelled 1) when its outcome_reward is at least this."""
    implicit_beta: float = 0.0
    """> 0: `prm` may be a policy (a causal-LM directory, no prmflow.json): the update starts PRIME's implicit PRM from
    it, step logit beta x the log-likelihood ratio to a frozen copy
    (docs/process-rewards.md#4b-primes-implicit-prm-headkind-implicit). A PRM keeps its own head."""
    labels: Literal["outcome", "shared_prefix"] = "outcome"
    """How a step prefix is labelled. outcome: its response's checked outcome. shared_prefix: 1 if a response to the
    same prompt that starts with the same steps succeeded, else 0 (Math-Shepherd's hard estimate, no extra rollout;
    docs/process-rewards.md#4-the-prm-follows-the-policy-prmflow-prm-update)."""
    iteration: int = 0
    """RL iteration k whose rollouts train the PRM: tags the tracking run and seeds the split and the replay draw."""
    max_steps: int = 40
    """Optimizer steps of the update (an epoch is (1 - held_out) x rollouts / (micro_batch_size x grad_accum) steps)."""
    micro_batch_size: int = 32
    """Solutions per forward/backward pass."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    train_layers: int = 2
    """Train only the last train_layers decoder layers (plus the final norm and the head); 0 = everything."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, lr_schedule="constant"))
    """Optimizer; a warm start needs a lower lr than training from scratch (the prm stage uses 1e-3 with cosine decay)."""
    group_by_prompt: bool = True
    """Keep the responses of one prompt in the same batch (right and wrong side by side)."""
    max_seq_len: int = 512
    """Examples longer than this (prompt + response tokens) are dropped with a logged count."""
    seed: int = 0
    """Seed of the data order (the split and the replay draw also use iteration)."""
    log_every: int = 10
    """Log train/* metrics every this many steps."""
    eval_every: int = 0
    """Evaluate on the held-out responses every this many steps; 0 = at the end only."""
    save_every: int = 0
    """Write a resume checkpoint every this many steps (0 = only at the end)."""
    resume: bool = True
    """Continue from the checkpoint beside the output when one with the same config and inputs exists."""
    overwrite: bool = False
    """Replace an existing output written with a different config or inputs (otherwise that is an error)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(backend="torch"))
    """Training backend (plain PyTorch by default: one process, a small update)."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        if not 0 <= self.replay_share < 1:
            raise ConfigError(f"replay_share={self.replay_share} must be in [0, 1).")
        if self.labels not in ("outcome", "shared_prefix"):
            raise ConfigError(f"labels={self.labels!r} is not one of ['outcome', 'shared_prefix']; set labels to one "
                              f"of those.")
        if not 0 < self.held_out < 1:
            raise ConfigError(f"held_out={self.held_out} must be in (0, 1): the step AUC needs held-out responses "
                              f"and training needs the rest.")
        for key in ("max_steps", "micro_batch_size", "grad_accum", "max_seq_len", "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        if self.train_layers < 0 or self.eval_every < 0 or self.save_every < 0:
            raise ConfigError("train_layers, eval_every and save_every must be 0 or more.")
        if self.optim.warmup_steps >= self.max_steps:
            raise ConfigError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be smaller than "
                              f"max_steps ({self.max_steps}).")
        if self.replay_share > 0 and not self.replay:
            log.info("replay_share=%s but no replay directories: training on this iteration's rollouts only",
                     self.replay_share)


# --- data: rollouts -> step examples labelled by their own outcome -----------------------------

def rollout_examples(path: str, separator: str, threshold: float) -> list[data.StepExample]:
    """One StepExample per response with at least one step; every step labelled with the response's
    outcome (1 when outcome_reward >= threshold). A null outcome_reward is a DataError naming the row."""
    table = schema.read_dataset(path, "rollouts", ["prompt_id", "sample_idx", "iteration", "prompt", "response",
                                                   "outcome_reward"])
    out = []
    for i, r in enumerate(table.to_pylist()):
        where = f"rollouts '{path}' row {i} (prompt_id={r['prompt_id']!r}, sample_idx={r['sample_idx']})"
        if r["outcome_reward"] is None or not math.isfinite(r["outcome_reward"]):
            raise DataError(f"{where}: outcome_reward is {r['outcome_reward']!r}; the update labels every step with "
                            f"the response's checked outcome. Score the rollouts' final answers first.")
        steps = steps_lib.steps(r["response"] or "", separator)
        if not steps or not (r["prompt"] or "").strip():
            continue
        label = 1.0 if r["outcome_reward"] >= threshold else 0.0
        out.append(data.StepExample(r["prompt"], steps, [label] * len(steps), prompt_id=f"{r['iteration']}:{r['prompt_id']}",
                                    source="rollouts", where=where))
    return out


def shared_prefix_labels(examples: list[data.StepExample]) -> list[data.StepExample]:
    """labels=shared_prefix: step k of a response is 1 when some response to the same prompt (same
    rollouts iteration) whose first k+1 steps are the same text succeeded, else 0. The response itself
    is one of them, so a success keeps all 1s; a failure keeps 0 from the first step no success shares."""
    best: dict[tuple, float] = {}
    for e in examples:
        for k in range(len(e.steps)):
            key = (e.prompt_id, *e.steps[:k + 1])
            best[key] = max(best.get(key, 0.0), e.labels[k])
    return [dataclasses.replace(e, labels=[best[(e.prompt_id, *e.steps[:k + 1])] for k in range(len(e.steps))])
            for e in examples]


def prompt_of(example: data.StepExample) -> str:
    """The rollouts' prompt_id of an example, without the iteration `rollout_examples` puts before it:
    one prompt sampled in several iterations is one prompt (its groups stay apart by the full id)."""
    return example.prompt_id.split(":", 1)[1]


def split_by_prompt(examples: list[data.StepExample], share: float, seed: int) -> tuple[list, list]:
    """(train, held-out): `share` of the prompts (at least one, all their responses from every
    iteration given) held out, drawn by `seed`."""
    prompts = sorted({prompt_of(e) for e in examples})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[:max(1, round(share * len(prompts)))])
    return [e for e in examples if prompt_of(e) not in held], [e for e in examples if prompt_of(e) in held]


def draw_replay(cfg: Config, separator: str, n_current: int,
                held_prompts: frozenset[str] = frozenset()) -> list[data.StepExample]:
    """replay_share of the training set from the older rollouts (all of them when they hold fewer),
    never a response to one of `held_prompts` (older samples of a held-out prompt would teach the PRM
    the very problems its held-out AUC is measured on)."""
    if not cfg.replay or cfg.replay_share == 0:
        return []
    pool = [e for path in cfg.replay for e in rollout_examples(path, separator, cfg.label_threshold)
            if prompt_of(e) not in held_prompts]
    want = round(cfg.replay_share / (1 - cfg.replay_share) * n_current)
    rng = random.Random(f"replay:{cfg.seed}:{cfg.iteration}")
    return rng.sample(pool, min(want, len(pool)))


def training_data(cfg: Config, separator: str) -> tuple[list[data.StepExample], list[data.StepExample], list[data.StepExample]]:
    """(this iteration's training examples, replayed examples, held-out examples) with their labels:
    whole prompts held out, in this iteration's rollouts and in the replay alike."""
    current = rollout_examples(cfg.input, separator, cfg.label_threshold)
    if not current:
        raise DataError(f"rollouts '{cfg.input}' hold no response with a step; nothing to update the PRM on.")
    train_current, held = split_by_prompt(current, cfg.held_out, cfg.seed * 100_003 + cfg.iteration)
    replay = draw_replay(cfg, separator, len(train_current), frozenset(prompt_of(e) for e in held))
    if cfg.labels == "shared_prefix":  # by prompt: replay examples are their own iterations' groups
        train_current, replay = shared_prefix_labels(train_current), shared_prefix_labels(replay)
    return train_current, replay, held


# --- the stage -------------------------------------------------------------------------------

def _identity(cfg: Config) -> dict:
    d = config_lib.to_dict(cfg)
    if not d["implicit_beta"]:  # off (the default): outputs from before the key existed still match
        d.pop("implicit_beta")
    return checkpoint.identity(d)


def _inputs(cfg: Config) -> dict[str, str]:
    """Fingerprints of the PRM and every rollouts directory read; a directory of shard directories (a
    --num_shards output, or the pipeline's gathered shards) by each of its shards."""
    rollouts = [d for path in (cfg.input, *cfg.replay)
                for d in schema.open_dataset(path, "rollouts", verify_checksums=False).dirs]
    return io.fingerprint([cfg.prm, *rollouts])


def run(cfg: Config) -> dict:
    """Update the PRM at cfg.prm on cfg.input's rollouts; write it to cfg.output; return the metrics."""
    if not cfg.input or not cfg.output:
        raise ConfigError("prm-update needs input (this iteration's scored rollouts) and output (the updated PRM).")
    if cfg.prm and not Path(cfg.prm).exists():  # a typo: say so, not "not a PRM written by the prm stage"
        raise ConfigError(f"prm='{cfg.prm}' does not exist. Point it at the prm stage's output (or the last "
                          f"prm-update's).")
    if saved_head(cfg.prm) is None and not cfg.implicit_beta > 0:
        raise ConfigError(f"prm='{cfg.prm}' is not a PRM written by the prm stage (no prmflow.json); prm-update warm "
                          f"starts from one. Train one with `prmflow prm` first, or set implicit_beta (e.g. 0.05) to "
                          f"start PRIME's implicit PRM from this policy.")
    done = io.finished_output("prm-update", cfg.output, _identity(cfg), cfg.overwrite, inputs=_inputs(cfg))
    if done is not None:
        return done.get("metrics", {})
    with preemption.Preemption() as stop:
        return _run(cfg, stop)


def _run(cfg: Config, stop: preemption.Preemption) -> dict:
    separator = saved_separator(cfg.prm) or "\n"
    train_current, replay, held = training_data(cfg, separator)
    fresh = saved_head(cfg.prm) is None  # a policy: an implicit PRM starts from it (run() checked implicit_beta)
    prm = PRM.load(cfg.prm, HeadConfig("implicit", beta=cfg.implicit_beta) if fresh else None, cfg.engine.dtype,
                   seed=cfg.seed)
    if cfg.train_layers:
        freeze_below(prm.model, cfg.train_layers)
    tokenize = lambda ex: data.tokenize(ex, prm.tokenizer, separator, prm.head.step_tag, cfg.max_seq_len)  # noqa: E731
    train, dropped = tokenize(train_current + replay)
    held_out, _ = tokenize(held)
    if not held_out:
        raise DataError(f"rollouts '{cfg.input}': no held-out response fits max_seq_len={cfg.max_seq_len}; raise it.")
    schedule = supervised.Schedule(cfg.micro_batch_size, cfg.grad_accum, cfg.max_steps, cfg.log_every,
                                   cfg.eval_every or cfg.max_steps, cfg.save_every)
    schedule.check_fits(len(train))
    engine = TrainEngine(prm.model, cfg.engine, OptimSettings(
        lr=cfg.optim.lr, total_steps=cfg.max_steps, warmup_steps=cfg.optim.warmup_steps, schedule=cfg.optim.lr_schedule,
        weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.max_grad_norm), cfg.micro_batch_size, cfg.grad_accum)
    identity, inputs = _identity(cfg), _inputs(cfg)
    resume_identity = {**identity, "inputs": inputs}
    before = {f"before_{k.split('/', 1)[1]}": v for k, v in  # the incoming PRM, before any resumed state
              evaluate(prm, held_out, cfg.micro_batch_size * 4, model=engine.module).items()}
    work = checkpoint.work_dir_for(cfg.output)
    state = supervised.resume(engine, work, resume_identity, cfg.resume, "prm-update")
    tracker = tracking.start_stage_run(cfg.tracking, "prm-update", params=config_lib.flat_dict(cfg), iteration=cfg.iteration,
                                       tags={"prmflow.output": str(Path(cfg.output).resolve())})
    with tracker:
        n_steps = sum(len(e.step_ends) for e in train)
        counts = {"data/train_examples": len(train), "data/replay_examples": len(replay), "data/held_out_examples": len(held_out),
                  "data/positive_fraction": sum(y >= 0.5 for e in train for y in e.labels) / max(n_steps, 1),
                  "data/dropped_too_long": dropped}
        tracker.log_metrics({**counts, **{f"eval/{k}": v for k, v in before.items()}}, step=state["step"])
        metrics = supervised.train(PRMObjective(cfg, prm, train, held_out), schedule, engine, prm.tokenizer, state,
                                   work, resume_identity, tracker, stop)
        metrics.update({f"eval/{k}": v for k, v in before.items()})
        metrics.update(counts)
        manifest = {"config": identity, "inputs": inputs, "metrics": metrics, "parents": [cfg.prm, cfg.input, *cfg.replay]}
        with io.atomic_output_dir(cfg.output, "prm", overwrite=True, manifest=manifest) as tmp:
            # the rollouts' prompts went through the policy's chat template (when it has one): a PRM started
            # from the policy reads them so; an updated PRM keeps what it was trained with
            chat = True if fresh else saved_chat_template(cfg.prm)
            prm.save(tmp, separator, chat, model=engine.module, extra={"metrics": metrics})
        checkpoint.clear(work)
    print(f"prm-update: iteration {cfg.iteration}: held-out step AUC {metrics['eval/before_step_auc']:.3f} -> "
          f"{metrics['eval/step_auc']:.3f} on {len(held_out)} responses ({len(train)} trained on, {len(replay)} replayed) "
          f"-> {cfg.output}")
    return metrics
