"""prmflow's RL iterations against TRL's GRPOTrainer: the same work on the same model, one machine, one run.

    python benchmarks/perf/bench_vs_trl.py                      # SmolLM2-135M-Instruct (tests/real_model_cache.py)
    python benchmarks/perf/bench_vs_trl.py --iterations 3 --prompts 16 --group 8 --arms prmflow,trl,prmflow-prm

Both arms start from the same HF directory and do, per RL iteration: sample `group` completions for each of
`prompts` prompts (the same prompts, in the same order: prmflow's rollout draws them from a GSM8K-format JSONL
written here, and TRL is given exactly those rows in that order with its shuffling off), at temperature 1,
top-p 1, no top-k, at most `max_new` new tokens, stopping at <|im_end|>; reward each completion with the same
function (prmflow's one grader, `tasks.verify`, GSM8K's convention: the number after the last `####`, else an
`answer:` line, else the last number; outcome only); normalize within the group ((R - mean) / (std + eps));
and take `epochs` passes over the completions in minibatches of `minibatch`, one AdamW step each (lr
constant, no warm-up, grad-norm clip 1.0, clipped ratio 0.2, no KL term, loss = token mean over the
minibatch: TRL's "dapo"; AdamW betas 0.9/0.95, prmflow's). prmflow runs its stages in one process (rollout ->
advantage grpo -> ppo, the optimizer moments carried from one iteration to the next as the pipeline does); TRL runs
`GRPOTrainer.train`. The differences that remain are written out in benchmarks/README.md (eps 1e-6 vs 1e-4 in the
normalization; prmflow's old log-probs are its HF sampler's own (rollout key old_logprobs, auto), TRL re-scores them
with a forward in its generation step whenever a generation batch spans more than one optimizer step).

What is timed, per iteration: rollout (sampling alone, and sampling + scoring), training (advantage + policy
updates), and, once per arm, process start-up (interpreter, imports, first model load). The held-out pass@1
after each iteration (greedy, `max_new` tokens, the same held-out prompts and grader for both; not counted in
the iteration's time) and the arm's peak resident memory (its process's ru_maxrss) are reported beside it.
Each arm runs in a process of its own, one after the other, so neither sees the other's memory or threads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()
ROOT = Path(__file__).resolve().parents[2]

PROMPT = "Compute {expr}. Work it out step by step, then give the final answer as a number."


# --- the shared spec ------------------------------------------------------------------------------

def write_tasks(out: Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Train and held-out prompts in GSM8K's JSONL format (question, answer ending `#### N`), from the arithmetic
    task's disjoint train and test splits (1-2 operations)."""
    from prmflow.tasks import arithmetic

    cfg = arithmetic.ArithmeticConfig(min_ops=1, max_ops=2, prompt_prefix="")
    files = []
    for split, n in (("train", n_train), ("test", n_eval)):
        path = out / f"{split}.jsonl"
        with open(path, "w") as f:
            for p in arithmetic.generate(n, seed=seed, split=split, cfg=cfg):
                expr = p.prompt.strip()
                f.write(json.dumps({"question": PROMPT.format(expr=expr), "answer": f"{p.solution}\n#### {p.answer}"}) + "\n")
        files.append(path)
    return files[0], files[1]


def rollout_config(spec: dict, iteration: int, policy: str, output: str, prm: str = ""):
    from prmflow.components import config
    from prmflow.components.rollout import stage as rollout

    return config.load(rollout.Config, overrides={
        "policy": policy, "output": output, "task": spec["train"], "num_prompts": spec["prompts"],
        "n_samples": spec["group"], "sampling.max_new_tokens": spec["max_new"], "sampling.temperature": 1.0,
        "seed": spec["seed"], "iteration": iteration, "batch_sequences": spec["prompts"] * spec["group"], "prm": prm,
        "tracking.enabled": False})


def held_out_pass1(model, tok, spec: dict) -> float:
    """Greedy pass@1 on the held-out prompts, through the chat template, graded by the one grader."""
    from prmflow import tasks
    from prmflow.components.sampling.generation import generate_texts

    records = tasks.load(spec["eval"])
    prompts = [tasks.render_prompt(tok, r) for r in records]
    texts = generate_texts(model, tok, prompts, max_new_tokens=spec["max_new"], batch_size=64, add_special_tokens=False)
    return sum(tasks.verify(r, t) for r, t in zip(records, texts)) / len(records)


# --- the breakdown ---------------------------------------------------------------------------------
# Per iteration and arm: load (model weights and optimizer moments read from disk), generate (sampling),
# score (old log-probs, rewards, advantages), train (the policy updates), save (policy and moments written),
# other (the rest of the iteration's wall: the hand-off files, stage set-up), wall and CPU seconds.

