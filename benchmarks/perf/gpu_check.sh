#!/usr/bin/env bash
# The GPU check: one script, one GPU machine, under 8 minutes, results in one folder (docs/testing.md, "On a GPU").
#
#   bash benchmarks/perf/gpu_check.sh receive DIR   # copy payload parts that arrived in DIR to $PAYLOAD (one call per part)
#   bash benchmarks/perf/gpu_check.sh run           # install, then the checks below; results in $RESULTS
#   bash benchmarks/perf/gpu_check.sh pack-slim DIR # here: ../shared/gpu's packages less vLLM and what only vLLM imports,
#                                              # DIR/site-slim.tar.gz (~22 MB: one carry) + the protobuf wheel
#   bash benchmarks/perf/gpu_check.sh stages DIR    # there, DIR the carried folder: the checks that need no vLLM (below)
#
# `stages` (no vLLM; each part given what is left of BUDGET_S):
#   1. sampling-stages: benchmarks/perf/stage_samplers_gpu.py --stage evaluate,prm-label: evaluate and prm-label sampling on the GPU (their default)
#                       against on the CPU in float32 (where both sampled on a GPU pod before 4b5553a / 4a58755), and
#                       evaluate at the 1.5B recipe's evaluate shapes
#   2. stage-tests:     the quick tests of evaluate, the prm stages and rollout with CUDA present (models on it)
#   3. implicit-prm:    benchmarks/perf/bench_implicit_prm.py at Qwen2.5-1.5B's whole shapes (28 layers), chunked vs plain:
#                       rollout's old/ref log-probs at the 1.5B recipe's 32 sequences x (150 + 1024) tokens, the implicit
#                       PRM's scoring pass at 32 x 600 and its training step at the prm recipe's micro batch 8 x 1024
#
# The payload is ../shared/gpu (README there): vLLM 0.24.0 and what it needs, for CPython 3.12 with torch 2.11.0+cu130.
# Parts, in order of what matters most (what no GPU has run yet first), each given what is left of the 8 minutes (and its cap):
#   1. agent:          benchmarks/perf/stage_samplers_gpu.py --arms agent-hf,agent-vllm: the memory agent's multi-turn rollout
#                      (configs/agent-memory.yaml's rollout section, 128 prompts x 8) with the HF sampler and with vLLM,
#                      one engine for both turns: reward components side by side, the log-prob gap of the
#                      engine's policy tokens against the trainer's forward over the whole episode. The policy is
#                      $AGENT_POLICY (default .gpu-agent/policy: carry a policy from an agent-memory run-local; the part
#                      is skipped without one)
#   2. stages-vllm:    benchmarks/perf/stage_samplers_gpu.py, the -vllm arms: evaluate and prm-label with sampler=vllm
#                      against their HF default (evaluate-vllm: the baseline's greedy from the policy's engine)
#   3. agent-tests:    pytest tests/rollout/test_agent_rollout.py -k vllm: docs/agents.md's example environment through
#                      the stage on the real engine (one engine for every turn, valid episodes, resume)
#   4. vllm-tests:     pytest tests/rollout -k vllm, the rest (the real engine: greedy = model.generate, seeds, stop ids,
#                      new weights, the two logprob checks of issue 48, ranks and shards; all 12 passed on an H200, 2026-11-26)
#   5. rollout-recipe: benchmarks/perf/stage_samplers_gpu.py --stage rollout, the rollout stage with vLLM (prmflow's start
#                      defaults, its engine core spawned, then in-process) at the cluster recipe's per-shard size (64
#                      prompts x 8, 1024 tokens), the start split into its parts; then the HF sampler at that batch with
#                      128 tokens (its tokens/s at 512 sequences)
#   6. gap:            benchmarks/perf/sampler_trainer_gap.py --correction-only --sampler vllm: a bf16 vLLM rollout
#                      against the float32 trainer, with each rollout_correction mode
#   7. ppo-sft-tests:  the quick ppo and sft tests on the GPU
#   8. rollout-stage:  the HF sampler and in-process vLLM at 32 prompts x 8 x 128 tokens
#   9. rollout-stock:  the vLLM arm with vLLM's own start defaults (torch.compile, its 51 CUDA graph sizes)
# RESULTS (default $OUT/gpu-check when $OUT is set, else /tmp/gpu-check) gets summary.md (machine, each part's
# exit status and seconds, its key lines) and logs.tar.gz (every part's whole log).
set -uo pipefail
PAYLOAD=${PAYLOAD:-/tmp/gpu}
RESULTS=${RESULTS:-${OUT:+$OUT/gpu-check}}
RESULTS=${RESULTS:-/tmp/gpu-check}
BUDGET_S=${BUDGET_S:-540}   # the whole run, install included; the machine's start and transfers come on top

