"""A sampling stage on one GPU machine, once per arm, each arm the stage in a fresh process as a pod starts it: which
sampler, on which device, and what vLLM's engine start is made of.

    python benchmarks/perf/stage_samplers_gpu.py --stage rollout --output /tmp/rollout-stage    # 64 prompts x 8, 128 tokens
    python benchmarks/perf/stage_samplers_gpu.py --stage rollout --policy DIR --prompts 128 --skip-hf
    python benchmarks/perf/stage_samplers_gpu.py --stage evaluate,prm-label --output /tmp/sampling-stages
    python benchmarks/perf/stage_samplers_gpu.py --arms evaluate-gpu,evaluate-cpu --prompts 32

Unless --policy is given it writes a random Qwen2-shaped model of 358M parameters (24 layers, hidden 896, GQA 14/2
heads, the project's character tokenizer: the model of the first vLLM run, docs/real-models.md). A response ends at
EOS, which this random model seldom draws, or at --max-new-tokens. The arms, by stage (`--stage` picks the stages'
default arms, `--arms` names arms of any stage):

rollout (default 64 prompts x 8 samples):
- hf:          sampler=hf (bf16 on the GPU);
- vllm:        sampler=vllm with prmflow's defaults (vllm_engine.VLLMSettings);
- vllm-inproc: the same with vllm.in_process=true: vLLM's engine core in the stage's process;
- vllm-stock:  sampler=vllm with vLLM's own start defaults: torch.compile (compilation mode 3) and CUDA graphs for
               vLLM's default list of batch sizes (vllm.compile=true, vllm.cudagraph_capture_sizes=[]). Last: on a
               cold compile cache it can take minutes.
evaluate (default 16 prompts x 4 samples; it also greedy-decodes the baseline, the same policy again) and prm-label
(--label-prompts x --label-samples solutions, --completions per step prefix):
- evaluate-gpu / prm-label-gpu: the stage's defaults: the GPU, bfloat16 (modeling.placement);
- evaluate-cpu / prm-label-cpu: the same stage and sizes with CUDA_VISIBLE_DEVICES empty and 12 threads (the
  recipe's gpu_pool has 12 cores): the CPU in float32, where these stages sampled on a GPU pod before they moved;
- decode-1.5b: no stage: `generate`'s time per decode step for a random model of Qwen2.5-1.5B's body (28 layers,
  hidden 1,536, MLP 8,960, 12 / 2 heads; the character vocabulary) at batch 128 (30-token prompts), on the GPU in
  bf16 (a first call over new shapes, then a second) and on 12 CPU threads in float32 (8 steps);
- evaluate-1.5b: evaluate on the GPU with that body at the cluster recipe's batch_sequences 128, its 4 samples and
  max_new_tokens 1024 (--big-prompts prompts);
- evaluate-vllm / prm-label-vllm / evaluate-1.5b-vllm: the gpu arms with sampler=vllm (they need the vLLM payload,
  so they are not among the default arms).
agent (--agent-policy, a policy trained by `prmflow pipeline run-local --config configs/agent-memory.yaml`; default
--prompts 128 x 8 samples): the rollout stage on the memory agent's episodes, configs/agent-memory.yaml's rollout
section (2 turns, the environment between them), float32 so the log-prob gap reads the engine, not the dtype:
- agent-hf:    sampler=hf;
- agent-vllm:  sampler=vllm, one engine for both turns (the prefix cache keeps each episode's earlier turns);
- agent-vllm-inproc: the same with the engine core in the stage's process (on an H200 its memory did not come back
               at close: docs/testing.md). The tables side by side: the reward components (the same policy, so
               equal up to sampling noise), the turns, and rollout/logprob_gap (the engine's log-probs of the
               policy's tokens against the trainer's forward pass over the whole episode, environment tokens included).

Per arm: the stage's wall, its perf/* metrics, the GPU memory its process allocated at peak (0 = it never used the
GPU); for a vLLM arm also the start's parts as vLLM logs them (weights, model loading, memory profiling, compilation,
CUDA graph capture, the whole engine init) and, from the log's stamps, what vLLM does not time (the imports before
its first line, the engine process's start, the shutdown). Prints a markdown table per stage and writes
OUTPUT/results.json; each arm's log is OUTPUT/ARM.log. One run per arm on whatever GPU this is: compare arms of one
run only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]

#: vLLM 0.24's own log lines for the parts of an engine start (file:line in vllm-project/vllm v0.24.0)
START_PARTS = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",                      # model_loader/default_loader.py:431
    "model_load_s": r"Model loading took .*? and ([\d.]+) seconds",             # v1/worker/gpu_model_runner.py:5256
    "profiling_s": r"Memory profiling takes ([\d.]+) seconds",                 # utils/mem_utils.py:217
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",           # v1/worker/gpu_model_runner.py:6657
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",  # v1/engine/core.py:328-345
    "compile_s": r"init engine .*?\(compilation: ([\d.]+) s",                  # v1/engine/core.py:336-341
}


class Arm(NamedTuple):
    stage: str                 # rollout, evaluate or prm-label (decode-1.5b: evaluate's, though it runs no stage)
    config: dict               # overrides of the stage's config beyond the sizes
    env: dict                  # environment of the arm's process beyond ours
    model: str                 # 358m, 1.5b or agent (--agent-policy)


CPU = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "12", "MKL_NUM_THREADS": "12"}
VLLM = {"sampler": "vllm"}
#: every arm, in the order they run (within evaluate: the whole 1.5B evaluate, the longest, last)
ARMS = {
    "hf": Arm("rollout", {"sampler": "hf"}, {}, "358m"),
    "vllm": Arm("rollout", VLLM, {}, "358m"),
    # the engine core in the stage's own process (vllm.in_process): no second process that imports torch and vLLM again
    "vllm-inproc": Arm("rollout", {**VLLM, "vllm.in_process": True}, {}, "358m"),
    "vllm-stock": Arm("rollout", {**VLLM, "vllm.compile": True, "vllm.cudagraph_capture_sizes": []}, {}, "358m"),
    "evaluate-gpu": Arm("evaluate", {}, {}, "358m"),
    "prm-label-gpu": Arm("prm-label", {}, {}, "358m"),
    "evaluate-cpu": Arm("evaluate", {}, CPU, "358m"),
    "prm-label-cpu": Arm("prm-label", {}, CPU, "358m"),
    "decode-1.5b": Arm("evaluate", {}, {}, "1.5b"),
    "evaluate-1.5b": Arm("evaluate", {}, {}, "1.5b"),
    "evaluate-vllm": Arm("evaluate", VLLM, {}, "358m"),
    "prm-label-vllm": Arm("prm-label", VLLM, {}, "358m"),
    "evaluate-1.5b-vllm": Arm("evaluate", VLLM, {}, "1.5b"),
    "agent-hf": Arm("agent", {"sampler": "hf"}, {}, "agent"),
    "agent-vllm": Arm("agent", VLLM, {}, "agent"),
    "agent-vllm-inproc": Arm("agent", {**VLLM, "vllm.in_process": True}, {}, "agent"),
}
#: what `--stage` runs unless --arms says otherwise: the -vllm arms of evaluate, prm-label and agent need the vLLM payload
DEFAULT_ARMS = [name for name in ARMS if "-vllm" not in name]
STAGES = {"rollout": ("rollout", "stage"), "evaluate": ("evaluate", "stage"), "prm-label": ("prm", "label"),
          "agent": ("rollout", "stage")}
#: the sizes each stage samples unless --prompts / --samples say otherwise
DEFAULT_SIZES = {"rollout": (64, 8), "evaluate": (16, 4), "agent": (128, 8)}
AGENT_CONFIG = ROOT / "configs" / "agent-memory.yaml"
AGENT_COMPONENTS = ["qa_accuracy", "tool_success", "content_quality", "compression"]
#: the columns of each stage's table
COLUMNS = {
    "rollout": ["wall_s", "load_s", "generate_s", "score_s", "tokens_per_s", "weights_s", "model_load_s", "profiling_s",
                "compile_s", "graph_capture_s", "init_engine_s", "to_vllm_s", "core_start_s", "shutdown_s"],
    "evaluate": ["wall_s", "sample_s", "baseline_s", "sample_tokens", "tokens_per_s", "sequences_per_s", "cuda_peak_gib",
                 "gpu_first_s_per_step", "gpu_s_per_step", "cpu_s_per_step", "load_s", "init_engine_s"],
}
COLUMNS["prm-label"] = COLUMNS["evaluate"]
COLUMNS["agent"] = ["wall_s", "load_s", "generate_s", "tokens_per_s", "turns", "logprob_gap", *AGENT_COMPONENTS,
                    "init_engine_s"]

RUN = """
import json, sys, torch
from prmflow.components import config
from prmflow.components.{module} import {attr} as stage
m = stage.run(config.load(stage.Config, overrides=json.loads(sys.argv[1])))
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print("METRICS " + json.dumps({{**m, "cuda_peak_bytes": peak}}), flush=True)
"""

DECODE = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
ids = torch.randint(4, 88, (128, 30), generator=torch.Generator().manual_seed(0))
def per_step(model, device, steps):
    x = ids.to(device)
    if device == "cuda": torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=steps, min_new_tokens=steps,
                   do_sample=True, pad_token_id=0)
    if device == "cuda": torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps
row = {}
if torch.cuda.is_available():
    gpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    row["gpu_first_s_per_step"] = per_step(gpu, "cuda", 64)
    row["gpu_s_per_step"] = per_step(gpu, "cuda", 64)
    del gpu
torch.set_num_threads(12)
row["cpu_s_per_step"] = per_step(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), "cpu", 8)
print("METRICS " + json.dumps(row), flush=True)
"""

