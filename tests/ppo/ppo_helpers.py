"""Helpers for the ppo tests: advantages hand-offs built directly (no rollout/advantage stage).

(A module with its own name, not conftest.py, so `import ppo_helpers` cannot pick up another test
directory's conftest when the whole suite runs.)

Responses are the arithmetic task's reference solutions and deliberately corrupted ones (so some
tokens are likely under the SFT policy and some are not); old_logprobs come from a real forward
pass of the policy, right-padded (the ppo stage left-pads prompts, so equality also checks that
the two layouts score the same tokens the same way).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import torch

from prmflow.components.models import modeling, tensor_ops
from prmflow.components.data import schema
from prmflow.tasks import arithmetic

FAST = {"tracking.enabled": False, "engine.backend": "torch", "optim.lr": 1e-3, "critic_lr": 1e-3}


@torch.no_grad()
def score(model, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
    """log p(response token t | prompt + response[:t]) per row, right-padded batch (the slow, obvious way)."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    lp = tensor_ops.sequence_logprobs(model, ids, mask)  # (B, T-1): entry k scores token k+1
    return [lp[b, len(p) - 1:len(p) - 1 + len(r)].tolist() for b, (p, r) in enumerate(zip(prompt_ids, response_ids))]


def build_rows(policy_dir: Path, n: int = 16, seed: int = 0) -> list[dict]:
    """n rollout-like rows: prompt/response ids, old_logprobs from the policy, ref_logprobs = old_logprobs."""
    model, tok = modeling.load_causal_lm(policy_dir)
    model.eval()
    rng = random.Random(seed)
    problems = arithmetic.generate(n, seed=seed, split="train")
    prompts, responses = [], []
    for k, p in enumerate(problems):
        text = p.solution if k % 2 == 0 else arithmetic.corrupt(p, rng)[0]
        prompts.append(tok(p.prompt, add_special_tokens=True)["input_ids"])
        responses.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    old = score(model, prompts, responses)
    return [{"prompt_id": p.prompt_id, "sample_idx": 0, "iteration": 0, "prompt": p.prompt, "prompt_ids": pi,
             "response_ids": ri, "old_logprobs": lp, "ref_logprobs": list(lp), "kl": [0.0] * len(ri),
             "outcome_reward": 0.0}
            for p, pi, ri, lp in zip(problems, prompts, responses, old)]


def write_advantages(path: Path, rows: list[dict], advantages, returns=None, values=None, manifest=None,
                     **overrides) -> Path:
    """Write rows as an advantages hand-off. `advantages` (and returns/values): a float, or a function
    (row index, token index) -> float, or per-row lists. `manifest`: extra manifest entries."""
    def per_token(spec, i, r):
        if spec is None:
            return None
        if callable(spec):
            return [float(spec(i, t)) for t in range(len(r["response_ids"]))]
        if isinstance(spec, (int, float)):
            return [float(spec)] * len(r["response_ids"])
        return [float(x) for x in spec[i]]

    out = []
    for i, r in enumerate(rows):
        row = dict(r)
        row["advantages"] = per_token(advantages, i, r)
        row["returns"] = per_token(returns, i, r)
        row["values"] = per_token(values, i, r)
        row["token_rewards"] = [0.0] * len(r["response_ids"])
        for k, v in overrides.items():
            row[k] = per_token(v, i, r) if k in schema.PER_TOKEN_COLUMNS else v
        out.append(row)
    return schema.write_dataset(path, pa.Table.from_pylist(out), "advantages", extra=manifest)


def load_policy(path: Path):
    model, _ = modeling.load_causal_lm(path)
    return model


def params(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))