if [ "${1:-}" = "receive" ]; then
  mkdir -p "$PAYLOAD" && cp -v "${2:?receive needs the folder the parts arrived in}"/* "$PAYLOAD"/ && ls -la "$PAYLOAD"
  exit 0
fi
if [ "${1:-}" = "pack-slim" ]; then  # vLLM and the packages only vLLM's engine imports stay out (MANIFEST.txt lists all)
  dest=${2:?pack-slim needs a folder}; src=${SHARED_GPU:-$(dirname "$0")/../../../shared/gpu}; tmp=$(mktemp -d)
  cat "$src"/site.tar.gz.part-0* | tar -xzf - -C "$tmp" || exit 1
  mkdir -p "$dest" && tar -czf "$dest/site-slim.tar.gz" -C "$tmp" --exclude='./vllm' --exclude='./vllm-*' \
    --exclude='./xgrammar*' --exclude='./llguidance*' --exclude='./openai*' --exclude='./tvm_ffi' --exclude='./apache_tvm_ffi*' \
    --exclude='./cbor2*' --exclude='./blake3*' --exclude='./pybase64*' --exclude='./msgspec*' --exclude='./partial_json_parser*' \
    --exclude='./jiter*' --exclude='./zmq' --exclude='./pyzmq*' . || exit 1
  cp "$src"/protobuf-*.whl "$dest"/ && rm -rf "$tmp" && ls -la "$dest"
  exit 0
fi
if [ "${1:-}" = "install-slim" ]; then  # stages' install: the slim site into /tmp/site, protobuf as install.sh does it
  rm -rf /tmp/site && mkdir -p /tmp/site && tar -xzf "${2:?}/site-slim.tar.gz" -C /tmp/site || exit 1
  python3 -c 'import google.protobuf as p; from packaging.version import Version as V; import sys; sys.exit(V(p.__version__) < V("6.33.5"))' \
    || { rm -rf /tmp/site/google/protobuf /tmp/site/protobuf-*.dist-info
         python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall("/tmp/site")' "$2"/protobuf-*.whl || exit 1; }
  exit 0
fi
[ "${1:-}" = "run" ] || [ "${1:-}" = "stages" ] || { echo "usage: $0 receive DIR | run | pack-slim DIR | stages DIR"; exit 2; }
MODE=$1

T0=$(date +%s)
mkdir -p "$RESULTS/logs"
SUMMARY="$RESULTS/summary.md"
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

part() {  # part NAME CAP_S COMMAND...: run with what is left (at most CAP_S), log it, record status and seconds
  local name=$1 cap=$2; shift 2
  local t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "| $name | not run (out of time) | - |" >> "$SUMMARY"; return; fi
  local s=$(date +%s)
  timeout -k 10 "$t" "$@" > "$RESULTS/logs/$name.log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - s ))
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && rc="$rc: timeout after ${t} s"
  echo "| $name | $rc | $took |" >> "$SUMMARY"
  echo "[gpu-check] $name: $rc in $took s"
}

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 --version 2>&1
  echo "commit $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -c . ) files changed"
  echo '```'
  echo
  echo "| part | exit | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

if [ "$MODE" = "stages" ]; then
  SLIM=${2:?stages needs the folder site-slim.tar.gz arrived in}
  part install 90 bash "$0" install-slim "$SLIM"
  export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  python3 -c 'import torch, transformers, mlflow, prmflow; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' \
    >> "$RESULTS/logs/install.log" 2>&1
  part sampling-stages 200 python3 benchmarks/perf/stage_samplers_gpu.py --stage evaluate,prm-label --output "$RESULTS/sampling-stages"
  part stage-tests 150 python3 -m pytest -p no:cacheprovider -q -rfE tests/evaluate tests/prm tests/rollout -m "not slow and not real_model"
  part implicit-prm 200 bash -c "python3 benchmarks/perf/bench_implicit_prm.py --layers 28 --dtype bfloat16 --batch 32 --tokens 1174 \
      --prompt_tokens 150 --what logprobs; \
    python3 benchmarks/perf/bench_implicit_prm.py --layers 28 --dtype bfloat16 --batch 32 --tokens 600; \
    python3 benchmarks/perf/bench_implicit_prm.py --layers 28 --dtype bfloat16 --batch 8 --tokens 1024 --train"
  {
    echo; echo "whole run: $(( $(date +%s) - T0 )) s"
    for f in install stage-tests; do echo; echo "## $f"; echo '```'; tail -15 "$RESULTS/logs/$f.log"; echo '```'; done
    for f in sampling-stages implicit-prm; do
      echo; echo "## $f"; echo '```'; grep -E "^\||x$|weights of|^\{" "$RESULTS/logs/$f.log" 2>/dev/null; echo '```'
    done
  } >> "$SUMMARY"
  for a in "$RESULTS/sampling-stages/"*.log; do [ -f "$a" ] && cp "$a" "$RESULTS/logs/sampling-stages-$(basename "$a")"; done
  cp "$RESULTS/sampling-stages/results.json" "$RESULTS/sampling-stages.json" 2>/dev/null
  tar -czf "$RESULTS/logs.tar.gz" -C "$RESULTS" logs && rm -rf "$RESULTS/logs" "$RESULTS/sampling-stages"
  cat "$SUMMARY"
  exit 0
fi

part install 90 bash "$PAYLOAD/install.sh"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# no VLLM_USE_FLASHINFER_SAMPLER here: the adapter sets it where flashinfer is missing (a check of that too)
python3 -c 'import torch, transformers, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)' \
  >> "$RESULTS/logs/install.log" 2>&1

PYTEST="python3 -m pytest -p no:cacheprovider -q -rfE"
AGENT_POLICY=${AGENT_POLICY:-$PWD/.gpu-agent/policy}
if [ -f "$AGENT_POLICY/config.json" ]; then
  part agent 180 python3 benchmarks/perf/stage_samplers_gpu.py --arms agent-hf,agent-vllm --agent-policy "$AGENT_POLICY" \
       --output "$RESULTS/agent"
else
  echo "| agent | not run (no policy at $AGENT_POLICY) | - |" >> "$SUMMARY"
fi
# evaluate and prm-label with sampler=vllm (the rollout's engine) against their HF default, same sizes
# (2026-11-29: evaluate-vllm's second engine, the baseline's, never reported ready; now the policy's engine serves both)
part stages-vllm 150 python3 benchmarks/perf/stage_samplers_gpu.py \
     --arms evaluate-gpu,evaluate-vllm,prm-label-gpu,prm-label-vllm --output "$RESULTS/stages-vllm"
part agent-tests 120 $PYTEST tests/rollout/test_agent_rollout.py -k vllm
part vllm-tests 200 $PYTEST tests/rollout -k "vllm and not test_the_docs_example_runs_through_the_stage"
# the recipe's per-shard size (configs/cluster/qwen2.5-math-1.5b-gsm8k-math.yaml: 512 prompts / 8 shards x 8
# samples, up to 1024 new tokens), vLLM spawned and in-process (2026-11-27: in-process load 20.1 s, spawned 42.6 s)
part rollout-recipe 200 python3 benchmarks/perf/stage_samplers_gpu.py --arms vllm,vllm-inproc --prompts 64 --samples 8 \
     --max-new-tokens 1024 --output "$RESULTS/rollout-recipe"
MODEL="$RESULTS/rollout-recipe/model-358m"
# the HF sampler at the shard's 512 sequences, 128 tokens: its tokens/s at that batch, from which its wall at 1024 tokens
# is read (at 1024 tokens the HF arm takes minutes)
part rollout-recipe-hf 120 python3 benchmarks/perf/stage_samplers_gpu.py --policy "$MODEL" \
     --arms hf --prompts 64 --samples 8 --max-new-tokens 128 --output "$RESULTS/rollout-recipe-hf"
part gap 100 python3 benchmarks/perf/sampler_trainer_gap.py --correction-only --sampler vllm --output /tmp/gap
part ppo-sft-tests 100 $PYTEST tests/ppo tests/sft -m "not slow and not real_model"
part rollout-stage 200 python3 benchmarks/perf/stage_samplers_gpu.py --policy "$MODEL" --prompts 32 --samples 8 \
     --max-new-tokens 128 --arms hf,vllm-inproc --output "$RESULTS/rollout-stage"
# vLLM's own start defaults (torch.compile, 51 graphs) last: on a cold compile cache it ran past 126 s (2026-11-26)
part rollout-stock 200 python3 benchmarks/perf/stage_samplers_gpu.py --policy "$MODEL" \
     --arms vllm-stock --prompts 32 --samples 8 --max-new-tokens 128 --output "$RESULTS/rollout-stock"
{
  echo
  echo "whole run: $(( $(date +%s) - T0 )) s"
  for f in agent-tests vllm-tests ppo-sft-tests; do
    echo; echo "## $f"; echo '```'; grep -E "passed|failed|error|FAILED|ERROR" "$RESULTS/logs/$f.log" 2>/dev/null | tail -25; echo '```'
  done
  for f in agent stages-vllm rollout-recipe rollout-recipe-hf rollout-stage rollout-stock; do
    echo; echo "## $f"; echo '```'; grep -E "^\||^stage wall|prompts x" "$RESULTS/logs/$f.log" 2>/dev/null; echo '```'
  done
  echo; echo "## gap"; echo '```'; grep -E "^\||^device|^bf16" "$RESULTS/logs/gap.log" 2>/dev/null; echo '```'
} >> "$SUMMARY"
for f in agent stages-vllm rollout-recipe rollout-recipe-hf rollout-stage rollout-stock; do  # each arm's whole log (a part cut by its cap leaves its arm's log too)
  for a in "$RESULTS/$f/"*.log; do [ -f "$a" ] && cp "$a" "$RESULTS/logs/$f-$(basename "$a")"; done
  cp "$RESULTS/$f/results.json" "$RESULTS/$f.json" 2>/dev/null
done
tar -czf "$RESULTS/logs.tar.gz" -C "$RESULTS" logs && rm -rf "$RESULTS/logs" "$RESULTS/agent" "$RESULTS/rollout-stage" "$RESULTS/rollout-recipe" "$RESULTS/rollout-recipe-hf" "$RESULTS/rollout-stock" "$RESULTS/stages-vllm"
cat "$SUMMARY"
