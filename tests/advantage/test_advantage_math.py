"""The advantage stage's vectorized kernels against slow per-row, per-token loops."""

import math
import statistics

import advantage_reference as ref
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prmflow.components.advantage.estimators import Moments, Ragged, discounted_reverse_cumsum, group_moments, \
    merge_group_moments, step_suffix_sums
from prmflow.components.advantage.token_rewards import (
    KL_ESTIMATORS, kl_per_token, make_steps, step_contributions, token_rewards,
)
from prmflow.components.advantage.scan import blocked_reverse_scan

lengths_st = st.lists(st.integers(0, 50), min_size=1, max_size=10)
discount_st = st.sampled_from([0.0, 0.5, 0.95, 0.99, 1.0]) | st.floats(0.0, 1.0)


def split(flat, lengths):
    return np.split(np.asarray(flat), np.cumsum(lengths)[:-1])


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, discount=discount_st, seed=st.integers(0, 2**32 - 1))
def test_discounted_reverse_cumsum_matches_loop(lengths, discount, seed):
    x = np.random.default_rng(seed).normal(0, 3, sum(lengths))
    got = discounted_reverse_cumsum(x, Ragged.from_lengths(lengths), discount)
    expected = [g for row in split(x, lengths) for g in ref.returns_to_go(list(row), discount)]
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(x, np.concatenate(split(x, lengths)))  # input untouched


@pytest.mark.parametrize("discount", [0.3, 0.9, 1.0])
def test_discounted_reverse_cumsum_long_rows_stay_accurate(discount):
    # discount**t underflows long before 3000 tokens: a closed form dividing by it would blow up
    lengths = [3000, 1, 2500, 0, 1800]
    x = np.random.default_rng(0).normal(0, 1, sum(lengths))
    got = discounted_reverse_cumsum(x, Ragged.from_lengths(lengths), discount)
    expected = [g for row in split(x, lengths) for g in ref.returns_to_go(list(row), discount)]
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 3) | st.integers(0, 60), min_size=1, max_size=120),
       block=st.sampled_from([2, 3, 4, 8]), discount=st.sampled_from([0.5, 0.95, 0.999, 1.0]) | st.floats(0.01, 1.0),
       seed=st.integers(0, 2**32 - 1))
def test_blocked_scan_matches_loop_across_block_edges(lengths, block, discount, seed):
    # small blocks, so that a few hundred tokens already take the blocked path two or three levels deep,
    # with rows that start inside a block, on its first token, several in one block, and empty rows
    x = np.random.default_rng(seed).normal(0, 3, sum(lengths))
    layout = Ragged.from_lengths(lengths)
    got = blocked_reverse_scan(x, layout.starts[1:], discount, block)
    expected = [g for row in split(x, lengths) for g in ref.returns_to_go(list(row), discount)]
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(x, np.concatenate(split(x, lengths)))  # input untouched


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**32 - 1))
def test_step_suffix_sums_match_a_per_token_loop(lengths, seed):
    """Token t gets the sum of the values of its row's steps that end at or after t: rows without steps,
    empty rows, steps at a row's last token, two steps at one token and steps out of order included."""
    rng = np.random.default_rng(seed)
    rows, ends = [], []
    for r, n in enumerate(lengths):
        for _ in range(rng.integers(0, 5) if n else 0):
            rows.append(r)
            ends.append(int(rng.integers(0, n)))
    layout = Ragged.from_lengths(lengths)
    row = np.asarray(rows, dtype=np.int64)
    token = layout.offsets[:-1][row] + np.asarray(ends, dtype=np.int64)
    a, b = rng.normal(0, 2, len(row)), rng.random(len(row))
    got_a, got_b = step_suffix_sums(token, row, layout, a, b)
    for got, v in ((got_a, a), (got_b, b)):
        expected = [sum(v[k] for k in range(len(row)) if row[k] == r and ends[k] >= t)
                    for r, n in enumerate(lengths) for t in range(n)]
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_group_moments_match_statistics(sizes, seed):
    rng = np.random.default_rng(seed)
    groups = [list(rng.choice([0.0, 1.0, 0.1], n)) if rng.random() < 0.5 else list(rng.normal(size=n)) for n in sizes]
    codes = np.concatenate([[g] * len(v) for g, v in enumerate(groups)]).astype(np.int64)
    values = np.concatenate([np.asarray(v, float) for v in groups])
    order = rng.permutation(len(values))  # group members need not be adjacent
    got = group_moments(codes[order], values[order], len(groups))
    for g, v in enumerate(groups):
        equal = len(set(v)) <= 1
        assert got["count"][g] == len(v)
        assert got["equal"][g] == equal
        assert got["sum"][g] == pytest.approx(sum(v), abs=1e-12)
        assert got["mean"][g] == pytest.approx(statistics.fmean(v) if v else 0.0, abs=1e-12)
        assert got["std"][g] == (0.0 if equal else pytest.approx(statistics.stdev(v), abs=1e-12))
        if equal and v:
            assert got["mean"][g] == v[0]  # exactly, so R - mean is exactly 0


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 8), min_size=1, max_size=6), n_parts=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_group_moments_merged_from_parts_equal_moments_of_everything(sizes, n_parts, seed):
    # how the group pass combines batches: each batch's share of a group, merged afterwards
    rng = np.random.default_rng(seed)
    codes = np.repeat(np.arange(len(sizes)), sizes)
    values = np.where(rng.random(len(codes)) < 0.3, 1.0, rng.normal(3, 1, len(codes)))
    order = rng.permutation(len(codes))
    codes, values = codes[order], values[order]
    cuts = np.sort(rng.integers(0, len(codes) + 1, n_parts - 1))
    part_codes, parts = [], []
    for c, v in zip(np.split(codes, cuts), np.split(values, cuts)):
        present, local = np.unique(c, return_inverse=True)  # a batch numbers its groups itself
        parts.append(group_moments(local, v, len(present)))
        part_codes.append(present)
    merged = merge_group_moments(np.concatenate(part_codes).astype(np.int64),
                                 {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, len(sizes))
    whole = group_moments(codes, values, len(sizes))
    for k in ("count", "sum", "mean", "std", "min", "max", "equal"):
        np.testing.assert_allclose(merged[k], whole[k], rtol=1e-12, atol=1e-12, err_msg=k)


def test_streaming_moments_match_numpy():
    rng = np.random.default_rng(0)
    parts = [rng.normal(5, 2, n) for n in (0, 1, 7, 1000, 3)]
    m = Moments()
    for p in parts:
        m.add(p)
    everything = np.concatenate(parts)
    assert (m.n, m.mean, m.std) == (len(everything), pytest.approx(everything.mean()), pytest.approx(everything.std()))


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=8), mode=st.sampled_from(["raw", "centered", "min"]),
       clip=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**32 - 1))
