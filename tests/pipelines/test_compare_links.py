"""The MLflow UI links prmflow prints for comparing runs (opened in a browser: tests/evaluate/test_mlflow_ui_browser.py)."""

import json
from urllib.parse import parse_qs, urlsplit

from prmflow.pipelines.summary import compare_url


def test_compare_url_is_mlflows_own_compare_route_in_the_training_view():
    """MLflow 3.17 builds `#/compare-runs?runs=<JSON list>&experiments=<JSON list>` (Routes.
    getCompareRunPageRoute); the link carries the same, percent-encoded so a terminal keeps it one
    clickable word, plus workflowType=machine_learning (else the UI opens in its GenAI view)."""
    url = compare_url("http://127.0.0.1:5000", ["7", "7", "3"], ["r2", "r0", "r1"])
    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}{parts.path}" == "http://127.0.0.1:5000/"
    route, _, query = parts.fragment.partition("?")
    assert route == "/compare-runs"
    q = parse_qs(query, strict_parsing=True)
    assert json.loads(q["runs"][0]) == ["r2", "r0", "r1"]  # the order given: iteration order
    assert json.loads(q["experiments"][0]) == ["3", "7"]
    assert q["workflowType"] == ["machine_learning"]
    assert not set('"[] ') & set(url)  # nothing a terminal would cut the link at


def test_the_closing_table_prints_a_kl_of_float_noise_below_zero_as_zero():
    """The first RL iteration's KL to the SFT policy is the policy's KL to itself: float noise either side
    of 0 (the sampler's log-probs against a fresh forward). The table prints it as the quickstart's README
    shows it, 0.000, never -0.000; a value that is really below zero still shows its sign."""
    from prmflow.pipelines.summary import Row, format_table

    table = format_table([Row("iter 0", {"reward": 0.475, "accuracy": 0.475, "kl": -2.4e-7}),
                          Row("iter 1", {"kl": -0.0123})])
    first, second = table.splitlines()[1:]
    assert first.split()[2:] == ["-", "0.475", "0.475", "0.000"], table
    assert second.split()[-1] == "-0.012", table
