"""How exactly an SFT policy of the memory agent copies a chunk into memory (docs/agents.md, "Copying").

    python benchmarks/experiments/agent_copy_probe.py outputs/agent-s0/workspace/sft-*
    python benchmarks/experiments/agent_copy_probe.py --help

For each of the first N test-split episodes, the policy reads the first chunk as the rollout lays it out
(`chat.opening_ids`) and is made to start the expert's store call (`{"name":"memory_insert","arguments":
{"content":"`); its greedy continuation is compared with the chunk. Prints the exact-copy rate (the whole chunk,
both facts), the character accuracy of the copy, the first fact's exact-copy rate (what a policy that stores the
first fact alone gets right), and how often the greedy first token opens a skip (`[]`). QA after RL that stores
every chunk is close to the exact-copy rate, so a start that does not copy leaves RL little to gain in a few
iterations (docs/agents.md, "Copying").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PREFIX = '{"name":"memory_insert","arguments":{"content":"'
"""The expert's store call up to its content (memory_agent.call_text, json format)."""


def score(copies: list[str], chunks: list[str]) -> dict:
    """Exact-copy rate and character accuracy of `copies` against `chunks` (each copy cut to its chunk's length), and
    the rate at which the copy starts with the chunk's first fact exactly (`ann 42` and no further digit: what a
    policy that stores the first fact alone gets right)."""
    exact = sum(c[:len(t)] == t for c, t in zip(copies, chunks))
    chars = sum(sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(copies, chunks))
    firsts = [t.split(", ")[0] for t in chunks]
    first = sum(c[:len(f)] == f and not c[len(f):len(f) + 1].isdigit() for c, f in zip(copies, firsts))
    return {"exact_copy": exact / len(chunks), "char_accuracy": chars / len(chunks), "first_fact_copy": first / len(chunks)}


def probe_ids(tokenizer, chunk: str) -> tuple[list[int], list[int]]:
    """(ids of the first chunk as the rollout opens an episode, the same followed by the forced call prefix)."""
    from prmflow.components.models import chat

    _, opening = chat.opening_ids(tokenizer, [{"role": "user", "content": chunk}], True)
    return list(opening), list(opening) + tokenizer(PREFIX, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def probe(model_dir: str, n: int = 200, seed: int = 0) -> dict:
    from prmflow.components.models import modeling
    from prmflow.tasks import memory_agent

    model, tok = modeling.load_causal_lm(model_dir)
    model.eval()
    chunks = [memory_agent.chunk_text(e.chunks[0]) for e in memory_agent.generate(n, seed, "test")]
    copies, skips = [], 0
    skip_id = tok(memory_agent.NO_CALL, add_special_tokens=False)["input_ids"][0]
    for chunk in chunks:
        opening, forced = probe_ids(tok, chunk)
        skips += int(model(torch.tensor([opening])).logits[0, -1].argmax()) == skip_id
        out = model.generate(torch.tensor([forced]), max_new_tokens=len(chunk) + 3, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        copies.append(tok.decode(out[0, len(forced):], skip_special_tokens=True))
    return {**score(copies, chunks), "greedy_skip": skips / n, "episodes": n}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="SFT policy directories (the sft stage's output)")
    p.add_argument("--episodes", type=int, default=200, help="test-split episodes probed (default 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for m in args.models:
        r = probe(m, args.episodes)
        print(f"{Path(m)}: exact copy {r['exact_copy']:.3f}, character accuracy {r['char_accuracy']:.3f}, "
              f"first fact exact {r['first_fact_copy']:.3f}, greedy first token skips {r['greedy_skip']:.3f} "
              f"({r['episodes']} test episodes)")


if __name__ == "__main__":
    main()