def test_step_contributions_match_reference(counts, mode, clip, seed):
    rng = np.random.default_rng(seed)
    values = rng.choice([0.25, 0.5, 0.9], sum(counts)) if rng.random() < 0.5 else rng.random(sum(counts))
    got = step_contributions(values, np.asarray(counts), mode, clip)
    expected = [s for row in split(values, counts) for s in ref.step_contribs(list(row), mode, clip)]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_estimators_match_definitions(name):
    rng = np.random.default_rng(0)
    old, refp = -rng.exponential(1, 500), -rng.exponential(1, 500)
    got = kl_per_token(old, refp, name)
    np.testing.assert_allclose(got, [ref.kl(o, r, name) for o, r in zip(old, refp)], rtol=1e-9, atol=1e-12)
    assert np.all(kl_per_token(old, old, name) == 0)
    if name != "k1":
        assert np.all(got >= 0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), beta=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 2**32 - 1))
def test_token_rewards_place_kl_steps_and_outcome(lengths, beta, seed):
    rng = np.random.default_rng(seed)
    layout = Ragged.from_lengths(lengths)
    rows = []
    for n in lengths:
        ends = sorted(rng.choice(n, int(rng.integers(0, n + 1)), replace=True).tolist())  # repeats add up
        rows.append({"response_ids": [0] * n, "old_logprobs": list(-rng.random(n)),
                     "ref_logprobs": list(-rng.random(n)), "step_ends": ends,
                     "step_rewards": list(rng.random(len(ends))), "outcome_reward": float(rng.normal())})
    counts = np.array([len(r["step_ends"]) for r in rows])
    flat = lambda key: np.concatenate([np.asarray(r[key], float) for r in rows])  # noqa: E731
    steps = make_steps(layout, flat("step_ends").astype(np.int64), counts, flat("step_rewards"))
    kl = kl_per_token(flat("old_logprobs"), flat("ref_logprobs"), "k2")
    got = token_rewards(layout, kl, beta, steps, np.array([r["outcome_reward"] for r in rows]))
    expected = [x for r in rows for x in ref.token_rewards(r, beta, "k2", True, True, "raw", 0.0)]
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


def test_k3_is_accurate_near_zero():
    x = np.array([1e-9, -1e-9, 1e-5])
    assert np.allclose(KL_ESTIMATORS["k3"](x), x * x / 2, rtol=1e-5)  # exp(-x) - 1 + x = x^2/2 + O(x^3)
    assert math.isclose(float(KL_ESTIMATORS["k3"](np.array([2.0]))[0]), math.exp(-2) - 1 + 2)
