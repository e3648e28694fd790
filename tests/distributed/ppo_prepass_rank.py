"""One rank of tests/distributed/test_ppo_prepass.py, started by torchrun: `prmflow ppo ARGS` as the
command runs it, with the prepass's forward passes counted. Writes OUT/rank-R.json: the rows and the
tokens (attention-mask ones, padding excluded) of every prepass forward of this rank, and a digest of
every sample's old_logprobs after the prepass (the ranks must agree on all of them).

    python -m torch.distributed.run --standalone --nproc-per-node 2 ppo_prepass_rank.py OUT ppo --flag value ...
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from prmflow import cli
from prmflow.components.runtime import distributed
from prmflow.components.ppo import prepass, stage

out, argv = Path(sys.argv[1]), sys.argv[2:]
forwards: list[dict] = []
digest: list[str] = []


class CountingScorer(prepass.PolicyScorer):
    def __call__(self, mb, *args, **kwargs):
        forwards.append({"rows": list(mb.rows), "tokens": mb.tokens})
        return super().__call__(mb, *args, **kwargs)


def counted_precompute(cfg, samples, *args, **kwargs):
    result = real_precompute(cfg, samples, *args, **kwargs)
    digest.append(hashlib.sha256(json.dumps([s.old_logprobs for s in samples]).encode()).hexdigest())
    return result


real_precompute = stage.precompute
prepass.PolicyScorer = CountingScorer          # the prepass's scorer only (update.py keeps its own)
stage.precompute = counted_precompute
code = cli.main(argv)
(out / f"rank-{distributed.rank()}.json").write_text(json.dumps({"forwards": forwards, "old_logprobs": digest}))
sys.exit(code)
