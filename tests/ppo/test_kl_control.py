import pytest

from prmflow.errors import ConfigError
from prmflow.components.training import kl_state
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
    kl_state.write(tmp_path / kl_state.KL_STATE_FILE, {**c.state(), "iteration": 2})
    assert kl_state.read(tmp_path)["kl_coef"] == 0.02
    assert kl_state.read(tmp_path / "kl_state.json")["mode"] == "adaptive"
    assert kl_state.read_kl_coef(tmp_path) == 0.02


@pytest.mark.parametrize("content,match", [
    (None, "does not exist"),
    ("not json", "not valid JSON"),
    ('["kl_coef"]', "no field 'kl_coef'"),
    ('{"beta": 1}', "no field 'kl_coef'"),
    ('{"kl_coef": -1}', "kl_coef=-1; it must be a finite number >= 0"),
    ('{"kl_coef": NaN}', "kl_coef=nan"),
    ('{"kl_coef": "0.1"}', "kl_coef='0.1'"),
    ('{"kl_coef": true}', "kl_coef=True"),
])
def test_bad_state_files_name_the_key_the_file_and_the_field(tmp_path, content, match):
    path = tmp_path / "kl_state.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        kl_state.read(tmp_path / "kl_state.json")
    assert str(err.value).startswith(f"kl_state '{path}'")


def test_kl_per_response_is_the_mean_of_sums():
    assert kl_control.kl_per_response([[0.1, 0.2, 0.3], [1.0]]) == pytest.approx((0.6 + 1.0) / 2)
    assert kl_control.kl_per_response([]) == 0.0
