"""calibration_labels=shared_prefix: the calibrated step credit fitted against the group's own shared-prefix labels
(Math-Shepherd's hard label, the group's right responses as a prefix's completions) instead of the outcomes, for
weak starts where right answers are rare (docs/process-rewards.md#2d, docs/experiments/6-sparse-outcomes.md).

Against the slow reference (labels and maps written out with lists), on weak-start batches of the benchmark's size
(tests/advantage/sparse_rollouts.py): silent for a PRM that reads only the answer or is random, moving credit inside
the groups with no right response for a PRM that ranks the steps well, balanced and bounded as the step credit is.
"""

import advantage_reference as ref
import numpy as np
import pytest
import sparse_rollouts
from test_advantage_stage import make_cfg, read_out, write_rows

from prmflow.components.advantage import stage
from prmflow.components.advantage.estimators import PROCESS_BOUND
from prmflow.components.advantage.progress import prefix_keys, shared_prefix_labels
from prmflow.errors import DataError

SHARED = {"estimator": "grpo_progress", "process_calibration": "isotonic", "calibration_labels": "shared_prefix"}


def _rows(prm, seed, **kw):
    rows = sparse_rollouts.chain_rows(np.random.default_rng(seed), prm, **kw)
    right = {(r["prompt_id"], r["sample_idx"]): r.pop("right_steps") for r in rows}
    return rows, right


def _run(d, rows, **options):
    d.mkdir(parents=True)
    write_rows(d, rows)
    summary = stage.run(make_cfg(d, **options))
    return {(r["prompt_id"], r["sample_idx"]): np.array(r["advantages"]) for r in read_out(d)}, summary


@pytest.mark.parametrize("seed", range(3))
def test_shared_prefix_labels_match_the_written_out_comparison(seed):
    rng = np.random.default_rng(seed)
    rows, _ = _rows("good", seed, n_prompts=6, n_samples=6)
    rows += ref.random_rollouts(rng, n_groups=3, max_size=4, equal_groups=0).to_pylist()  # ids shared by chance only
    groups = {g: i for i, g in enumerate(sorted({r["prompt_id"] for r in rows}))}
    group = np.array([groups[r["prompt_id"]] for r in rows])
    counts = np.array([len(r["step_ends"]) for r in rows])
    keys = prefix_keys([r["response_ids"] for r in rows], [r["step_ends"] for r in rows], group)
    labels, informative = shared_prefix_labels(keys, np.repeat(np.arange(len(rows)), counts),
                                               np.array([r["outcome_reward"] for r in rows]), group)
    want = ref.shared_prefix_labels(rows)
    flat = [x for r in rows for x in want[id(r)]]
    assert informative.tolist() == [x is not None for x in flat]
    assert labels[informative].tolist() == [x for x in flat if x is not None]
    assert 0 < labels[informative].mean() < 1  # both kinds occur: a wrong step of a failure, a right one


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("credit", ["step", "baseline"])
def test_the_stage_matches_the_slow_reference(tmp_path, seed, credit):
    rows, _ = _rows("good", seed, n_prompts=7, n_samples=5, p_wrong=(0.2, 0.4, 0.6))
    right = {r["prompt_id"] for r in rows if r["outcome_reward"] > 0}
    assert 0 < len(right) < 7  # groups with a right response (fitted on) and without (left out of the fit)
    write_rows(tmp_path, rows)
    summary = stage.run(make_cfg(tmp_path, **SHARED, process_credit=credit, batch_rows=5))  # groups cut across batches
    want, auc, _ = ref.grpo_progress(rows, 0.5, 0.0, 0.0, credit=credit, calibration="isotonic",
                                     calibration_labels="shared_prefix")
    got = {(r["iteration"], r["prompt_id"], r["sample_idx"]): r for r in read_out(tmp_path)}
    assert summary["advantage/prm_step_auc"] == pytest.approx(auc)
    for key, w_row in want.items():
        assert got[key]["advantages"] == pytest.approx(w_row["advantages"], abs=1e-4), key
        assert got[key]["token_rewards"] == pytest.approx(w_row["token_rewards"], abs=1e-5), key


