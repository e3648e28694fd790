"""Do step rewards beat outcome-only GRPO at equal rollout budget? (docs/results.md, "Long chains with a risky shortcut")

    python benchmarks/experiments/prm_vs_outcome.py --config configs/prm-vs-outcome.yaml
    python benchmarks/experiments/prm_vs_outcome.py --config configs/prm-vs-outcome.yaml --set seeds=[0] --set iterations=2
    python benchmarks/experiments/prm_vs_outcome.py --help          # every key, with its meaning and default

One SFT policy and one PRM (trained once into OUTPUT/sft and OUTPUT/prm; a complete one is reused),
then for every variant x seed an RL loop run in-process through the stages' `run(config)`:
rollout -> advantage -> ppo, `iterations` times, with the same prompts, samples, PPO settings and
seeds for every variant (seed s picks the prompts and the samples; variants differ only in the
advantage estimator and where step rewards come from: `prm: ""` none, `oracle` the exact checker's
step labels, `trained` OUTPUT/prm, `adversarial` 1 for every shortcut line and 0 for every single step,
`random` uniform scores, `answer-adversarial` the answer line judged right (0.9 when the response is right,
0.1 when not) and the other steps as `adversarial` (what real PRMs are like: good at answers, bad at steps),
`long-lines` the answer line judged right and every other step scored by its length (longer lines higher:
merged shortcut lines are longer), `checker-likes-shortcuts` the exact checker on single steps and the answer line but
every shortcut line scored 1 (right on the whole, wrong in one consistent place), `noisy-checker` the exact checker with
each step's label flipped with probability 0.25 (a mediocre PRM, unbiased), `constant` 0.5 for every step (the
credit's mechanics without a PRM), `implicit` PRIME's implicit PRM started from the SFT policy (every step 0.5 at first;
it needs an `update` section with implicit_beta), `trained-implicit` an implicit PRM trained like the PRM first
(OUTPUT/prm-implicit, `implicit_prm`), `trained-likes-shortcuts` the same implicit PRM trained on the same data with
every shortcut line labelled 1 (OUTPUT/prm-implicit-likes-shortcuts: a trained PRM with checker-likes-shortcuts' bias);
a variant with an `update` section keeps its trained PRM on-policy: after
every rollout `prmflow prm-update` trains it further on those rollouts' own outcomes (replaying the
older iterations' rollouts) and the next rollout is scored by the updated PRM). After every PPO update the policy
answers the same held-out test-split prompts greedily (pass@1, graded by the task's verifier). Per point it records the train
reward and the reward-hacking watch (steps per response, response length, share without the step
separator, format errors, share of shortcut steps) of the training batch and of the greedy answers,
and for every variant with step rewards the PRM's step AUC on the policy's own samples (checker labels),
its mean score of right and wrong steps per kind (shortcut line, single step, answer line), the
advantage stage's gate (its AUC against the outcomes and the process weight it allowed) and the
update's held-out AUC before and after.

Writes OUTPUT/results.json (with `start`: the sha256 of the SFT policy's and the PRMs' weights and the CPU kernels that
made them, `start_fingerprint`), OUTPUT/table.md (final pass@1 over seeds, McNemar over prompts per
seed and a paired t-test over seeds against `reference`), OUTPUT/curves.png, OUTPUT/benchmark.log
(the stages' own output) and an MLflow store OUTPUT/mlflow.db: a parent run per variant (seed-mean
curves, the table and the PNG as artifacts) with one child run per seed. A finished variant x seed
(OUTPUT/runs/VARIANT/seed-S/result.json, made by the same config: its digest; a calibrated variant's also by the
same advantage.progress.CALIBRATION_REVISION) is not run again, so an interrupted run resumes. Processes
started on the same OUTPUT share the work: the SFT policy and PRMs are trained by one while the others wait, a
variant x seed is run by whichever takes its lock first (OUTPUT/runs/VARIANT/seed-S.lock), and a process leaves a
run another holds to the end of its list, then waits for it and reads its result (OMP_NUM_THREADS=1 in each on a
small machine); the table, figure and MLflow runs are written by one process at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prm_vs_outcome_stats as bench_stats  # noqa: E402

from prmflow.components.advantage import stage as advantage  # noqa: E402
from prmflow.components.advantage.config import RECIPE  # noqa: E402
from prmflow.components.advantage.estimators import ESTIMATORS  # noqa: E402
from prmflow.components.advantage.progress import CALIBRATION_REVISION  # noqa: E402
from prmflow.components import config as config_lib
from prmflow.components.models import modeling
from prmflow.components.data import schema, steps as steps_lib  # noqa: E402
from prmflow import tasks
from prmflow.errors import ConfigError, PrmflowError  # noqa: E402
from prmflow.components.sampling.generation import generate_texts  # noqa: E402
from prmflow.tasks import arithmetic  # noqa: E402
from prmflow.components.scoring.prm_metrics import roc_auc  # noqa: E402
from prmflow.components.ppo import stage as ppo  # noqa: E402
from prmflow.components.prm import stage as prm_stage, online_update as prm_update  # noqa: E402
from prmflow.components.rollout import prompts as rollout_prompts, stage as rollout  # noqa: E402
from prmflow.components.sft import stage as sft  # noqa: E402
from prmflow.pipelines.pipeline import check_schedule  # noqa: E402

OFF = {"enabled": False}
#: where a variant's step rewards come from ('' = none)
PRM_KINDS = ("", "oracle", "trained", "adversarial", "random", "answer-adversarial", "long-lines", "constant",
             "checker-likes-shortcuts", "noisy-checker", "implicit", "trained-implicit", "trained-likes-shortcuts")
#: the PRMs a variant's `update` section can keep on-policy (a model, not a rule)
UPDATABLE = ("trained", "implicit", "trained-implicit", "trained-likes-shortcuts")
#: where each trained PRM kind is written under OUTPUT
TRAINED_DIRS = {"trained": "prm", "trained-implicit": "prm-implicit", "trained-likes-shortcuts": "prm-implicit-likes-shortcuts"}
#: the PRMs that rescore the oracle-scored rollouts (rescore): bad PRMs a stage user might bring
RESCORED = ("adversarial", "random", "answer-adversarial", "long-lines", "constant", "checker-likes-shortcuts",
            "noisy-checker")
#: noisy-checker: the chance that a step's checker label is flipped
NOISE_FLIP = 0.25
log = logging.getLogger("prm_vs_outcome")


@dataclass
class BenchConfig:
    output: str = "outputs/prm-vs-outcome"
    """Directory for the shared SFT policy and PRM, every run, the table, the PNG and the MLflow store."""
    arithmetic: dict = field(default_factory=dict)
    """The task's difficulty (ArithmeticConfig keys: min_ops, max_ops, shortcut_frac, ...), laid under every stage and
    the held-out prompts; a stage section's own `arithmetic` wins."""
    sft: dict = field(default_factory=dict)
    """sft stage keys (`prmflow sft --help`) for the one shared SFT policy (output is OUTPUT/sft)."""
    prm: dict = field(default_factory=dict)
    """prm stage keys for the one shared PRM on the SFT backbone (output is OUTPUT/prm)."""
    implicit_prm: dict = field(default_factory=lambda: {"head": {"kind": "implicit", "beta": 0.1}})
    """prm stage keys laid over `prm` for the implicit PRM that `prm: trained-implicit` variants start from: the same
    data and schedule, PRIME's implicit head (output is OUTPUT/prm-implicit)."""
    rollout: dict = field(default_factory=dict)
    """rollout stage keys shared by every variant (num_prompts, n_samples, sampling); seed, iteration and prm are set per run."""
    ppo: dict = field(default_factory=dict)
    """ppo stage keys shared by every variant (epochs, batch sizes, optim); seed and rl_iterations are set per run."""
    variants: dict = field(default_factory=lambda: {"outcome-only": {"prm": "", "advantage": {"estimator": "grpo"}}})
    """name -> {prm: '' | oracle | trained | adversarial | random, advantage: {advantage stage keys}, update:
    {prm-update keys}, ppo: {ppo keys laid over the shared ppo section}, schedule: serial | off_by_one}: what
    differs between variants (update: keep the trained PRM on-policy; schedule off_by_one: rollout k samples with
    the policy, and is scored by the PRM, of one update earlier, as `pipeline.schedule: off_by_one` in the DAG,
    which needs ppo: {rollout_correction: token_truncate, recompute_old_logprobs: true})."""
    reference: str = "outcome-only"
    """The variant every other one is tested against (paired over prompts and over seeds)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of rollout (prompts, samples) and ppo; every variant runs every seed, so seed s pairs variants."""
    iterations: int = 4
    """RL iterations per run (each: rollout.num_prompts x rollout.n_samples responses, one PPO update)."""
    eval_prompts: int = 300
    """Held-out test-split prompts answered greedily after every update (the same ones for every run)."""
    eval_seed: int = 0
    """Seed that picks the held-out prompts."""
    eval_max_new_tokens: int = 96
    """Token budget of a greedy held-out answer."""
    only: list[str] = field(default_factory=list)
    """Run and tabulate only these variants (and `reference`), e.g. --set only=[outcome-only,random-units]; empty: all.
    Only their PRMs are trained."""
    run_missing: bool = True
    """Run every variant x seed not finished yet; false: only write the table, figure and MLflow runs of the finished
    ones (e.g. while other processes still run the rest)."""
    experiment: str = "prm-vs-outcome"
    """MLflow experiment of the parent (variant) and child (seed) runs in OUTPUT/mlflow.db."""

    def __post_init__(self):
        unknown = sorted(set(self.only) - set(self.variants))
        if unknown:
            raise ConfigError(f"only names {unknown}, which are not variants; choose from {sorted(self.variants)}.")
        if self.only:
            self.variants = {k: v for k, v in self.variants.items() if k in self.only or k == self.reference}
        if self.reference not in self.variants:
            raise ConfigError(f"reference={self.reference!r} is not one of the variants {sorted(self.variants)}.")
        for name, v in self.variants.items():
            if not isinstance(v, dict) or set(v) - {"prm", "advantage", "update", "ppo", "schedule"}:
                raise ConfigError(f"variants.{name} must be a mapping with keys prm, advantage, update, ppo and "
                                  f"schedule, got {v!r}.")
            if v.get("schedule", "serial") not in ("serial", "off_by_one"):
                raise ConfigError(f"variants.{name}.schedule={v['schedule']!r}: use serial or off_by_one.")
            try:  # the DAG's own rule: off by one needs the recomputed ratio and the importance weight
                check_schedule(v.get("schedule", "serial"), config_lib.build(
                    ppo.Config, {**self.ppo, **v.get("ppo", {})}, where=f"variants.{name}.ppo"))
            except ConfigError as e:
                raise ConfigError(f"variants.{name} (its ppo keys go in variants.{name}.ppo): {e}") from e
            if v.get("prm", "") not in PRM_KINDS:
                raise ConfigError(f"variants.{name}.prm={v['prm']!r}: use '' (no step rewards), "
                                  f"{', '.join(PRM_KINDS[1:])}.")
            if "update" in v and v.get("prm") not in UPDATABLE:
                raise ConfigError(f"variants.{name}.update keeps a trained PRM on-policy; set prm to one of "
                                  f"{', '.join(UPDATABLE)} or drop update.")
            if v.get("prm") == "implicit" and not float(v.get("update", {}).get("implicit_beta", 0)) > 0:
                raise ConfigError(f"variants.{name}: prm: implicit starts PRIME's implicit PRM from the SFT policy and "
                                  f"updates it every iteration; give it update: {{implicit_beta: 0.05, ...}}.")
        if not self.seeds or self.iterations < 1 or self.eval_prompts < 1:
            raise ConfigError("seeds must be non-empty and iterations, eval_prompts at least 1.")