PHASES = ("load_s", "generate_s", "score_s", "train_s", "save_s", "other_s")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bytes_written() -> int:
    """Bytes this process has passed to write calls so far (/proc/self/io `wchar`: files and pipes, page cache
    or not; 0 where /proc is missing)."""
    try:
        return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("wchar:")))
    except (OSError, StopIteration):
        return 0


class PhaseClock:
    """Seconds spent inside wrapped functions, by phase (for the stages, which time their parts only in part)."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - t

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {}
        return out


# --- prmflow --------------------------------------------------------------------------------------

def run_prmflow(spec: dict, work: Path, with_prm: bool) -> dict:
    from prmflow.components.advantage import stage as advantage
    from prmflow.components import config
    from prmflow.components.models import modeling
    from prmflow.components.data import schema
    from prmflow.components.ppo import stage as ppo
    from prmflow.components.rollout import stage as rollout

    clock = PhaseClock()  # every stage loads through modeling.load_causal_lm; ppo reads and writes the moments
    clock.wrap(modeling, "load_causal_lm", "load")
    clock.wrap(ppo, "_load_moments", "load")
    clock.wrap(ppo, "_write_output", "save")

    t0 = time.perf_counter()
    model, tok = modeling.load_causal_lm(spec["model"])
    startup = time.time() - T_START
    load_s = time.perf_counter() - t0
    evals = [held_out_pass1(model, tok, spec)]
    del model
    policy, iters = spec["model"], []
    prm = ""
    if with_prm:
        from prmflow.components.prm import stage as prm_stage

        t = time.perf_counter()
        prm_stage.run(config.load(prm_stage.Config, overrides={
            "backbone": spec["model"], "output": str(work / "prm"), "max_steps": spec["prm_steps"], "micro_batch_size": 8,
            "eval_every": spec["prm_steps"], "eval_size": 20, "save_every": 0, "max_seq_len": 160,
            "optim.warmup_steps": 2, "engine.backend": "torch", "tracking.enabled": False}))
        prm, prm_s = str(work / "prm"), time.perf_counter() - t
    for k in range(spec["iterations"]):
        clock.take()
        cpu0, wrote0 = cpu_seconds(), bytes_written()
        t = time.perf_counter()
        metrics = rollout.run(rollout_config(spec, k, policy, str(work / f"rollouts-{k}"), prm))
        t_roll = time.perf_counter() - t
        roll_load = clock.take().get("load", 0.0)
        rows = schema.read_dataset(work / f"rollouts-{k}", "rollouts").to_pylist()
        t = time.perf_counter()
        over = {"estimator": "reinforce_baseline", "step_rewards": True, "step_reward_mode": "centered"} if with_prm \
            else {"estimator": "grpo", "norm_eps": 1e-6}
        advantage.run(config.load(advantage.Config, overrides={
            "input": str(work / f"rollouts-{k}"), "output": str(work / f"adv-{k}"), "iteration": k, **over,
            "tracking.enabled": False}))
        t_adv = time.perf_counter() - t
        t = time.perf_counter()
        ppo.run(config.load(ppo.Config, overrides={
            "policy": policy, "input": str(work / f"adv-{k}"), "output": str(work / f"ppo-{k}"), "iteration": k,
            "rl_iterations": spec["iterations"], "epochs": spec["epochs"], "minibatch_size": spec["minibatch"],
            "micro_batch_size": spec["micro"], "optim.lr": spec["lr"], "optim.lr_schedule": "constant",
            "optim.max_grad_norm": 1.0, "clip_eps_low": 0.2, "clip_eps_high": 0.2, "kl_coef": 0.0,
            "loss_agg": "token-mean", "optimizer_state": str(work / f"ppo-{k - 1}" / "optimizer") if k else "",
            "engine.backend": "torch", "tracking.enabled": False}))
        t_ppo = time.perf_counter() - t
        cpu, wrote = cpu_seconds() - cpu0, bytes_written() - wrote0
        ppo_parts = clock.take()
        policy = str(work / f"ppo-{k}" / "policy")
        model, tok = modeling.load_causal_lm(policy)
        evals.append(held_out_pass1(model, tok, spec))
        del model
        wall = t_roll + t_adv + t_ppo
        phases = {"load_s": roll_load + ppo_parts.get("load", 0.0), "generate_s": metrics["perf/generate_s"],
                  "score_s": metrics["perf/score_s"] + metrics["perf/reward_s"] + t_adv,
                  "train_s": t_ppo - ppo_parts.get("load", 0.0) - ppo_parts.get("save", 0.0),
                  "save_s": ppo_parts.get("save", 0.0)}
        phases["other_s"] = wall - sum(phases.values())
        iters.append({"rollout_s": t_roll, "generate_s": metrics["perf/generate_s"], "advantage_s": t_adv,
                      "train_s": t_ppo, "iteration_s": wall, "cpu_s": cpu, "written_mb": wrote / 1e6, "phases": phases,
                      "tokens": sum(len(r["response_ids"]) for r in rows), "reward": metrics["rollout/reward_mean"]})
    out = {"startup_s": startup, "model_load_s": load_s, "iterations": iters, "pass1": evals}
    if with_prm:
        out["prm_s"] = prm_s
    return out


# --- TRL ------------------------------------------------------------------------------------------

def run_trl(spec: dict, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prmflow import tasks
    from prmflow.tasks.grader import grade

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    startup = time.time() - T_START
    evals = [held_out_pass1(model, tok, spec)]
    order = spec["order"]  # prmflow's prompts, iteration after iteration
    records = {r.prompt_id: r for r in tasks.load(spec["train"])}
    rows = [{"prompt": [{"role": "user", "content": records[pid].prompt}], "answer": records[pid].answer,
             "prompt_id": pid} for pid in order]

    tokens, rewards = [], []

    def reward(prompts, completions, answer, completion_ids, **_):  # called once per generation batch (= iteration)
        tokens.append(sum(len(c) for c in completion_ids))
        scores = [grade("gsm8k", c[0]["content"], a) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    n = spec["prompts"] * spec["group"]
    updates_per_iter = spec["epochs"] * n // spec["minibatch"]
    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["minibatch"] // spec["micro"], steps_per_generation=n // spec["micro"],
        num_generations=spec["group"], max_completion_length=spec["max_new"], temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,  # prmflow's AdamW (engine.OptimSettings)
        num_iterations=spec["epochs"], beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        max_steps=spec["iterations"] * updates_per_iter, shuffle_dataset=False, use_cpu=True, bf16=False,
        report_to=[], logging_steps=1, save_strategy="no", seed=spec["seed"], disable_dropout=True)

    timing = {"generate": 0.0, "gen_and_score": 0.0}

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timing["generate"] += time.perf_counter() - t

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timing["gen_and_score"] += time.perf_counter() - t

    iters, mark = [], {"t": None, "gen": 0.0, "gs": 0.0, "eval": 0.0, "cpu": 0.0, "wrote": 0}

    class PerIteration(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kw):
            mark["t"], mark["cpu"], mark["wrote"] = time.perf_counter(), cpu_seconds(), bytes_written()

        def on_step_end(self, args_, state, control, model=None, **kw):
            if state.global_step % updates_per_iter:
                return
            now = time.perf_counter()
            wall = now - mark["t"]
            gen, gs = timing["generate"] - mark["gen"], timing["gen_and_score"] - mark["gs"]
            # the model and the optimizer stay in memory: nothing is loaded or saved between iterations
            phases = {"load_s": 0.0, "generate_s": gen, "score_s": gs - gen, "train_s": wall - gs, "save_s": 0.0,
                      "other_s": 0.0}
            iters.append({"rollout_s": gs, "generate_s": gen, "advantage_s": 0.0, "train_s": wall - gs,
                          "iteration_s": wall, "cpu_s": cpu_seconds() - mark["cpu"],
                          "written_mb": (bytes_written() - mark["wrote"]) / 1e6, "phases": phases,
                          "tokens": tokens[-1] if tokens else 0, "reward": rewards[-1] if rewards else float("nan")})
            evals.append(held_out_pass1(model, tok, spec))
            model.train()
            mark.update(t=time.perf_counter(), gen=timing["generate"], gs=timing["gen_and_score"], cpu=cpu_seconds(),
                        wrote=bytes_written())

    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[PerIteration()])
    trainer.train()
    return {"startup_s": startup, "iterations": iters, "pass1": evals}


# --- driver ---------------------------------------------------------------------------------------

def arm_main(arm: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(tempfile.mkdtemp(prefix=f"bench-{arm}-", dir=spec["work"]))
    result = run_trl(spec, work) if arm == "trl" else run_prmflow(spec, work, with_prm=arm == "prmflow-prm")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_gb"] = usage.ru_maxrss / 2**20
    result["cpu_s"] = usage.ru_utime + usage.ru_stime  # on a shared machine the fairer cost than wall time
    Path(out_path).write_text(json.dumps(result, indent=1))


def table(results: dict, spec: dict) -> str:
    lines = ["| arm | start-up s | iteration | rollout s (sampling) | training s | iteration s | tokens | ms / token | "
             "train reward | held-out pass@1 after | peak RSS GB |", "|---" * 11 + "|"]
    for arm, r in results.items():
        lines.append(f"| {arm} | {r['startup_s']:.1f} | before | | | | | | | {r['pass1'][0]:.3f} | {r['peak_rss_gb']:.2f} |")
        for k, it in enumerate(r["iterations"]):
            train = it["advantage_s"] + it["train_s"]
            lines.append(f"| | | {k} | {it['rollout_s']:.1f} ({it['generate_s']:.1f}) | {train:.1f} | "
                         f"{it['iteration_s']:.1f} | {it['tokens']} | {1000 * it['iteration_s'] / max(it['tokens'], 1):.1f} | "
                         f"{it.get('reward', float('nan')):.3f} | {r['pass1'][k + 1]:.3f} | |")
    lines += ["", "| arm | iteration | " + " | ".join(p[:-2] for p in PHASES) + " | wall s | CPU s | written MB |",
              "|---" * (len(PHASES) + 5) + "|"]
    for arm, r in results.items():
        for k, it in enumerate(r["iterations"]):
            ph = it.get("phases", {})
            lines.append(f"| {arm} | {k} | " + " | ".join(f"{ph.get(p, float('nan')):.1f}" for p in PHASES) +
                         f" | {it['iteration_s']:.1f} | {it.get('cpu_s', float('nan')):.1f} | "
                         f"{it.get('written_mb', float('nan')):.0f} |")
    return "\n".join(lines)


def summary(dirs: list[str]) -> str:
    """Mean and range over repeats (each a directory a run wrote, with <arm>.json) of every arm's per-iteration
    phases, wall and CPU seconds and bytes written: the table benchmarks/README.md quotes."""
    runs = [{arm.stem: json.loads(arm.read_text()) for arm in sorted(Path(d).glob("*.json")) if arm.stem != "spec"}
            for d in dirs]
    cols = [*PHASES, "iteration_s", "cpu_s", "written_mb"]
    lines = [f"{len(runs)} repeats: mean (min-max)", "",
             "| arm | iteration | " + " | ".join(c.rsplit("_", 1)[0] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for arm in sorted({a for r in runs for a in r}):
        for k in range(len(runs[0][arm]["iterations"])):
            cells = []
            for c in cols:
                its = [r[arm]["iterations"][k] for r in runs if arm in r]
                xs = [it["phases"][c] if c in PHASES else it[c] for it in its if c in PHASES or c in it]
                cells.append(f"{sum(xs) / len(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "n/a")
            lines.append(f"| {arm} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="HF model directory (default: SmolLM2-135M-Instruct from the wheel)")
    parser.add_argument("--arms", default="prmflow,trl", help="comma-separated: prmflow, trl, prmflow-prm")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new", type=int, default=48, help="maximum completion length, tokens")
    parser.add_argument("--epochs", type=int, default=1, help="passes over each iteration's completions")
    parser.add_argument("--minibatch", type=int, default=16, help="completions per policy update")
    parser.add_argument("--micro", type=int, default=8, help="completions per forward/backward")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--prm-steps", type=int, default=30, help="prmflow-prm: PRM training steps on the backbone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/bench_vs_trl")
    parser.add_argument("--summary", nargs="+", metavar="DIR", help="print mean and range over these runs' --out "
                        "directories (the repeats) and exit")
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        arm_main(args.arm, args.spec, args.result)
        return 0
    if args.summary:
        print(summary(args.summary))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        sys.path.insert(0, str(ROOT / "tests"))
        from real_model_cache import smollm2_dir

        model = str(smollm2_dir())
    train, held_out = write_tasks(out, n_train=args.prompts * args.iterations * 4, n_eval=args.eval_prompts, seed=args.seed)
    spec = {"model": model, "train": str(train), "eval": str(held_out), "prompts": args.prompts, "group": args.group,
            "max_new": args.max_new, "epochs": args.epochs, "minibatch": args.minibatch, "micro": args.micro,
            "lr": args.lr, "iterations": args.iterations, "seed": args.seed, "prm_steps": args.prm_steps, "work": str(out)}
    if (args.prompts * args.group) % args.minibatch or args.minibatch % args.micro:
        parser.error("--prompts x --group must be a multiple of --minibatch, and --minibatch of --micro")
    from prmflow.components.rollout.prompts import select_prompts

    spec["order"] = [r.prompt_id for k in range(args.iterations)
                     for r in select_prompts(rollout_config(spec, k, model, str(out / "unused")))]
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    results = {}
    for arm in args.arms.split(","):
        t = time.time()
        subprocess.run([sys.executable, __file__, "--arm", arm, "--spec", str(out / "spec.json"),
                        "--result", str(out / f"{arm}.json")], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        results[arm] = json.loads((out / f"{arm}.json").read_text())
        results[arm]["process_s"] = time.time() - t
        print(f"{arm}: {results[arm]['process_s']:.0f} s wall, {results[arm]['cpu_s']:.0f} s CPU", flush=True)
    text = table(results, spec)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
