"""The rollout stage on one GPU: the HF sampler against vLLM, and what vLLM's engine start is made of.

    python benchmarks/perf/rollout_stage_gpu.py --output /tmp/rollout-stage               # 64 prompts x 8, 128 tokens
    python benchmarks/perf/rollout_stage_gpu.py --policy DIR --prompts 128 --samples 8 --skip-hf

Unless --policy is given it writes a random Qwen2-shaped model of 358M parameters (24 layers, hidden 896,
GQA 14/2 heads, the project's character tokenizer: the model of the first vLLM run, docs/real-models.md) and samples the arithmetic task
with it (a sample ends at EOS or --max-new-tokens, as in a rollout). Then `rollout` runs as its own process
(a fresh engine, as a pipeline pod starts it) once per arm:

- hf:          sampler=hf (bf16 on the GPU);
- vllm:        sampler=vllm with prmflow's defaults (vllm_engine.VLLMSettings);
- vllm-inproc: the same with vllm.in_process=true: vLLM's engine core in the stage's process;
- vllm-stock:  sampler=vllm with vLLM's own start defaults: torch.compile (compilation mode 3) and CUDA graphs
               for vLLM's default list of batch sizes (vllm.compile=true, vllm.cudagraph_capture_sizes=[]).
               Last: on a cold compile cache it did not finish in 126 s on the H200 (2026-11-26).

Per arm: the stage's wall, its perf/load_s (engine or model start), perf/generate_s, perf/score_s and
tokens/s; for vLLM the start's parts as vLLM logs them (weights, model loading, memory profiling,
compilation, CUDA graph capture, the whole engine init) and, from the log's stamps, what vLLM does not time
(the imports before its first line, the engine process's start, the shutdown). Prints a markdown table and writes
OUTPUT/results.json. One run per arm on whatever GPU this is: compare arms of one run only.
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

ARMS = {
    "hf": {"sampler": "hf"},
    "vllm": {"sampler": "vllm"},
    # the engine core in the stage's own process (vllm.in_process): no second process that imports torch and vLLM
    # again (21 s of the 40 s start on the H200, 2026-11-26; docs/testing.md)
    "vllm-inproc": {"sampler": "vllm", "vllm.in_process": True},
    "vllm-stock": {"sampler": "vllm", "vllm.compile": True, "vllm.cudagraph_capture_sizes": []},
}

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


RUN = """
import json, sys
from prmflow.components.common import config
from prmflow.components.rollout import stage
m = stage.run(config.load(stage.Config, overrides=json.loads(sys.argv[1])))
print("METRICS " + json.dumps(m), flush=True)
"""


def write_model(path: Path, layers: int = 24, hidden: int = 896, intermediate: int = 4864, heads: int = 14,
                kv_heads: int = 2, init_device: str = "cpu") -> str:
    """A random Qwen2-shaped model (bf16 weights) with the character tokenizer; by default the 358M one.
    `init_device`: where its weights are drawn (a GPU draws a 1.5B body in seconds; other numbers than the CPU's)."""
    from prmflow.components.common import modeling

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


def run_arm(name: str, over: dict, args, policy: str, out: Path) -> dict:
    overrides = {"policy": policy, "output": str(out / name), "overwrite": True, "tracking.enabled": False,
                 "num_prompts": args.prompts, "n_samples": args.samples, "sampling.max_new_tokens": args.max_new_tokens,
                 "chat_template": False, **over}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    started = time.time()
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as f:  # written as it runs: an arm cut short by a time limit leaves its log
        proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(overrides)], stdout=f, stderr=subprocess.STDOUT,
                              text=True, env=env)
    wall = time.perf_counter() - t0
    log = (out / f"{name}.log").read_text()
    if proc.returncode:
        return {"arm": name, "error": f"exit {proc.returncode}; see {out / f'{name}.log'}", "wall_s": wall}
    metrics = json.loads(next(line for line in log.splitlines() if line.startswith("METRICS "))[8:])
    row = {"arm": name, "wall_s": wall, **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("perf/")}}
    for key, pattern in START_PARTS.items():
        found = re.findall(pattern, log)
        if found:
            row[key] = sum(float(x) for x in found)  # one per worker (tensor parallel) or per call
    row.update(timeline(log, started))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="", help="policy directory (default: the random 358M Qwen2-shaped model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the hf arm (the slowest)")
    ap.add_argument("--output", default="outputs/rollout-stage-gpu")
    args = ap.parse_args(argv)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    policy = args.policy or write_model(out / "model-358m")
    arms = [a for a in args.arms.split(",") if a and not (args.skip_hf and a == "hf")]
    rows = []
    for name in arms:
        rows.append(run_arm(name, ARMS[name], args, policy, out))
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps({"policy": policy, "prompts": args.prompts, "samples": args.samples,
                                                      "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
    cols = ["wall_s", "load_s", "generate_s", "score_s", "tokens_per_s", "weights_s", "model_load_s", "profiling_s",
            "compile_s", "graph_capture_s", "init_engine_s", "to_vllm_s", "core_start_s", "shutdown_s"]
    print(f"\n{args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} tokens, policy {policy}")
    print("| arm | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['arm']} | " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                             for c in cols) + " |" + (f" {r['error']}" if "error" in r else ""))
    walls = {r["arm"]: r["wall_s"] for r in rows if "error" not in r}
    if "hf" in walls:
        for arm in ("vllm-stock", "vllm", "vllm-inproc"):
            if arm in walls:
                print(f"stage wall hf / {arm}: {walls['hf'] / walls[arm]:.2f}x")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