# --- the shared start: SFT policy and PRM -------------------------------------------------------

def stage_config(cls, cfg: BenchConfig, section: dict, **fixed):
    """A stage config from its section, the shared task difficulty under it, and the run's own keys."""
    values = {**section, **fixed, "tracking": OFF}
    if "arithmetic" in {f.name for f in cls.__dataclass_fields__.values()}:
        values["arithmetic"] = {**cfg.arithmetic, **section.get("arithmetic", {})}
    return config_lib.build(cls, values, where=f"{cls.__module__}")


def train_shared(cfg: BenchConfig, out: Path) -> dict:
    """Train (or reuse) the SFT policy and the PRM; return the PRM's held-out metrics."""
    sft.run(stage_config(sft.Config, cfg, cfg.sft, output=str(out / "sft")))
    kinds = {v.get("prm") for v in cfg.variants.values()}
    if "trained-implicit" in kinds:
        prm_stage.run(stage_config(prm_stage.Config, cfg, {**cfg.prm, **cfg.implicit_prm}, backbone=str(out / "sft"),
                                   output=str(out / "prm-implicit")))
    if "trained-likes-shortcuts" in kinds:
        train_likes_shortcuts(cfg, out)
    if "trained" not in kinds:
        return {}
    prm_stage.run(stage_config(prm_stage.Config, cfg, cfg.prm, backbone=str(out / "sft"), output=str(out / "prm")))
    from prmflow.components.data import io

    return io.read_manifest(out / "prm").get("metrics", {})


