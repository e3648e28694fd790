"""The state a run of a chain hands to the next (pipelines/chain.py): what chain-next records is what
chain-resume gives back, location for location; a missing record or a workspace that lost a file is an
error that says what to do, before any GPU step starts."""

from __future__ import annotations

import json

import pytest

from prmflow.errors import DataError
from prmflow.pipelines import chain
from prmflow.pipelines.kfp_shim import located, read_location, write_location


def test_the_recorded_state_comes_back_as_the_same_locations(tmp_path):
    ws = tmp_path / "workspace"
    policy = ws / "ppo-1-abc" / "policy"
    policy.mkdir(parents=True)
    (policy / "model.safetensors").write_bytes(b"weights")
    write_location(str(tmp_path / "a-policy"), str(policy))
    (tmp_path / "kl.json").write_text(json.dumps({"kl_coef": 0.04}))
    key = chain.state_key("shape", {"ppo": {"epochs": 1}})
    chain.write_state(str(ws), key, 2, {"policy": str(tmp_path / "a-policy")}, str(tmp_path / "kl.json"))

    record = chain.read_state(str(ws), key, 2, ["policy", "kl_state"])
    out = {name: str(tmp_path / "out" / name) for name in ("policy", "critic")}
    chain.restore(record, out, str(tmp_path / "out-kl.json"))
    assert read_location(out["policy"]) == read_location(str(tmp_path / "a-policy"))
    assert located(out["policy"]) == str(policy)
    assert json.loads((tmp_path / "out-kl.json").read_text()) == {"kl_coef": 0.04}

    with pytest.raises(DataError, match="lacks critic"):  # a run that reads a critic the record has not
        chain.read_state(str(ws), key, 2, ["policy", "critic"])
    with pytest.raises(DataError, match=r"no state after iteration 4 .*found after-2\.json.*from its start"):
        chain.read_state(str(ws), key, 4, ["policy"])
    with pytest.raises(DataError, match="no state after iteration 2"):  # other configs: another chain
        chain.read_state(str(ws), chain.state_key("shape", {"ppo": {"epochs": 2}}), 2, ["policy"])
    (policy / "model.safetensors").unlink()  # the workspace lost the weights
    with pytest.raises(DataError, match="no longer holds the state"):
        chain.restore(record, out, str(tmp_path / "out-kl.json"))


def test_segments_cover_every_iteration_once():
    for total in range(1, 30):
        for per in range(1, 12):
            segs = chain.segments(total, per)
            assert [i for s in segs for i in range(s.first, s.end)] == list(range(total))
            assert all(1 <= s.iterations <= per for s in segs) and segs[-1].last
            assert [s.shape for s in segs] == (["whole"] if len(segs) == 1 else
                                               ["first"] + ["next"] * (len(segs) - 2) + ["last"])
