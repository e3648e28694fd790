"""Reward recipes: verifiers, a real HTTP reward server, user functions, weighted sums, failures."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prmflow.errors import ConfigError
from prmflow.tasks import arithmetic
from prmflow.components.rollout import reward_components, outcome_rewards as rewards
from prmflow.components.rollout.reward_components import RewardError, RewardInput


def item(response, answer="12", source="arithmetic", pid="p0", k=0, prompt="Compute left to right: 7+5\n"):
    return RewardInput(pid, k, prompt, response, answer, source)


@pytest.mark.parametrize("response,answer,want", [
    (r"so the result is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}.", "3/4", 1.0),
    (r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    ("$-5$ is it\nanswer: $-5$", "-5", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\left( 1,2 \right)}", "(1,2)", 1.0),
    (r"\boxed{x + 1}", "x+1", 1.0),
    ("7+5=12\nanswer: 12", "12", 1.0),
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
    ("the total is 3.50 dollars", "3.5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{13}", "12", 0.0),
    ("no number here", "12", 0.0),
])
def test_math_verifier(response, answer, want):
    (score,) = reward_components.math_verifier()([item(response, answer, source="dataset")])
    assert score == want


def test_arithmetic_component_agrees_with_the_task_verifier():
    responses = ["7+5=12\nanswer: 12", "7+5=13\nanswer: 13", "7+5=12", "answer: 12\n"]
    got = reward_components.arithmetic_verifier()([item(r) for r in responses])
    assert got == [arithmetic.verify(r, "12") for r in responses] == [1.0, 0.0, 0.0, 1.0]


def test_recipe_is_a_weighted_sum_chosen_by_source(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(response):\n    return -len(response) / 100\n"
        "def echo(**kw):\n    return float(kw['prompt_id'] == 'b')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipes = rewards.build_recipes([
        {"source": "arithmetic", "component": "arithmetic", "weight": 2.0},
        {"source": "arithmetic", "component": "function", "function": "my_rewards:brevity", "weight": 0.5, "name": "short"},
        {"source": "default", "component": "math"},
        {"source": "default", "component": "function", "function": "my_rewards:echo", "name": "echo", "weight": -1.0},
    ])
    items = [item("7+5=12\nanswer: 12", pid="a"), item(r"\boxed{12}", source="gsm8k", pid="b")]
    scored = rewards.score_items(recipes, items)
    brevity = -len(items[0].response) / 100
    assert scored.components[0] == {"arithmetic": 1.0, "short": pytest.approx(brevity)}
    assert scored.outcome[0] == pytest.approx(2.0 * 1.0 + 0.5 * brevity)
    assert scored.components[1] == {"math": 1.0, "echo": 1.0}
    assert scored.outcome[1] == pytest.approx(0.0)
    assert scored.correct == [1.0, 1.0]


def test_a_source_without_recipe_is_a_config_error():
    recipes = rewards.build_recipes([{"source": "arithmetic", "component": "arithmetic"}])
    with pytest.raises(ConfigError, match="gsm8k"):
        rewards.score_items(recipes, [item("x", source="gsm8k")])


@pytest.mark.parametrize("table,match", [
    ([{"source": "a", "component": "nope"}], "unknown reward component"),
    ([{"source": "a", "weight": 1.0}], "'component'"),
    ([{"source": "a", "component": "math", "weight": "x"}], "weight"),
    ([{"source": "a", "component": "math"}, {"source": "a", "component": "math"}], "distinct 'name'"),
    ([{"source": "a", "component": "function", "function": "no_such_module_xyz:f"}], "cannot import"),
    ([{"source": "a", "component": "http"}], "url"),
    ([], "non-empty"),
])
def test_bad_recipes_are_config_errors(table, match):
    with pytest.raises(ConfigError, match=match):
        rewards.build_recipes(table)


def test_config_check_does_not_import_user_functions():
    table = [{"source": "a", "component": "function", "function": "module_only_in_the_image:f"}]
    rewards.build_recipes(table, import_functions=False)  # the pipeline compiles without the module
    with pytest.raises(ConfigError, match="cannot import"):
        rewards.build_recipes(table)
    with pytest.raises(ConfigError, match="package.module:function"):
        rewards.build_recipes([{"source": "a", "component": "function", "function": "no_colon"}], import_functions=False)


def test_recipe_table_from_command_line_yaml():
    table = rewards.parse_table("[{source: arithmetic, component: arithmetic, weight: 0.5}]")
    assert table == [{"source": "arithmetic", "component": "arithmetic", "weight": 0.5}]


@pytest.mark.parametrize("module,body,match", [("raises", "raise ValueError('bad row')", "raised ValueError: bad row"),
                                               ("nan", "return float('nan')", "returned nan"),
                                               ("inf", "return float('inf')", "returned inf")])
def test_a_failing_user_function_names_the_row(tmp_path, monkeypatch, module, body, match):
    (tmp_path / f"bad_rewards_{module}.py").write_text(
        f"def f(response, prompt_id):\n    if prompt_id == 'second':\n        {body}\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipes = rewards.build_recipes([{"source": "arithmetic", "component": "function", "function": f"bad_rewards_{module}:f"}])
    with pytest.raises(RewardError, match=match) as err:
        rewards.score_items(recipes, [item("a", pid="first"), item("b", pid="second", k=3)])
    assert "prompt_id='second'" in str(err.value) and "sample_idx=3" in str(err.value)


# --- a real HTTP reward server on 127.0.0.1 -------------------------------------------------------

class RewardServer:
    """Scores a response by its length; can fail the first requests, answer slowly, or (`hold`) answer
    only once the test releases it (`release`) or after 20 s."""

    def __init__(self, fail_first=0, delay_s=0.0, status=503, reply=None, hold=False):
        self.requests, self.fail_first, self.delay_s, self.status, self.reply = [], fail_first, delay_s, status, reply
        self.release = threading.Event()
        self.hold = hold
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if len(server.requests) <= server.fail_first:
                    self.send_response(server.status)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                time.sleep(server.delay_s)
                if server.hold:
                    server.release.wait(20)
                payload = server.reply if server.reply is not None else {"rewards": [len(r) / 10 for r in body["responses"]]}
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def http_recipe(url, **kw):
    return rewards.build_recipes([{"source": "arithmetic", "component": "http", "name": "rm", "url": url, **kw}])


def test_http_reward_model_batches_and_retries():
    items = [item("x" * k, pid=f"p{k}") for k in range(1, 6)]
    with RewardServer(fail_first=2) as srv:
        scored = rewards.score_items(http_recipe(srv.url, batch_size=2, retries=3, backoff_s=0.01), items)
    assert [c["rm"] for c in scored.components] == pytest.approx([k / 10 for k in range(1, 6)])
    assert scored.outcome == pytest.approx([k / 10 for k in range(1, 6)])
    assert [len(r["responses"]) for r in srv.requests] == [2, 2, 2, 2, 1]  # 2 refused, then 3 batches
    assert srv.requests[-1]["prompt_ids"] == ["p5"] and srv.requests[-1]["answers"] == ["12"]


def test_http_reward_model_times_out_with_a_clear_error():
    """The server holds every request until the test releases it: only the client's own timeout can end
    the call (one that ignored timeout_s would get an answer after 20 s, and no error)."""
    with RewardServer(hold=True) as srv:
        with pytest.raises(RewardError, match=r"failed 2 time\(s\) \(timeout 0.2s\); last error: .*timed out"):
            rewards.score_items(http_recipe(srv.url, timeout_s=0.2, retries=1, backoff_s=0.01), [item("x")])
        assert not srv.release.is_set() and len(srv.requests) == 2  # both attempts gave up while held


def test_http_client_errors_are_not_retried():
    with RewardServer(fail_first=5, status=400) as srv:
        with pytest.raises(RewardError, match="HTTP 400"):
            rewards.score_items(http_recipe(srv.url, retries=3, backoff_s=0.01), [item("x")])
    assert len(srv.requests) == 1


@pytest.mark.parametrize("reply,match", [({"rewards": [1.0, 2.0]}, "expected"), ({"rewards": [None]}, "returned nan"),
                                         ({"score": 1}, "expected")])
def test_http_bad_replies(reply, match):
    with RewardServer(reply=reply) as srv:
        with pytest.raises(RewardError, match=match):
            rewards.score_items(http_recipe(srv.url, retries=0), [item("x")])


def test_no_nan_slips_through_a_weighted_sum():
    recipes = rewards.build_recipes([{"source": "arithmetic", "component": "arithmetic", "weight": 0.0}])
    scored = rewards.score_items(recipes, [item("answer: 12")])
    assert scored.outcome == [0.0] and all(math.isfinite(v) for c in scored.components for v in c.values())
