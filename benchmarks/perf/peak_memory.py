"""What bench_implicit_prm.py and bench_ppo.py --what loss share: a pass's own peak memory, and a model of
Qwen2.5-1.5B's head shapes built from a config (no download; random weights, which change no size).

Peak memory is the pass's own: on CPU the process's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the pass) minus its resident size then; on a GPU
torch.cuda.max_memory_allocated minus what was allocated before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

VOCAB, HIDDEN = 151_936, 1_536


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_now(device: str) -> int:
    """Bytes in use now, with the peak counter reset to it: the start of a measured pass."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    return rss_kib("VmRSS") * 1024


def memory_peak(device: str) -> int:
    """The peak bytes since memory_now."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else rss_kib("VmHWM") * 1024


def qwen_1_5b_head(layers: int, dtype: torch.dtype, device: str):
    """A Qwen2 causal LM with Qwen2.5-1.5B's hidden size 1,536, vocabulary 151,936, tied head, MLP 8,960 wide,
    12 heads / 2 KV heads, and `layers` decoder layers, initialised where it runs (seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8_960, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=32_768)
    torch.manual_seed(0)
    with torch.device(device):  # a 28-layer body on a GPU in seconds, not a minute of CPU
        return Qwen2ForCausalLM(cfg).to(dtype=dtype)


def child_rows(cmds: list[list[str]]) -> list[dict] | int:
    """Run each measuring child (one process per path, so each peak is its own) and read the JSON row it prints
    last; a failed child's exit code (its stderr's tail printed) instead of the rows."""
    rows = []
    for cmd in cmds:
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows
