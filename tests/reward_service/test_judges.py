"""LLM judges: verdict parsing, the cache, the concurrency limit, retries and outages.

The judge endpoint here is a scripted OpenAI-compatible server on 127.0.0.1 (aiohttp, in the
test process) that answers what each test tells it to, counts calls and can fail on purpose;
a real SplitRL sampler as the judge is tests/e2e/test_judge_run.py.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import grpc
import pytest
from aiohttp import web

from reward_service.judges import parse_verdict
from reward_service.scoring import Item, RewardScorer
from reward_service.server import serve
from splitrl.config import Config, RewardConfig
from splitrl.v1 import reward_pb2, reward_pb2_grpc


class ScriptedEndpoint:
    """``/v1/chat/completions`` answering ``verdict(prompt)``; ``fail`` holds HTTP statuses to
    answer with first, ``delay_s`` slows each answer; counts calls and the most in flight."""

    def __init__(self):
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.fail: list[int] = []
        self.delay_s = 0.0
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self.chat)])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def chat(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            body = await request.json()
            self.bodies.append(body)
            await asyncio.sleep(self.delay_s)
            if self.fail:
                status = self.fail.pop(0)
                return web.json_response({"error": {"code": "UNAVAILABLE"}}, status=status)
            prompt = body["messages"][0]["content"]
            verdict = "YES" if "right" in prompt else "I think NO" if "wrong" in prompt else "?"
            return web.json_response({"choices": [{"message": {"content": verdict}}]})
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def endpoint():
    e = ScriptedEndpoint()
    yield e
    e.close()


def _scorer(base_url: str, **judge) -> RewardScorer:
    cfg = RewardConfig.model_validate({
        "functions": [{"name": "judge", "weight": 1.0}],
        "judges": [{"name": "judge", "base_url": base_url, "model": "m",
                    "prompt_template": "{completion}", "retry_backoff_s": 0.01, **judge}]})
    return RewardScorer(cfg)


def _items(*completions: str) -> list[Item]:
    return [Item(prompt="q", completion=c, reference="a") for c in completions]


def _calls(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("splitrl_reward_judge_calls_total",
                                     {"judge": "judge", "outcome": outcome}) or 0.0


def test_parse_verdict():
    yes_no = re.compile(r"\b(YES|NO)\b")
    assert parse_verdict("I think NO.", yes_no, {"YES": 1.0, "NO": 0.0}) == 0.0
    assert parse_verdict("YES", yes_no, {"YES": 1.0, "NO": 0.0}) == 1.0
    assert parse_verdict("maybe", yes_no, {"YES": 1.0}) is None
    assert parse_verdict("score: 7/10", re.compile(r"score: (\d+)"), {}) == 7.0
    assert parse_verdict("score: x", re.compile(r"score: (\w+)"), {}) is None


def test_verdicts_become_scores_and_identical_requests_share_one_call(endpoint):
    scorer = _scorer(endpoint.base_url)
    try:
        results = scorer.score(_items("right", "wrong", "right", "huh"))
        assert [r.scores["judge"] for r in results] == [1.0, 0.0, 1.0, 0.0]
        assert results[3].reasons["judge"] == "judge gave no verdict"
        assert results[3].statuses["judge"] == "ok"
        assert endpoint.calls == 3  # the two "right" items asked once
        cached = _calls("cached")
        scorer.score(_items("wrong"))
        assert endpoint.calls == 3  # answered from the cache
        assert _calls("cached") == cached + 1  # and counted so (per-judge metrics)
        body = endpoint.bodies[0]
        assert (body["model"], body["temperature"], body["seed"]) == ("m", 0.0, 0)
    finally:
        scorer.close()


def test_at_most_max_concurrency_calls_are_in_flight(endpoint):
    endpoint.delay_s = 0.2
    scorer = _scorer(endpoint.base_url, max_concurrency=2)
    try:
        results = scorer.score(_items(*[f"right {i}" for i in range(6)]))
        assert [r.scores["judge"] for r in results] == [1.0] * 6
        assert endpoint.most_in_flight == 2
    finally:
        scorer.close()


def test_a_failing_call_is_retried_then_answers(endpoint):
    endpoint.fail = [503, 429]
    scorer = _scorer(endpoint.base_url, max_retries=2)
    try:
        (result,) = scorer.score(_items("right"))
        assert (result.scores["judge"], result.statuses["judge"]) == (1.0, "ok")
        assert endpoint.calls == 3
    finally:
        scorer.close()


def test_a_refusal_is_an_error_score_without_retries(endpoint):
    endpoint.fail = [404]
    scorer = _scorer(endpoint.base_url, max_retries=3)
    try:
        (result,) = scorer.score(_items("right"))
        assert result.statuses["judge"] == "error" and "HTTP 404" in result.reasons["judge"]
        assert endpoint.calls == 1
    finally:
        scorer.close()


def test_a_non_idempotent_call_is_not_retried(endpoint):
    endpoint.fail = [503]
    scorer = _scorer(endpoint.base_url, temperature=1.0, seed=None, max_retries=3)
    try:
        (result,) = scorer.score(_items("right"))
        assert result.statuses["judge"] == "unavailable"
        assert endpoint.calls == 1
    finally:
        scorer.close()


def test_a_judge_outage_makes_score_unavailable_and_recovers(endpoint, tmp_path):
    """Through the gRPC server: a judge down past its retries is UNAVAILABLE (what the sampler
    turns into REWARD_UNAVAILABLE, and the trainer into a back-off), never zero scores; once
    the judge is back, the same request scores."""
    config = Config.model_validate({"reward": {
        "functions": [{"name": "judge"}], "workers": 1,
        "judges": [{"name": "judge", "base_url": endpoint.base_url, "model": "m",
                    "prompt_template": "{completion}", "max_retries": 1,
                    "retry_backoff_s": 0.01}]}})
    server, scorer = serve(config, address="127.0.0.1:0")
    try:
        # A channel without make_channel's retry policy, to see the first call's status.
        stub = reward_pb2_grpc.RewardStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(
            item_id="a", prompt="q", completion="right")])
        endpoint.fail = [503, 503]
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert endpoint.calls == 2
        reply = stub.Score(request, timeout=30)  # the failure was not cached
        assert reply.scores[0].scores["judge"] == 1.0
    finally:
        server.stop(0)
        scorer.close()


def test_a_judge_that_never_answers_times_out_as_an_outage(endpoint):
    endpoint.delay_s = 5.0
    scorer = _scorer(endpoint.base_url, request_timeout_s=0.2, max_retries=1)
    try:
        start = time.monotonic()
        (result,) = scorer.score(_items("right"))
        assert result.statuses["judge"] == "unavailable"
        assert "TimeoutError" in result.reasons["judge"]
        assert time.monotonic() - start < 3
    finally:
        scorer.close()