def likes_shortcuts(steps: list[str], labels: list[float]) -> list[float]:
    """The checker's step labels with checker-likes-shortcuts' one error: every merged line labelled 1."""
    return [1.0 if arithmetic.is_shortcut(step) else float(y) for step, y in zip(steps, labels, strict=True)]


def likes_shortcuts_data(cfg: BenchConfig, out: Path) -> Path:
    """Where train_likes_shortcuts keeps its training data: named by everything that makes it (the SFT policy's and
    the PRM's keys, the task), so data made by another config is never reused."""
    c = config_lib.to_dict(cfg)
    key = json.dumps({k: c[k] for k in ("arithmetic", "sft", "prm", "implicit_prm")}, sort_keys=True)
    return out / f"prm-implicit-likes-shortcuts-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsonl"


def train_likes_shortcuts(cfg: BenchConfig, out: Path) -> None:
    """The implicit PRM of `trained-implicit` (same backbone, head, data and schedule) trained on labels with one
    consistent error: every merged (shortcut) line labelled 1, right or wrong, the other labels the checker's (a
    trained counterpart of checker-likes-shortcuts: a PRM a stage user might bring, biased where its labeller was).
    Its held-out figures are against the checker's exact labels (the arithmetic eval split)."""
    from prmflow.components.prm import step_examples as prm_data

    section = {**cfg.prm, **cfg.implicit_prm}
    data_file = likes_shortcuts_data(cfg, out)
    if not data_file.is_file():
        train, _ = prm_data.load_data(stage_config(prm_stage.Config, cfg, section, backbone=str(out / "sft"),
                                                   output=str(out / TRAINED_DIRS["trained-likes-shortcuts"])))
        for ex in train:
            ex.labels = likes_shortcuts(ex.steps, ex.labels)
        tmp = data_file.with_name(f".{data_file.name}.tmp")
        prm_data.write_jsonl(train, tmp)
        tmp.replace(data_file)  # whole or absent: a file left by an interrupted run is never read
    rows = sum(1 for _ in data_file.open(encoding="utf-8"))
    prm_stage.run(stage_config(prm_stage.Config, cfg, {**section, "policy_from_backbone": False},
                               task=str(data_file), eval_task="arithmetic", num_prompts=rows, backbone=str(out / "sft"),
                               output=str(out / TRAINED_DIRS["trained-likes-shortcuts"])))


