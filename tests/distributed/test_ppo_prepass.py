"""ppo's prepass on 2 ranks (gloo, DeepSpeed ZeRO-3, old_logprobs recomputed): each rank forwards its own
share of each micro-batch, cut as the update cuts it, so the first update's ratio is exactly 1 on every
rank and each rank forwards half of the batch's tokens; the ranks then hold the same old_logprobs for
every row (a later epoch trains a row on the other rank).

The batch has 17 responses: two minibatches of 8 an epoch and one left over, a micro-batch of one row
that only rank 0's share holds, so rank 1 takes part in that forward with a row it drops. (ZeRO-3
gathers each parameter above its persistence threshold, 1e5 elements by default, inside every forward:
a rank that skipped one would leave the others' collectives unmatched. The tiny model's parameters are
all below it, so this test sees that rank 1 takes part, not the hang; dropping the placeholder forward
fails the check of rank 1's forwards.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dp_helpers import COLLECTIVE_TIMEOUT_S, env, flags

pytestmark = pytest.mark.slow

RANK_SCRIPT = Path(__file__).with_name("ppo_prepass_rank.py")
#: The hand-off's old_logprobs are this far below the policy's own: a row whose recompute did not reach a
#: rank keeps them (its ratio starts at exp(0.25)), and the reported gap says how far they were.
SHIFT = 0.25


@pytest.fixture(scope="module")
def batch17(tmp_path_factory) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ppo"))
    from ppo_helpers import build_rows, write_advantages

    from prmflow.components.data import io
    from prmflow.components.models import modeling

    root = tmp_path_factory.mktemp("ppo-prepass")
    model, tok = modeling.load_causal_lm("tiny-llama", seed=0)
    with io.atomic_output_dir(root / "policy", "policy", manifest={"config": {"preset": "tiny-llama"}}) as tmp:
        modeling.save_pretrained(model, tok, tmp)
    rows = [dict(r, old_logprobs=[x - SHIFT for x in r["old_logprobs"]]) for r in build_rows(root / "policy", 17)]
    write_advantages(root / "advantages", rows, lambda i, t: (1.0 if i % 2 == 0 else -1.0) * (1 + 0.1 * t))
    return {"rows": rows, "policy": str(root / "policy"), "input": str(root / "advantages")}


def test_each_rank_forwards_its_share_and_the_first_ratio_is_exactly_one(batch17, tmp_path):
    from prmflow.components import config
    from prmflow.components.runtime import distributed
    from prmflow.components.ppo import minibatches as batch, stage

    values = {"policy": batch17["policy"], "input": batch17["input"], "output": str(tmp_path / "out"),
              "minibatch_size": 8, "micro_batch_size": 4, "epochs": 2, "optim.lr": 1e-3, "save_every": 0,
              "recompute_old_logprobs": "true", "engine.backend": "deepspeed", "engine.zero_stage": 3,
              "engine.collective_timeout_s": COLLECTIVE_TIMEOUT_S, "tracking.enabled": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(RANK_SCRIPT), str(tmp_path), "ppo", *flags(values)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=900)  # a hang guard
    assert done.returncode == 0, done.stderr[-4000:]

    # the first update's ratio is exactly 1 on both ranks (updates.jsonl has its max and min over the ranks)
    first = json.loads((tmp_path / "out" / "updates.jsonl").read_text().splitlines()[0])
    assert first["ratio_max"] == 1.0 and first["ratio_min"] == 1.0, first
    gap = json.loads((tmp_path / "out" / "manifest.json").read_text())["metrics"]["train/old_logprob_gap_mean"]
    assert gap == pytest.approx(SHIFT, abs=1e-4)  # every row recomputed, on one rank or the other

    # each rank's forwards are its shares of the micro-batches, in the order the update runs them
    rows = batch17["rows"]
    cfg = config.load(stage.Config, overrides={k: v for k, v in values.items() if k != "tracking.enabled"})
    plan = batch.minibatch_plan(len(rows), cfg)
    first_epoch = [c for mb in plan[:2] for c in batch.micro_split(mb, 4)]
    (left_over,) = sorted(set(range(len(rows))) - {i for c in first_epoch for i in c})
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, got in enumerate(ranks):
        assert [f["rows"] for f in got["forwards"]] == [distributed.shard(c, r, 2) for c in first_epoch] + [[left_over]]

    # ... so each rank forwards half of the batch's tokens, plus the one left-over row (rank 1 drops its result)
    tokens = {i: len(r["prompt_ids"]) + len(r["response_ids"]) for i, r in enumerate(rows)}
    total = sum(tokens.values())
    per_rank = [sum(f["tokens"] for f in got["forwards"]) for got in ranks]
    assert [sum(f["tokens"] for f in got["forwards"][:-1]) for got in ranks] == [
        sum(tokens[i] for c in first_epoch for i in distributed.shard(c, r, 2)) for r in (0, 1)]
    assert sum(per_rank) == total + tokens[left_over]
    assert max(per_rank) <= total / 2 + max(tokens.values()), (per_rank, total)
    print(f"prepass tokens per rank: {per_rank} of {total}")

    # both ranks hold the same old_logprobs for every row after the prepass
    assert ranks[0]["old_logprobs"] == ranks[1]["old_logprobs"] and len(ranks[0]["old_logprobs"]) == 1
