"""evaluate and prm-label on one GPU machine: sampling on its GPU against sampling on its CPU, as both stages did on a
GPU pod before 4b5553a / 4a58755 (the policy loaded in float32 on the CPU and never moved).

    python benchmarks/perf/sampling_stages_gpu.py --output /tmp/sampling-stages
    python benchmarks/perf/sampling_stages_gpu.py --arms evaluate-gpu,evaluate-cpu --prompts 32

The policy: the random 358M Qwen2-shaped model of benchmarks/perf/rollout_stage_gpu.py (the character tokenizer; a
response ends at EOS, which this random model seldom draws: its greedy responses averaged 127 of 128 tokens on the
H200, or at max_new_tokens). Each arm runs the stage in its own process, as a pod starts it:

- evaluate-gpu / prm-label-gpu: the stage's defaults: the GPU, bfloat16 (modeling.placement);
- evaluate-cpu / prm-label-cpu: the same stage and sizes with CUDA_VISIBLE_DEVICES empty and 12 threads (the
  recipe's gpu_pool has 12 cores): the CPU in float32, where the policy sampled on a GPU pod before the fix;
- evaluate-1.5b: evaluate on the GPU only, a random model of Qwen2.5-1.5B's body (28 layers, hidden 1,536, MLP
  8,960, 12 / 2 heads; the character vocabulary) at the cluster recipe's batch_sequences 128, its 4 samples and
  max_new_tokens 1024: the HF sampler's rate at the recipe's evaluate shapes;
- evaluate-vllm / prm-label-vllm / evaluate-1.5b-vllm: the gpu arms with sampler=vllm (the rollout's engine; they
  need the vLLM payload, so they are not in the default --arms);
- decode-1.5b: no stage: `generate`'s time per decode step for that body at batch 128 (30-token prompts, every
  sequence kept to the end), on the GPU in bf16 (a first call over new shapes, then a second) and on 12 CPU threads
  in float32 (8 steps): what a recipe-sized evaluate costs a step where it samples.

evaluate also greedy-decodes the baseline (the same policy again, as the recipe compares against the SFT policy).
Per arm: the stage's wall, its perf/* metrics, and the GPU memory its process allocated at peak (0 = it never
used the GPU). Prints a markdown table and writes OUTPUT/results.json. One run per arm: compare arms of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_stage_gpu import write_model  # noqa: E402

RUN = """
import json, sys, torch
from prmflow.components.common import config
from prmflow.components.{module} import {stage} as stage
m = stage.run(config.load(stage.Config, overrides=json.loads(sys.argv[1])))
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print("METRICS " + json.dumps({{**m, "cuda_peak_bytes": peak}}), flush=True)
"""

STAGES = {"evaluate": ("evaluate", "stage"), "prm-label": ("prm", "label")}
CPU = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "12", "MKL_NUM_THREADS": "12"}
ARMS = {  # name -> (stage, environment, model), in the order they run: the whole 1.5B evaluate, the longest, last
    "evaluate-gpu": ("evaluate", {}, "358m"),
    "prm-label-gpu": ("prm-label", {}, "358m"),
    "evaluate-cpu": ("evaluate", CPU, "358m"),
    "prm-label-cpu": ("prm-label", CPU, "358m"),
    "decode-1.5b": ("", {}, "1.5b"),
    "evaluate-1.5b": ("evaluate", {}, "1.5b"),
}
#: the same stages with sampler=vllm (the vLLM payload, not pack-slim's: not in the default --arms)
VLLM_ARMS = {"evaluate-vllm": ("evaluate", {}, "358m"), "prm-label-vllm": ("prm-label", {}, "358m"),
             "evaluate-1.5b-vllm": ("evaluate", {}, "1.5b")}


def write_body_1p5b(path: Path) -> str:
    """A random model of Qwen2.5-1.5B's body (bf16 weights) with the character tokenizer."""
    import torch

    return write_model(path, layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                       init_device="cuda" if torch.cuda.is_available() else "cpu")


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