def start_fingerprint(out: Path) -> dict:
    """What tells one start from another across machines: the sha256 of the SFT policy's weights and of each
    trained PRM's (its manifest's digest of model.safetensors, what `sha256sum` prints; an implicit PRM's reference
    is the SFT policy's copy), first 16 hex digits, and the float kernels that made them. The same config makes
    other weights on a CPU with other kernels (docs/experiments/5e-rebuilt-from-a-clean-checkout.md), so two
    outputs with equal seeds but different digests are different starts."""
    import platform

    import torch
    from prmflow.components.data import io

    weights = {}
    for name in ("sft", *TRAINED_DIRS.values()):
        if (out / name / "manifest.json").is_file():
            digest = io.read_manifest(out / name).get("files", {}).get("model.safetensors")
            if digest:
                weights[name] = digest[:16]
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
               platform.processor() or platform.machine())
    return {"weights_sha256": weights, "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


# --- held-out evaluation (the evaluate stage's library: greedy generation, the task's grader) -------

def heldout_records(cfg: BenchConfig) -> list[tasks.PromptRecord]:
    return tasks.load("arithmetic", "test", cfg.eval_prompts, cfg.eval_seed, **cfg.arithmetic)


def evaluate(policy: Path, records: list[tasks.PromptRecord], max_new_tokens: int) -> dict:
    """Greedy answers to the held-out prompts: {"pass1", "correct": [0/1], "eval/<stat>"}."""
    model, tok = modeling.load_causal_lm(str(policy))
    prompts = [tasks.render_prompt(tok, r) for r in records]
    special = not any(tasks.templated(tok, r) for r in records)
    answers = generate_texts(model, tok, prompts, max_new_tokens, batch_size=len(prompts), add_special_tokens=special)
    correct = [int(tasks.verify(r, a)) for r, a in zip(records, answers)]
    lengths = [len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers]
    stats = bench_stats.response_stats(answers, lengths)
    return {"pass1": sum(correct) / len(correct), "correct": correct, **{f"eval/{k}": v for k, v in stats.items()}}


# --- one variant x seed -----------------------------------------------------------------------

def step_kind(step: str) -> str:
    """shortcut (two operations in one line), answer (the `answer: N` line) or single (one operation)."""
    if arithmetic.is_shortcut(step):
        return "shortcut"
    return "answer" if step.strip().startswith(arithmetic.ANSWER_PREFIX.strip()) else "single"


def train_batch_stats(rollout_cfg, out: Path, with_prm: bool) -> dict:
    """The training batch's watch stats and, when a PRM scored it, its step AUC against the checker and its
    mean score of right and wrong steps of each kind (prm/score_<kind>_<right|wrong>)."""
    table = schema.read_dataset(out, "rollouts")
    responses = table.column("response").to_pylist()
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    point = {f"train/{k}": v for k, v in bench_stats.response_stats(responses, lengths).items()}
    if with_prm:
        raw = {r.prompt_id: r.prompt for r in rollout_prompts.select_prompts(rollout_cfg)}
        scores, labels, by_kind = [], [], {}
        for row, (pid, resp, sr) in enumerate(zip(table.column("prompt_id").to_pylist(), responses,
                                                   table.column("step_rewards").to_pylist())):
            steps = steps_lib.steps(resp, rollout_cfg.step_separator)
            row_labels = arithmetic.step_labels(raw[pid], arithmetic.STEP_SEPARATOR.join(steps))
            if len(sr or []) != len(row_labels):  # the PRM and the checker split the steps differently
                raise ValueError(f"{out}: row {row} (prompt {pid!r}) has {len(sr or [])} PRM step rewards but the "
                                 f"checker labels {len(row_labels)} steps; the step AUC would pair the wrong steps "
                                 f"(are rollout.step_separator and the PRM's step_separator the same?)")
            labels += row_labels
            scores += list(sr or [])
            for step, y, x in zip(steps, row_labels, sr or []):
                by_kind.setdefault(f"prm/score_{step_kind(step)}_{'right' if y else 'wrong'}", []).append(x)
        point["prm/step_auc_on_policy"] = roc_auc(scores, labels)
        point["prm/step_label_mean"] = sum(labels) / max(len(labels), 1)
        point.update({k: sum(v) / len(v) for k, v in sorted(by_kind.items())})
    return point


def bad_prm_score(kind: str, step: str, right: bool, label: float, rng) -> float:
    """A bad PRM's score of the prefix that ends with `step` of a response whose answer is `right`, `label` the
    exact checker's label of that prefix (1 while every step so far is right, else 0):
    adversarial: 1 for a shortcut line, 0 for any other step; random: uniform; constant: 0.5;
    answer-adversarial: the answer line 0.9 if right else 0.1, the other steps as adversarial;
    long-lines: the answer line as answer-adversarial, another step n / (n + 8) for its n characters;
    checker-likes-shortcuts: 1 for a shortcut line, the checker's label for any other step (the answer line too);
    noisy-checker: the checker's label, flipped with probability NOISE_FLIP."""
    if kind == "random":
        return rng.random()
    if kind == "constant":
        return 0.5
    if kind == "checker-likes-shortcuts":
        return 1.0 if arithmetic.is_shortcut(step) else float(label)
    if kind == "noisy-checker":
        return 1.0 - float(label) if rng.random() < NOISE_FLIP else float(label)
    if kind != "adversarial" and step_kind(step) == "answer":
        return 0.9 if right else 0.1
    if kind == "long-lines":
        n = len(step.strip())
        return n / (n + 8)
    return float(arithmetic.is_shortcut(step))


def rescore(rollout_cfg, src: Path, dst: Path, kind: str, seed: int, iteration: int) -> None:
    """Copy the rollouts at `src` to `dst` with step rewards of a bad PRM (`bad_prm_score`; random is seeded
    by seed, iteration)."""
    import random

    import pyarrow as pa

    rng = random.Random(f"{kind}:{seed}:{iteration}")
    table = schema.read_dataset(src, "rollouts")
    new = []
    for resp, old, outcome in zip(table.column("response").to_pylist(), table.column("step_rewards").to_pylist(),
                                  table.column("outcome_reward").to_pylist()):
        steps = steps_lib.steps(resp, rollout_cfg.step_separator)
        assert len(steps) == len(old or []), "rollout step_rewards and the steps of the text disagree"
        new.append([bad_prm_score(kind, x, (outcome or 0.0) >= 0.5, y, rng) for x, y in zip(steps, old or [])])
    column = pa.array(new, type=table.schema.field("step_rewards").type)
    table = table.set_column(table.schema.get_field_index("step_rewards"), "step_rewards", column)
    with schema.DatasetWriter(dst, "rollouts", parents=[str(src)]) as w:
        w.write(table)


def implicit_start(out: Path, beta: float) -> Path:
    """PRIME's implicit PRM as it starts: the SFT policy and a frozen copy as its reference (written once)."""
    from prmflow.components.data import io
    from prmflow.components.models.prm_model import PRM, HeadConfig

    dst = out / f"prm-implicit-beta{beta:g}"
    if not (dst / "manifest.json").is_file():
        prm = PRM.load(str(out / "sft"), HeadConfig("implicit", beta=beta))
        with io.atomic_output_dir(dst, "prm", overwrite=True, manifest={"parents": [str(out / "sft")]}) as tmp:
            prm.save(tmp, "\n", True)
    return dst


def advantage_identity(section: dict) -> dict:
    """A variant's advantage section as its run digest reads it: for grpo_progress every key of the recommended
    recipe (advantage.config.RECIPE) with the value the stage fills in where the section leaves it empty, so
    `estimator: grpo_progress` alone and the six keys the regime configs spelled out before are one run (the
    same digest as those finished runs); other keys as written."""
    cfg = config_lib.build(advantage.Config, config_lib.flatten(section), where="advantage section")
    if not ESTIMATORS[cfg.estimator].process:
        return dict(section)
    filled = cfg.filled()
    return {**section, **{k: getattr(filled, k) for k in RECIPE}}


def run_digest(cfg: BenchConfig, name: str | None) -> str:
    """Digest of everything that makes a run's result (or, name None, the shared start and its evaluation)."""
    c = config_lib.to_dict(cfg)
    keys = ["arithmetic", "sft", "prm", "eval_prompts", "eval_seed", "eval_max_new_tokens"]
    if name is not None:
        keys += ["rollout", "ppo", "iterations"]
    picked = {k: c[k] for k in keys}
    if name is not None:
        variant = c["variants"][name]
        picked["variant"] = {**variant, **({"advantage": advantage_identity(variant["advantage"])}
                                           if "advantage" in variant else {})}
        if picked["variant"].get("prm") in ("trained-implicit", "trained-likes-shortcuts"):  # the implicit PRM's keys
            picked["implicit_prm"] = c["implicit_prm"]
        if picked["variant"].get("advantage", {}).get("process_calibration") == "isotonic":  # code, not config
            picked["calibration_revision"] = CALIBRATION_REVISION
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def finished(cfg: BenchConfig, out: Path, name: str, seed: int) -> bool:
    """A result of this variant x seed made by this config is on disk."""
    done = out / "runs" / name / f"seed-{seed}" / "result.json"
    return done.exists() and json.loads(done.read_text()).get("config_digest") == run_digest(cfg, name)


@contextlib.contextmanager
def locked(path: Path, wait: bool = True):
    """Hold an exclusive lock on `path` (flock: the kernel drops it when the holder dies); yields False, holding
    nothing, when `wait` is false and another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_one(cfg: BenchConfig, out: Path, name: str, seed: int, sft_point: dict, records, wait: bool = True) -> dict | None:
    """One RL run; its result (points 0..iterations, final per-prompt correctness) is saved and returned. Another
    process running it holds its lock: wait for it and return its result, or with `wait` false return None at once
    (its unfinished directory is never removed from under it)."""
    with locked(out / "runs" / name / f"seed-{seed}.lock", wait) as held:
        return _run_one(cfg, out, name, seed, sft_point, records) if held else None


def _run_one(cfg: BenchConfig, out: Path, name: str, seed: int, sft_point: dict, records) -> dict:
    variant = cfg.variants[name]
    work = out / "runs" / name / f"seed-{seed}"
    done = work / "result.json"
    key = run_digest(cfg, name)
    if done.exists():
        result = json.loads(done.read_text())
        if result.get("config_digest") == key:
            return result
    if work.exists():  # unfinished, or made by another config: start it over
        shutil.rmtree(work)
    work.mkdir(parents=True)
    kind = variant.get("prm", "")
    prm = {"": "", "oracle": "oracle", **{k: "oracle" for k in RESCORED}, "implicit": "",
           **{k: str(out / d) for k, d in TRAINED_DIRS.items()}}[kind]
    if kind == "implicit":  # the first rollout is scored by the policy's own copy (every step 0.5)
        prm = str(implicit_start(out, float(variant["update"]["implicit_beta"])))
    batch = int(cfg.rollout.get("num_prompts", 64)) * int(cfg.rollout.get("n_samples", 4))
    ppo_section = {**cfg.ppo, **variant.get("ppo", {})}
    lag = 1 if variant.get("schedule", "serial") == "off_by_one" else 0
    policy, optimizer = out / "sft", ""
    policies, prms = [policy], [prm]  # after 0, 1, ... updates: rollout k samples with [k - lag] (the DAG's order)
    points = [{k: v for k, v in sft_point.items() if k != "correct"}]
    correct = sft_point["correct"]
    t0 = time.perf_counter()
    for k in range(cfg.iterations):
        it = work / f"iter{k}"
        behind = max(0, k - lag)
        rcfg = stage_config(rollout.Config, cfg, cfg.rollout, policy=str(policies[behind]),
                            output=str(it / "rollouts"), seed=seed, iteration=k, prm=prms[behind], log_samples=0)
        m = rollout.run(rcfg)
        scored = it / "rollouts"
        if kind in RESCORED:  # rolled out with the oracle for the step ends, then rescored
            scored = it / f"rollouts-{kind}"
            rescore(rcfg, it / "rollouts", scored, kind, seed, k)
        points[-1].update({"train_reward": m["rollout/reward_mean"], **train_batch_stats(rcfg, scored, bool(kind))})
        adv = advantage.run(config_lib.build(advantage.Config, {**variant.get("advantage", {}), "input": str(scored),
                                                                "output": str(it / "advantages"), "iteration": k,
                                                                "tracking": OFF}))
        points[-1].update({key: adv[key] for key in ("advantage/prm_step_auc", "advantage/process_weight",
                                                     "advantage/prm_calibrated_spread", "advantage/prm_label_auc",
                                                     "advantage/labelled_share") if key in adv})
        if "update" in variant:  # the PRM follows the policy: trained on these rollouts for the next iteration
            upd = prm_update.run(config_lib.build(prm_update.Config, {
                **variant["update"], "prm": prm, "input": str(it / "rollouts"), "output": str(it / "prm"),
                "replay": [str(work / f"iter{j}" / "rollouts") for j in range(k)], "iteration": k, "seed": seed,
                "tracking": OFF}))
            points[-1].update({"prm/update_auc_before": upd["eval/before_step_auc"],
                               "prm/update_auc_after": upd["eval/step_auc"]})
            prm = str(it / "prm")
        prms.append(prm)
        ppo.run(stage_config(ppo.Config, cfg, ppo_section, policy=str(policy), input=str(it / "advantages"),
                             output=str(it / "ppo"), iteration=k, rl_iterations=cfg.iterations, seed=seed,
                             optimizer_state=optimizer))
        policy, optimizer = it / "ppo" / "policy", str(it / "ppo" / "optimizer")
        policies.append(policy)
        ev = evaluate(policy, records, cfg.eval_max_new_tokens)
        correct = ev.pop("correct")
        points.append({"iteration": k + 1, "rollouts": (k + 1) * batch, **ev})
        log.info("%s seed %d iteration %d: %s", name, seed, k, json.dumps(points[-2]))
    result = {"variant": name, "seed": seed, "points": points, "final_correct": correct,
              "seconds": time.perf_counter() - t0, "config_digest": key}
    done.write_text(json.dumps(result))
    return result


# --- MLflow ---------------------------------------------------------------------------------------

#: a point's keys as MLflow metric names (the others are already namespaced: train/..., eval/..., prm/...)
METRIC_NAMES = {"pass1": "eval/pass1", "train_reward": "train/reward"}


def log_mlflow(cfg: BenchConfig, out: Path, results: dict, table: str, png: Path) -> None:
    """A parent run per variant (seed-mean curves, the table, the PNG) with a child run per seed; a variant
    whose results were logged before (same digest) is not logged twice."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    exp = mlflow.set_experiment(cfg.experiment)
    client = mlflow.MlflowClient()
    for name, runs in results.items():
        digest = hashlib.sha256(json.dumps([runs[s] for s in sorted(runs)], sort_keys=True).encode()).hexdigest()[:16]
        seen = client.search_runs([exp.experiment_id], f"tags.`prmflow.results_digest` = '{digest}'")
        if seen:
            continue
        variant = cfg.variants[name]
        with mlflow.start_run(run_name=name, tags={"prmflow.results_digest": digest, "prmflow.variant": name,
                                                   "mlflow.note.content": f"{name}: {json.dumps(variant)}"}):
            mlflow.log_params({"prm": variant.get("prm", "") or "none", "seeds": len(runs), "iterations": cfg.iterations,
                               **{f"advantage.{k}": v for k, v in variant.get("advantage", {}).items()},
                               **{f"rollout.{k}": v for k, v in config_lib.flatten(cfg.rollout).items()},
                               **{f"arithmetic.{k}": v for k, v in cfg.arithmetic.items()}})
            for key in ("pass1", "train_reward"):
                xs, mean, lo, hi = bench_stats.curve(runs, key)
                for x, m, a, b in zip(xs, mean, lo, hi):
                    mlflow.log_metrics({f"mean/{key}": m, f"min/{key}": a, f"max/{key}": b}, step=x)
            mlflow.log_artifact(str(png))
            mlflow.log_text(table, "table.md")
            for seed in sorted(runs):
                with mlflow.start_run(run_name=f"{name} seed {seed}", nested=True, tags={"prmflow.seed": str(seed)}):
                    mlflow.log_params({"seed": seed, "prm": variant.get("prm", "") or "none"})
                    for p in runs[seed]["points"]:
                        mlflow.log_metrics({METRIC_NAMES.get(k, k): v for k, v in p.items()
                                            if isinstance(v, (int, float)) and k not in ("rollouts", "iteration")},
                                           step=p["rollouts"])
                    mlflow.log_metric("final/pass1", runs[seed]["points"][-1]["pass1"])


# --- the whole benchmark -------------------------------------------------------------------------

#: (column title, point key) of the process table: the PRM against the checker and the outcome, the gate, the update
PROCESS_COLUMNS = [("PRM step AUC on the policy's samples (checker labels)", "prm/step_auc_on_policy"),
                   ("gate AUC (vs outcome)", "advantage/prm_step_auc"), ("process weight", "advantage/process_weight"),
                   ("calibrated spread (process_calibration)", "advantage/prm_calibrated_spread"),
                   ("label AUC / labelled share (calibration_labels)", ("advantage/prm_label_auc",
                                                                        "advantage/labelled_share")),
                   ("update held-out AUC before -> after", ("prm/update_auc_before", "prm/update_auc_after")),
                   ("score shortcut wrong / right", ("prm/score_shortcut_wrong", "prm/score_shortcut_right")),
                   ("score single wrong / right", ("prm/score_single_wrong", "prm/score_single_right"))]


def process_table(results: dict, prm_metrics: dict) -> str:
    """Per variant with step rewards, seed means at the first and the last training batch: the PRM's step AUC
    against the checker, the advantage stage's gate, the on-policy update's held-out AUC and the PRM's mean
    score of wrong and right steps by kind (reward-hacking watch: does it overrate the shortcut?)."""
    def mean(runs, point, key):
        xs = [r["points"][point].get(key) for r in runs.values()]
        xs = [x for x in xs if x is not None and x == x]
        return sum(xs) / len(xs) if xs else None

    def cell(runs, key):
        parts = []
        for point in (0, -2):
            keys = key if isinstance(key, tuple) else (key,)
            vals = [mean(runs, point, k) for k in keys]
            parts.append(" / ".join("-" if v is None else f"{v:.3f}" for v in vals))
        return f"{parts[0]} -> {parts[1]}" if parts[0] != parts[1] or "-" not in parts[0] else "-"

    head = "| variant (first -> last training batch) | " + " | ".join(t for t, _ in PROCESS_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(PROCESS_COLUMNS) + 1)]
    for name, runs in results.items():
        if mean(runs, 0, "prm/step_auc_on_policy") is None:
            continue
        lines.append(f"| {name} | " + " | ".join(cell(runs, key) for _, key in PROCESS_COLUMNS) + " |")
    note = (f"\nThe trained PRM's held-out step AUC on its own eval split: {prm_metrics['eval/step_auc']:.3f}."
            if "eval/step_auc" in prm_metrics else "")
    return "\n".join(lines) + note if len(lines) > 2 else ""


