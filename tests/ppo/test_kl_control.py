import json

import pytest

from prmflow.components.common.errors import DataError
from prmflow.components.ppo import kl_control


def test_fixed_controller_never_moves():
    c = kl_control.make_controller("fixed", 0.1)
    for kl in (0.0, 5.0, 1e6):
        assert c.update(kl, 1000) == 0.1
    assert c.state() == {"kl_coef": 0.1, "mode": "fixed"}


@pytest.mark.parametrize("kl,expected_error", [
    (6.0, 0.0),      # on target: no change
    (6.6, 0.1),      # 10% above target
    (3.0, -0.2),     # 50% below: clipped at -0.2
    (60.0, 0.2),     # 10x above: clipped at +0.2
])
def test_adaptive_controller_follows_the_formula(kl, expected_error):
    c = kl_control.make_controller("adaptive", 0.05, target=6.0, horizon=1000)
    new = c.update(kl, 250)
    assert new == pytest.approx(0.05 * (1 + expected_error * 250 / 1000))
    assert c.kl_coef == new


def test_adaptive_controller_converges_toward_target_direction():
    c = kl_control.make_controller("adaptive", 1.0, target=1.0, horizon=100)
    seq = [c.update(2.0, 10) for _ in range(5)]
    assert all(b > a for a, b in zip([1.0] + seq, seq))  # KL too high -> beta keeps growing


def test_state_round_trip_through_file_or_directory(tmp_path):
    c = kl_control.make_controller("adaptive", 0.02, 3.0, 500)
    kl_control.write_state(tmp_path / kl_control.KL_STATE_FILE, {**c.state(), "iteration": 2})
    assert kl_control.read_state(tmp_path)["kl_coef"] == 0.02
    assert kl_control.read_state(tmp_path / "kl_state.json")["mode"] == "adaptive"


def test_bad_state_files_are_reported(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        kl_control.read_state(tmp_path / "missing.json")
    (tmp_path / "kl_state.json").write_text(json.dumps({"beta": 1}))
    with pytest.raises(DataError, match="kl_coef"):
        kl_control.read_state(tmp_path)


def test_kl_per_response_is_the_mean_of_sums():
    assert kl_control.kl_per_response([[0.1, 0.2, 0.3], [1.0]]) == pytest.approx((0.6 + 1.0) / 2)
    assert kl_control.kl_per_response([]) == 0.0