def child(name: str, code: str, argv: list[str], out: Path, env_over: dict | None = None) -> tuple[dict, dict | None]:
    """Run `code` in its own process, logged to OUT/NAME.log as it runs (an arm cut short leaves its log): (the
    arm's row so far, the METRICS line's dict or None when the process failed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env_over or {}))
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as f:
        proc = subprocess.run([sys.executable, "-c", code, *argv], stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    row = {"arm": name, "wall_s": time.perf_counter() - t0}
    if proc.returncode:
        return {**row, "error": f"exit {proc.returncode}; see {out / f'{name}.log'}"}, None
    log = (out / f"{name}.log").read_text()
    return row, json.loads(next(line for line in log.splitlines() if line.startswith("METRICS "))[8:])


def decode_arm(name: str, model: str, out: Path) -> dict:
    row, m = child(name, DECODE, [model], out)
    return {**row, **(m or {})}


def overrides(stage: str, model: str, policy: str, args, out: Path) -> dict:
    common = {"policy": policy, "output": str(out), "overwrite": True, "tracking.enabled": False, "chat_template": False}
    if stage == "prm-label":
        return {**common, "num_prompts": args.label_prompts, "n_samples": args.label_samples,
                "completions": args.completions, "sampling.max_new_tokens": args.max_new_tokens}
    if model == "1.5b":
        return {**common, "baseline": policy, "num_prompts": args.big_prompts, "n_samples": 4,
                "sampling.max_new_tokens": 1024, "batch_sequences": 128}
    return {**common, "baseline": policy, "num_prompts": args.prompts, "n_samples": args.samples,
            "sampling.max_new_tokens": args.max_new_tokens, "batch_sequences": 128}


def run_arm(name: str, args, models: dict, out: Path) -> dict:
    stage, env_over, model = {**ARMS, **VLLM_ARMS}[name]
    module, attr = STAGES[stage]
    over = overrides(stage, model, models[model], args, out / name)
    if name in VLLM_ARMS:
        over["sampler"] = "vllm"
    row, m = child(name, RUN.format(module=module, stage=attr), [json.dumps(over)], out, env_over)
    if m is None:
        return row
    return {**row, "cuda_peak_gib": m["cuda_peak_bytes"] / 2**30,
            **{k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/")},
            **{k: v for k, v in m.items() if k in ("label/solutions", "label/steps", "eval/response_length")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join({**ARMS, **VLLM_ARMS})} "
                                                          f"(default: all but the -vllm ones, which need vLLM)")
    ap.add_argument("--prompts", type=int, default=16, help="evaluate's prompts in the gpu / cpu arms")
    ap.add_argument("--samples", type=int, default=4, help="evaluate's samples per prompt in the gpu / cpu arms")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="every response's budget in the gpu / cpu arms")
    ap.add_argument("--label-prompts", type=int, default=8)
    ap.add_argument("--label-samples", type=int, default=2)
    ap.add_argument("--completions", type=int, default=4)
    ap.add_argument("--big-prompts", type=int, default=32, help="evaluate-1.5b's prompts: 32 x 4 samples = one batch of the recipe's 128, then greedy and baseline (64 did not finish in 200 s on an H200)")
    ap.add_argument("--policy-358m", default="", help="an existing 358M model directory (benchmarks/perf/rollout_stage_gpu.py's) "
                                                        "instead of writing one")
    ap.add_argument("--output", default="outputs/sampling-stages-gpu")
    args = ap.parse_args(argv)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    known = {**ARMS, **VLLM_ARMS}
    unknown = [a for a in arms if a not in known]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {', '.join(known)}")
    models = {}
    if any(known[a][2] == "358m" for a in arms):
        models["358m"] = args.policy_358m or write_model(out / "model-358m")
    if any(known[a][2] == "1.5b" for a in arms):
        models["1.5b"] = write_body_1p5b(out / "model-1.5b-body")
    rows = []
    for name in arms:
        rows.append(decode_arm(name, models["1.5b"], out) if name == "decode-1.5b" else run_arm(name, args, models, out))
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    cols = ["wall_s", "sample_s", "baseline_s", "sample_tokens", "tokens_per_s", "sequences_per_s", "cuda_peak_gib",
            "gpu_first_s_per_step", "gpu_s_per_step", "cpu_s_per_step"]
    print("\n| arm | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['arm']} | " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                             for c in cols) + " |" + (f" {r['error']}" if "error" in r else ""))
    by = {r["arm"]: r for r in rows if "error" not in r}
    for stage in ("evaluate", "prm-label"):
        g, c = by.get(f"{stage}-gpu"), by.get(f"{stage}-cpu")
        if g and c:
            print(f"{stage}: stage wall cpu / gpu {c['wall_s'] / g['wall_s']:.2f}x")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