def run(cfg: BenchConfig, console=None) -> dict:
    """Run every variant x seed (resuming finished ones); write and log the results; return them with the table."""
    console = console or sys.stderr
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    logfile = open(out / "benchmark.log", "a")
    handler = logging.StreamHandler(logfile)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    say = lambda msg: print(msg, file=console, flush=True)  # noqa: E731
    try:
        with contextlib.redirect_stdout(logfile), contextlib.redirect_stderr(logfile):
            t0 = time.perf_counter()
            records = heldout_records(cfg)
            sft_eval = out / "sft-eval.json"
            key = run_digest(cfg, None)
            with locked(out / "shared.lock"):  # one process trains what every run shares; the others wait for it
                prm_metrics = train_shared(cfg, out)
                if not sft_eval.exists() or json.loads(sft_eval.read_text()).get("config_digest") != key:
                    ev = evaluate(out / "sft", records, cfg.eval_max_new_tokens)
                    sft_eval.write_text(json.dumps({"rollouts": 0, "iteration": 0, **ev, "config_digest": key}))
            sft_point = {k: v for k, v in json.loads(sft_eval.read_text()).items() if k != "config_digest"}
        start = start_fingerprint(out)
        say(f"shared SFT policy and PRM ready ({time.perf_counter() - t0:.0f} s): SFT held-out pass@1 {sft_point['pass1']:.3f}"
            + (f", PRM held-out step AUC {prm_metrics['eval/step_auc']:.3f}" if "eval/step_auc" in prm_metrics else "")
            + f"; SFT weights sha256 {start['weights_sha256'].get('sft', '?')} ({start['cpu_capability']} kernels)")
        results: dict = {name: {} for name in cfg.variants}
        jobs = [(name, seed) for seed in cfg.seeds for name in cfg.variants
                if cfg.run_missing or finished(cfg, out, name, int(seed))]
        queue, count = [(name, seed, False) for name, seed in jobs], 0
        while queue:
            name, seed, wait = queue.pop(0)
            with contextlib.redirect_stdout(logfile), contextlib.redirect_stderr(logfile):
                r = run_one(cfg, out, name, int(seed), sft_point, records, wait=wait)
            if r is None:  # another process is running it: take it last, then wait for its result
                queue.append((name, seed, True))
                continue
            results[name][int(seed)] = r
            count += 1
            pts = r["points"]
            say(f"[{count}/{len(jobs)}] {name} seed {seed}: held-out pass@1 {pts[0]['pass1']:.3f} -> {pts[-1]['pass1']:.3f}, "
                f"train reward {pts[0]['train_reward']:.3f} -> {pts[-2]['train_reward']:.3f}, "
                f"shortcut steps {pts[0]['eval/shortcut_share']:.3f} -> {pts[-1]['eval/shortcut_share']:.3f} "
                f"({r['seconds']:.0f} s)")
        results = {name: dict(sorted(runs.items())) for name, runs in results.items() if runs}
        if cfg.reference not in results:  # only with run_missing false: the table is left as it was
            raise ConfigError(f"run_missing=false and no run of the reference variant '{cfg.reference}' is finished "
                              f"under {out / 'runs'} for seeds {cfg.seeds} with this config: nothing to tabulate. "
                              f"Run without --set run_missing=false to run them.")
        rows = bench_stats.summarize(results, cfg.reference)
        table = bench_stats.format_table(rows, cfg.reference)
        aucs = process_table(results, prm_metrics)
        png = out / "curves.png"
        arith = ", ".join(f"{k}={v}" for k, v in cfg.arithmetic.items())
        text = table + "\n\n" + bench_stats.bars(rows, cfg.reference) + ("\n\n" + aucs if aucs else "") + "\n"
        with locked(out / "shared.lock"):  # one writer at a time of the table, the figure and OUTPUT/mlflow.db
            bench_stats.plot_curves(results, png, title=f"{arith}; {cfg.rollout.get('num_prompts')} prompts x "
                                                       f"{cfg.rollout.get('n_samples')} samples per iteration")
            (out / "table.md").write_text(text)
            (out / "results.json").write_text(json.dumps({"rows": rows, "results": results, "prm_metrics": prm_metrics,
                                                          "start": start},
                                                         indent=1))
            with contextlib.redirect_stdout(logfile), contextlib.redirect_stderr(logfile):
                log_mlflow(cfg, out, results, text, png)
        say("\n" + text + f"\nwritten: {out / 'table.md'}, {png}, {out / 'results.json'}; "
            f"mlflow ui --backend-store-uri sqlite:///{(out / 'mlflow.db').resolve()}")
        return {"rows": rows, "results": results, "table": text}
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        logfile.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/experiments/prm_vs_outcome.py", description=__doc__.split("\n\n")[0],
                                     epilog="Keys nest with dots on the command line: --set rollout.num_prompts=32.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_arguments(parser, BenchConfig)
    args = parser.parse_args(argv)
    try:
        cfg = config_lib.from_args(BenchConfig, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except PrmflowError as e:  # a bad key, an output that is not this config's, bad data: the stage's own message
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
