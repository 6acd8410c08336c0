"""A reward served over HTTP (`algo.verifier=http://...`, reward/http_verifier.py), against a
real server this module starts on 127.0.0.1 at a free port: batches, concurrency, the
version, every failure counted (HTTP 500, a hang past the timeout, a bad reply, a refused
request, a server gone), retries, slime's --rm-url protocol, the preflight's refusals, and a
training run whose reward server has an outage (counted, not fatal).
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dapo_mega.config import AlgoConfig, ConfigError
from dapo_mega.reward import HttpVerifier, build_verifier, check_verifier, compute_rewards, score_responses
from dapo_mega.reward.types import VerifyResult

HANG_LIMIT_S = 30.0  # a hanging handler is released by the fixture's teardown, or after this


class RewardServer:
    """A reward server with switchable faults. Grades a response +1 when it ends with the
    ground truth, else -1; answers GET /version unless `has_version` is off."""

    def __init__(self):
        self.version, self.max_batch_size, self.max_concurrency = "judge-1", 4, 2
        self.mode = "ok"  # ok | fail (500) | hang | strings | short | refuse (400)
        self.fail_posts = set()  # POST numbers (1-based) answered with 500 whatever the mode
        self.reply_version = None  # the "version" a POST reply states (None: none)
        self.has_version = True
        self.pair = False  # the first two POSTs wait for each other (proves two in flight)
        self.posts, self.in_flight, self.max_in_flight = [], 0, 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.barrier = threading.Barrier(2, timeout=HANG_LIMIT_S)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path="/score", scheme="http"):
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def grade(self, response, truth):
        right = response.strip().endswith(truth)
        return {"score": 1.0 if right else -1.0, "acc": right, "pred": response.strip()[-2:]}

    def answer(self, number, payload):
        """(status, reply) of POST number `number`."""
        if number in self.fail_posts or self.mode == "fail":
            return 500, {"error": "overloaded"}
        if self.mode == "refuse":
            return 400, {"error": "bad request"}
        if self.mode == "hang":
            self.release.wait(HANG_LIMIT_S)
            return 500, {"error": "released"}
        if self.pair and number <= 2:
            self.barrier.wait()
        if "label" in payload:  # slime's --rm-url protocol: the reward itself
            return 200, 1.0 if payload["response"].strip().endswith(payload["label"]) else -1.0
        scores = [self.grade(r, t) for r, t in zip(payload["responses"], payload["ground_truths"])]
        if self.mode == "strings":
            scores = ["yes"] * len(scores)
        if self.mode == "short":
            scores = scores[:-1]
        reply = {"scores": scores}
        if self.reply_version is not None:
            reply["version"] = self.reply_version
        return 200, reply

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != "/version" or not server.has_version:
                    return self.reply(404, {"error": "not found"})
                self.reply(200, {"version": server.version, "max_batch_size": server.max_batch_size,
                                 "max_concurrency": server.max_concurrency})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.posts.append(payload)
                    number = len(server.posts)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, body = server.answer(number, payload)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                headers = [] if server.has_version else [("X-Reward-Version", "rm-7")]
                self.reply(status, body, headers)

        return Handler


@pytest.fixture
def server():
    srv = RewardServer()
    srv.thread.start()
    yield srv
    srv.release.set()
    srv.httpd.shutdown()
    srv.httpd.server_close()


def _score(verifier, n, timeout_s=5.0, truth="7"):
    responses = [f"Answer: {7 if i % 3 else 8}" for i in range(n)]
    metadata = [{"id": f"p{i}", "data_source": "t", "prompt": "3+4?"} for i in range(n)]
    return score_responses(verifier, responses, [truth] * n, timeout_s=timeout_s, metadata=metadata)


def test_batched_concurrent_versioned_and_given_the_metadata(server):
    server.pair = True
    verifier = build_verifier(server.url())
    assert isinstance(verifier, HttpVerifier) and (verifier.batch_size, verifier.concurrency) == (4, 2)
    assert verifier.version == f"{server.url()}-judge-1"
    AlgoConfig(verifier=server.url()).validate()
    results, stats = _score(verifier, 10)
    assert [r.correct for r in results] == [i % 3 != 0 for i in range(10)]  # in input order
    assert [r.reward for r in results] == [1.0 if i % 3 else -1.0 for i in range(10)]
    assert results[1].extracted == " 7"[-2:] and results[0].extracted == " 8"
    assert sorted(len(p["responses"]) for p in server.posts) == [2, 4, 4]
    assert server.max_in_flight == 2  # the first two waited for each other: never more than the server's limit
    assert sorted(m["id"] for p in server.posts for m in p["metadata"]) == sorted(f"p{i}" for i in range(10))
    assert (stats.num_responses, stats.num_errors, stats.num_retries, stats.num_in_pool) == (10, 0, 0, 0)


@pytest.mark.parametrize("mode, counter, message, retried", [
    ("fail", "num_exceptions", r"^verifier_error: reward server \S+: HTTP 500: .*overloaded.* \(3 attempts\)$", True),
    ("hang", "num_timeouts", r"^verifier_error: reward server \S+: timeout after 0.5s \(3 attempts\)$", True),
    ("refuse", "num_exceptions", r"HTTP 400: .* \(not retried: the request itself was refused\)$", False),
    ("short", "num_exceptions", r"reply has (3 scores for 4|1 scores for 2) responses$", False),
    ("strings", "num_exceptions", r"^verifier_error: TypeError: reward server \S+ returned str 'yes'; accepted", False),
])
def test_every_failure_is_a_counted_verifier_error_never_raised(server, mode, counter, message, retried):
    verifier = build_verifier(server.url())
    server.mode = mode
    results, stats = _score(verifier, 6, timeout_s=0.5)
    assert all(r.error is not None and r.reward == -1.0 and not r.correct for r in results)
    assert all(re.search(message, r.error) for r in results), results[0].error
    assert getattr(stats, counter) == stats.num_errors == 6
    assert stats.num_retries == (2 * 2 if retried else 0)  # two batches, two retries each
    server.mode = "ok"  # the server is back: the next call scores
    results, stats = _score(verifier, 6)
    assert stats.num_errors == 0 and [r.correct for r in results] == [i % 3 != 0 for i in range(6)]


def test_a_failed_attempt_is_retried_and_a_server_gone_is_counted(server):
    verifier = build_verifier(server.url())
    server.max_batch_size = 100
    server.fail_posts = {1}
    results, stats = _score(verifier, 3)
    assert stats.num_retries == 1 and stats.num_errors == 0 and len(server.posts) == 2
    server.httpd.shutdown()
    server.httpd.server_close()  # the port refuses connections now
    results, stats = _score(verifier, 3)
    assert stats.num_exceptions == stats.num_errors == 3 and stats.num_retries == 2
    assert "ClientConnectorError" in results[0].error


def test_the_version_a_reply_states_is_the_one_stamped_on_its_rows(server):
    verifier = build_verifier(server.url())
    server.reply_version = "judge-2"
    algo = AlgoConfig(verifier=server.url(), max_response_length=64, overlong_buffer_length=16)
    batch = compute_rewards(verifier, ["Answer: 7", "Answer: 8"], ["7", "7"], [3, 3], algo,
                            metadata=[{"id": "a"}, {"id": "b"}])
    assert {s.verifier_version for s in batch.items()} == {f"{server.url()}-judge-2"}
    assert {s.verifier for s in batch.items()} == {server.url()}
    assert [s.correctness for s in batch.items()] == [1.0, -1.0] and batch.stats.num_errors == 0


def test_slimes_rm_url_protocol_one_request_per_response(server):
    server.has_version = False  # a slime reward server has no GET /version
    spec = server.url("/rm", scheme="slime+http")
    verifier = build_verifier(spec)
    assert verifier.version == f"{spec}-unversioned" and verifier.protocol == "slime"
    results, stats = _score(verifier, 3)
    assert [r.reward for r in results] == [-1.0, 1.0, 1.0] and stats.num_errors == 0
    assert sorted(server.posts, key=json.dumps) == [  # sent concurrently: in any order
        {"prompt": "3+4?", "response": f"Answer: {n}", "label": "7"} for n in (7, 7, 8)]
    assert verifier.version == f"{spec}-rm-7"  # the X-Reward-Version header of its replies


def test_the_preflight_refuses_a_server_it_cannot_use(server):
    dead = RewardServer()  # bound, never served, then closed: nothing listens on its port
    dead.httpd.server_close()
    with pytest.raises(ConfigError) as info:
        check_verifier(dead.url(), timeout_s=2.0)
    text = str(info.value)
    assert text.startswith(f"algo.verifier: reward server '{dead.url()}' did not answer GET "
                           f"http://127.0.0.1:{dead.port}/version (ClientConnectorError") and "Fix: start" in text
    server.has_version = False
    with pytest.raises(ConfigError, match=r"answered GET \S+/version with HTTP 404\. Fix: serve"):
        check_verifier(server.url(), timeout_s=2.0)
    server.has_version, server.mode = True, "strings"
    with pytest.raises(ConfigError) as info:
        check_verifier(server.url(), timeout_s=2.0)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"algo.verifier: reward server '{server.url()}' failed its probe call")
    assert "returned str 'yes'; accepted: a finite number" in text
    server.mode = "ok"
    assert check_verifier(server.url(), timeout_s=2.0).version == f"{server.url()}-judge-1"
    assert server.posts[-1]["ground_truths"] == ["7"]


def test_a_server_verifier_scores_one_response_like_a_batch(server):
    verifier = build_verifier(server.url())
    assert verifier.score("Answer: 7", "7", {}) == VerifyResult(correct=True, reward=1.0, extracted=" 7"[-2:])


@pytest.mark.slow
def test_training_graded_by_a_reward_server_through_its_outage(server, tmp_path):
    """`dapo-mega train` graded by the server; its first scoring request of the run fails on
    all three attempts (an outage): that round's responses are verifier errors, counted in
    step 1's metrics, and the run trains on to the end graded by the server again."""
    from helpers.training import RUN_NAME, run_train

    from dapo_mega.records.ledger import read_records

    server.max_batch_size = 64
    server.fail_posts = {2, 3, 4}  # POST 1 is the preflight's probe
    run_train(tmp_path, f"algo.verifier={server.url()}", "trainer.total_steps=2", "trainer.sft_warmup_steps=5",
              timeout_s=240)
    run_dir = tmp_path / RUN_NAME
    step1, step2 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if "verifier/num_errors" in json.loads(line)]
    assert step1["verifier/num_errors"] == step1["verifier/num_exceptions"] == step1["verifier/num_responses"] > 0
    assert step1["verifier/num_retries"] == 2 and step2["verifier/num_errors"] == 0
    rows = read_records(run_dir)
    failed = [r for r in rows if r.step == 1]
    assert failed and all("HTTP 500" in r.verifier_error and r.reward <= -1.0 and not r.correct for r in failed)
    assert step1["rollout/verifier_errors"] == sum(r.reject_reason == "verifier_error" for r in failed)
    graded = [r for r in rows if r.step == 2]
    assert graded and {r.verifier_version for r in rows} == {f"{server.url()}-judge-1"}
    for r in graded:
        assert r.verifier_error is None and r.correct == (json.loads(r.reward_components)["correctness"] == 1.0)
    scored = [len(p["responses"]) for p in server.posts[4:]]
    assert sum(scored) == len([r for r in rows if r.step == 2])  # every step-2 response went to the server