@pytest.mark.parametrize("prm", ["answer-only", "random"])
def test_silent_for_a_prm_that_reads_only_the_answer_or_is_random(tmp_path, prm):
    # weak starts of the benchmark's size (32 prompts x 8, about 10 % right): the map is fitted on intermediate
    # prefixes only (the answer line never enters it) and read only where it beats a flat one on held-out prompts
    moved, mean_moved = [], []
    for seed in range(10):
        rows, _ = _rows(prm, seed)
        new, summary = _run(tmp_path / f"{seed}-new", rows, **SHARED)
        grpo, _ = _run(tmp_path / f"{seed}-grpo", rows, estimator="grpo")
        assert 0.4 < summary["advantage/prm_label_auc"] < 0.6  # what the stage sees: no step ranking
        dev = np.concatenate([np.abs(new[k] - grpo[k]) for k in grpo])
        moved.append(dev.max())
        mean_moved.append(dev.mean())
    if prm == "answer-only":
        assert max(moved) < 1e-6  # outcome-only GRPO's advantages, at every batch
    else:  # a noise map passes the one-standard-error rule at a fold now and then (1 batch in 20 of this shape, as
        # often as the outcome-fitted map), and moves little: mean |change| per token 7e-4 over 20 batches
        assert sum(m > 1e-6 for m in moved) <= 2 and np.mean(mean_moved) < 0.005


def test_moves_where_every_response_failed_for_a_prm_that_ranks_steps_well(tmp_path):
    # the weak start's case: in a group with no right response outcome-only GRPO's advantage is 0 on every token;
    # with the map fitted on the shared-prefix labels of the groups that have one, the PRM's ranking is read
    # there too: a failure's first wrong step is pushed down and the right steps before it up
    first_wrong, right_before, spreads = [], [], {}
    for seed in range(3):
        rows, right = _rows("good", seed)
        new, summary = _run(tmp_path / f"{seed}-new", rows, **SHARED)
        _, today = _run(tmp_path / f"{seed}-today", rows, estimator="grpo_progress", process_calibration="isotonic")
        spreads.setdefault("shared_prefix", []).append(summary["advantage/prm_calibrated_spread"])
        spreads.setdefault("outcome", []).append(today["advantage/prm_calibrated_spread"])
        assert summary["advantage/prm_label_auc"] > 0.8  # the run-time estimate of the PRM's step ranking
        assert 0.3 < summary["advantage/labelled_share"] < 0.8  # the groups with a right response
        failed = {r["prompt_id"] for r in rows} - {r["prompt_id"] for r in rows if r["outcome_reward"] > 0}
        for r in rows:
            key, ends = (r["prompt_id"], r["sample_idx"]), r["step_ends"]
            if r["prompt_id"] not in failed:
                continue
            j = right[key]  # the first wrong step
            start = ends[j - 1] + 1 if j else 0
            first_wrong.append(new[key][start:ends[j] + 1].mean())
            if j:
                right_before.append(new[key][:start].mean())
    assert np.mean(first_wrong) < -0.2 and np.mean(right_before) > 0.05
    assert min(spreads["shared_prefix"]) > 0.5 > max(spreads["outcome"])  # what the outcome map keeps of the ranking


@pytest.mark.parametrize("prm", sparse_rollouts.PRMS)
def test_balanced_and_bounded_as_the_step_credit(tmp_path, prm):
    # every response's tokens sum to its outcome advantage times its length (credit moves between its tokens
    # only), no token opposes the outcome advantage's sign, and no token's process credit exceeds
    # PROCESS_BOUND x |A_out| (x w where A_out = 0)
    rows, _ = _rows(prm, 7)
    new, _ = _run(tmp_path / "new", rows, **SHARED)
    grpo, _ = _run(tmp_path / "grpo", rows, estimator="grpo")
    for key, a in new.items():
        out = grpo[key][0]
        assert a.sum() == pytest.approx(out * len(a), abs=1e-4)
        assert (np.sign(a) * np.sign(out) >= 0).all() if out != 0 else True
        cap = PROCESS_BOUND * (abs(out) if out != 0 else 0.5)
        assert np.abs(a - out).max() <= cap + 1e-5


def test_a_row_whose_step_ends_and_scores_differ_is_named_before_any_label(tmp_path):
    # the labels pair each step's prefix with its score: a row with fewer step_ends than step_rewards (planted past
    # the writer's checks) is refused by name, not paired with the next row's steps
    rows, _ = _rows("good", 0, n_prompts=3, n_samples=4)
    rows[5] = {**rows[5], "step_ends": rows[5]["step_ends"][:-1]}
    write_rows(tmp_path, rows, validated=True)
    with pytest.raises(DataError, match=r"'step_rewards' and 'step_ends' differ in length in row 5 \(prompt_id='p1', "
                                        r"sample_idx=1\)"):
        stage.run(make_cfg(tmp_path, **SHARED))
    assert not (tmp_path / "advantages").exists()