#: vLLM's log lines carry the wall clock to the second: "INFO 11-26 21:48:34 [file.py:N] ..."
STAMP = re.compile(r"^(?:\(EngineCore[^)]*\) )?(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) ", re.M)


def timeline(log: str, started: float) -> dict:
    """The start's parts that vLLM does not time itself, from its log's stamps (1 s resolution):
    to_vllm_s (the stage process's start to vLLM's first line: Python, torch, prmflow and vLLM imported, the task
    read), core_start_s (vLLM's last line in the stage process before the engine core's first: the engine
    process spawned, importing torch and vLLM again; absent with the core in-process), shutdown_s."""
    import datetime as dt

    year = dt.datetime.fromtimestamp(started).year

    def when(stamp: str) -> float:
        return dt.datetime.strptime(f"{year}-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp()

    lines = [(when(m.group(1)), m.group(0).startswith("(Engine")) for m in STAMP.finditer(log)]
    if not lines:
        return {}
    out = {"to_vllm_s": lines[0][0] - started}
    core = next((i for i, (_, c) in enumerate(lines) if c), None)
    if core:
        out["core_start_s"] = lines[core][0] - lines[core - 1][0]
    ends = [re.search(rf"^.*?(\d\d-\d\d \d\d:\d\d:\d\d) .*{k}", log, re.M) for k in ("MPClient: start", "MPClient: complete")]
    if all(ends):
        out["shutdown_s"] = when(ends[1].group(1)) - when(ends[0].group(1))
    return out


def write_model(path: Path, layers: int = 24, hidden: int = 896, intermediate: int = 4864, heads: int = 14,
                kv_heads: int = 2, init_device: str = "cpu") -> str:
    """A random Qwen2-shaped model (bf16 weights) with the character tokenizer; by default the 358M one.
    `init_device`: where its weights are drawn (a GPU draws a 1.5B body in seconds; other numbers than the CPU's)."""
    from prmflow.components.models import modeling

    if not (path / "config.json").exists():
        model, tok = modeling.load_causal_lm("tiny-qwen2", seed=0)
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("qwen2", vocab_size=model.config.vocab_size, hidden_size=hidden,
                                   intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=2048, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
        import torch

        torch.manual_seed(0)
        with torch.device(init_device):
            big = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        modeling.save_pretrained(big, tok, path)
    return str(path)


def write_body_1p5b(path: Path) -> str:
    """A random model of Qwen2.5-1.5B's body (bf16 weights) with the character tokenizer."""
    import torch

    return write_model(path, layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                       init_device="cuda" if torch.cuda.is_available() else "cpu")


def child(name: str, code: str, argv: list[str], out: Path, env_over: dict) -> tuple[dict, dict | None, str]:
    """Run `code` in its own process, logged to OUT/NAME.log as it runs (an arm cut short by a time limit leaves its
    log): (the arm's row so far, the METRICS line's dict or None when the process failed, the log)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_over)
    started, t0 = time.time(), time.perf_counter()
    with open(out / f"{name}.log", "w") as f:
        proc = subprocess.run([sys.executable, "-c", code, *argv], stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    row = {"arm": name, "wall_s": time.perf_counter() - t0, "started": started}
    log = (out / f"{name}.log").read_text()
    if proc.returncode:
        return {**row, "error": f"exit {proc.returncode}; see {out / f'{name}.log'}"}, None, log
    return row, json.loads(next(line for line in log.splitlines() if line.startswith("METRICS "))[8:]), log


def overrides(name: str, policy: str, args, out: Path) -> dict:
    """The stage config of arm `name`: its sizes, its own keys, written to `out`."""
    arm = ARMS[name]
    common = {"policy": policy, "output": str(out), "overwrite": True, "tracking.enabled": False, "chat_template": False}
    default_prompts, default_samples = DEFAULT_SIZES.get(arm.stage, (0, 0))
    prompts, samples = args.prompts or default_prompts, args.samples or default_samples
    if arm.stage == "agent":
        import yaml

        from prmflow.components import config

        section = config.flatten(yaml.safe_load(AGENT_CONFIG.read_text())["rollout"])
        return {**section, "policy": policy, "output": str(out), "overwrite": True, "tracking.enabled": False,
                "num_prompts": prompts, "n_samples": samples, "dtype": "float32", **arm.config}
    if arm.stage == "rollout":
        sizes = {"num_prompts": prompts, "n_samples": samples, "sampling.max_new_tokens": args.max_new_tokens}
    elif arm.stage == "prm-label":
        sizes = {"num_prompts": args.label_prompts, "n_samples": args.label_samples, "completions": args.completions,
                 "sampling.max_new_tokens": args.max_new_tokens}
    elif arm.model == "1.5b":
        sizes = {"baseline": policy, "num_prompts": args.big_prompts, "n_samples": 4, "sampling.max_new_tokens": 1024,
                 "batch_sequences": 128}
    else:
        sizes = {"baseline": policy, "num_prompts": prompts, "n_samples": samples,
                 "sampling.max_new_tokens": args.max_new_tokens, "batch_sequences": 128}
    return {**common, **sizes, **arm.config}


def run_arm(name: str, args, models: dict, out: Path) -> dict:
    arm = ARMS[name]
    if name == "decode-1.5b":
        row, m, _ = child(name, DECODE, [models[arm.model]], out, arm.env)
        return {**row, **(m or {})}
    module, attr = STAGES[arm.stage]
    over = overrides(name, models[arm.model], args, out / name)
    row, m, log = child(name, RUN.format(module=module, attr=attr), [json.dumps(over)], out, arm.env)
    if m is None:
        return row
    row = {**row, "cuda_peak_gib": m["cuda_peak_bytes"] / 2**30,
           **{k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/")},
           **{k: v for k, v in m.items() if k in ("label/solutions", "label/steps", "eval/response_length")},
           **{k.rsplit("/", 1)[1]: v for k, v in m.items()
              if k in ("rollout/turns", "rollout/logprob_gap") or k.startswith("rollout/reward/")}}
    if arm.config.get("sampler") == "vllm":
        for key, pattern in START_PARTS.items():
            found = re.findall(pattern, log)
            if found:
                row[key] = sum(float(x) for x in found)  # one per worker (tensor parallel) or per call
        row.update(timeline(log, row["started"]))
    return row


def select_arms(stages: list[str], named: list[str], skip_hf: bool) -> list[str]:
    """The arms to run, in order: those named, else the default arms of the stages."""
    arms = named or [a for a in DEFAULT_ARMS if ARMS[a].stage in stages]
    return [a for a in arms if not (skip_hf and a == "hf")]


def table(stage: str, rows: list[dict]) -> None:
    cols = COLUMNS[stage]
    print("| arm | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['arm']} | " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                             for c in cols) + " |" + (f" {r['error']}" if "error" in r else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="rollout", help=f"comma-separated subset of {','.join(STAGES)}: their default arms")
    ap.add_argument("--arms", default="", help=f"comma-separated subset of {','.join(ARMS)} (default: the stages' arms "
                                               "but the evaluate/prm-label -vllm ones, which need vLLM)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the rollout's hf arm (the slowest)")
    ap.add_argument("--policy", default="", help="policy directory (default: the random 358M Qwen2-shaped model)")
    ap.add_argument("--prompts", type=int, default=0,
                    help="prompts of rollout and evaluate's 358M arms (0: 64 rollout, 16 evaluate)")
    ap.add_argument("--samples", type=int, default=0, help="samples per prompt of the same (0: 8 rollout, 4 evaluate)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="every response's budget but evaluate-1.5b's (1024)")
    ap.add_argument("--label-prompts", type=int, default=8)
    ap.add_argument("--label-samples", type=int, default=2)
    ap.add_argument("--completions", type=int, default=4)
    ap.add_argument("--big-prompts", type=int, default=32, help="evaluate-1.5b's prompts: 32 x 4 samples = one batch of "
                                                               "the recipe's 128, then greedy and baseline")
    ap.add_argument("--agent-policy", default="", help="the agent arms' policy: a directory trained on configs/agent-memory.yaml")
    ap.add_argument("--output", default="outputs/stage-samplers-gpu")
    args = ap.parse_args(argv)

    stages = [s for s in args.stage.split(",") if s]
    unknown = [s for s in stages if s not in STAGES] + [a for a in args.arms.split(",") if a and a not in ARMS]
    if unknown:
        ap.error(f"unknown stages or arms {unknown}; stages: {', '.join(STAGES)}; arms: {', '.join(ARMS)}")
    arms = select_arms(stages, [a for a in args.arms.split(",") if a], args.skip_hf)
    if any(ARMS[a].model == "agent" for a in arms) and not args.agent_policy:
        ap.error("the agent arms need --agent-policy DIR (a policy trained on configs/agent-memory.yaml)")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    models = {"agent": args.agent_policy} if args.agent_policy else {}
    if any(ARMS[a].model == "358m" for a in arms):
        models["358m"] = args.policy or write_model(out / "model-358m")
    if any(ARMS[a].model == "1.5b" for a in arms):
        models["1.5b"] = write_body_1p5b(out / "model-1.5b-body")
    rows = []
    for name in arms:
        rows.append(run_arm(name, args, models, out))
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "models": models, "rows": rows}, indent=1))

    by = {r["arm"]: r for r in rows if "error" not in r}
    for stage in STAGES:
        mine = [r for r in rows if ARMS[r["arm"]].stage == stage]
        if not mine:
            continue
        print(f"\n{stage}, policy {models.get('agent' if stage == 'agent' else '358m', '-')}"
              + (f": {args.prompts or DEFAULT_SIZES[stage][0]} prompts x {args.samples or DEFAULT_SIZES[stage][1]} samples"
                 + (f" x {args.max_new_tokens} tokens" if stage == "rollout" else "")
                 if stage in ("rollout", "agent") else ""))
        table(stage, mine)
    if "hf" in by:
        for arm in ("vllm-stock", "vllm", "vllm-inproc"):
            if arm in by:
                print(f"stage wall hf / {arm}: {by['hf']['wall_s'] / by[arm]['wall_s']:.2f}x")
    for stage in ("evaluate", "prm-label"):
        g, c = by.get(f"{stage}-gpu"), by.get(f"{stage}-cpu")
        if g and c:
            print(f"{stage}: stage wall cpu / gpu {c['wall_s'] / g['wall_s']:.2f}x")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
