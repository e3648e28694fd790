"""Fixtures of the ppo tests (helpers live in ppo_helpers.py)."""

import pytest

from ppo_helpers import build_rows


@pytest.fixture(scope="session")
def rows16(sft_policy):
    """16 rollout-like rows scored by the SFT policy: half reference solutions, half corrupted ones."""
    return build_rows(sft_policy, 16)
