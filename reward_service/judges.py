"""LLM judges: a reward from a model's verdict, asked over the OpenAI-compatible HTTP API.

A judge (``reward.judges``) is any OpenAI-compatible endpoint: a second SplitRL sampler
deployment serving the judge model (``sampler.http_port``, docs/sampler.md), vLLM, SGLang or a
hosted API. A ``reward.functions`` entry of the judge's name scores with it: each completion's
``prompt_template`` (``{prompt}``, ``{completion}``, ``{reference}``) is sent as one user turn
(``api: chat``) or as the prompt (``api: completions``), and ``verdict_pattern``'s first group
in the reply is the verdict: a score from ``verdict_scores``, or the group read as a number.

Judges run in the server process, on one event loop for all of them, not in the scoring
workers: the calls are network waits, so one thread keeps many in flight, and the cache and
the concurrency limit hold for every request the replica serves.

- **Concurrency**: at most ``max_concurrency`` calls in flight per judge (per replica).
- **Time-outs and retries**: each call has ``request_timeout_s``; a call that fails for a
  reason that may pass (connection refused or reset, time-out, HTTP 408/429/5xx) is retried up
  to ``max_retries`` times with exponential back-off, and only if it is idempotent (greedy, or
  seeded): asking again gives the same verdict.
- **Cache**: identical requests (same rendered messages and sampling) share one call, in flight
  or done (the last ``cache_size`` answers are kept).
- **Outage**: a call still failing after its retries is an *outage*, not a score: the
  completions it was for get the status ``unavailable``, and the server answers the whole Score
  request UNAVAILABLE. The sampler then reports the reward service unavailable (cause
  REWARD_UNAVAILABLE), the trainer pauses dispatching with back-off and re-queues the prompts
  (docs/rewards.md): nothing is lost, no sampler blamed. A refusal that asking again cannot fix
  (HTTP 400/401/404: a wrong model name, a wrong key) is an error score instead, which the
  trainer's error policy stops the run on.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from prometheus_client import Counter, Histogram

from reward_service.pool import UNAVAILABLE, Outcome
from splitrl.config import RewardJudgeConfig
from splitrl.reward_protocol import ERROR_PREFIX

log = logging.getLogger(__name__)

RETRY_HTTP = frozenset({408, 429, 500, 502, 503, 504})
NO_VERDICT = "judge gave no verdict"

CALLS = Counter("splitrl_reward_judge_calls_total", "Judge calls by outcome",
                ["judge", "outcome"])  # ok, retried, unavailable, refused, cached
CALL_SECONDS = Histogram("splitrl_reward_judge_call_seconds", "Time of one judge call",
                         ["judge"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


class JudgeUnavailable(Exception):
    """The judge could not answer (after retries): an outage, not a verdict."""


class JudgeRefused(Exception):
    """The judge answered with an error that asking again cannot fix (HTTP 4xx)."""


def parse_verdict(text: str, pattern: re.Pattern, scores: dict[str, float]
                  ) -> float | None:
    """The score of the first verdict ``pattern`` finds in ``text`` (its first group, or the
    whole match): looked up in ``scores`` when given, else read as a number; None if none."""
    match = pattern.search(text)
    if match is None:
        return None
    verdict = (match.group(1) if pattern.groups else match.group(0)).strip()
    if scores:
        return scores.get(verdict)
    try:
        return float(verdict)
    except ValueError:
        return None


def render(template: str, item: dict[str, Any]) -> str:
    """The judge's prompt for one item: ``template`` with ``{prompt}``, ``{completion}`` and
    ``{reference}`` filled in (``{{`` and ``}}`` are literal braces)."""
    return template.format(prompt=item["prompt"], completion=item["completion"],
                           reference=item["reference"])


class Judge:
    """One configured judge: its HTTP session, cache and concurrency limit, on ``loop``."""

    def __init__(self, cfg: RewardJudgeConfig, loop: asyncio.AbstractEventLoop):
        self.cfg = cfg
        self.name = cfg.name
        self.description = f"judge {cfg.model} at {cfg.base_url}"
        self.pattern = re.compile(cfg.verdict_pattern)
        self.loop = loop
        self.idempotent = cfg.temperature == 0 or cfg.seed is not None
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and not key:
            raise ValueError(f"judge {cfg.name!r}: api_key_env {cfg.api_key_env!r} is not set")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = cfg.base_url.rstrip("/") + (
            "/chat/completions" if cfg.api == "chat" else "/completions")
        self._cache: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()
        self._limit: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ callers (any thread)

    def score(self, items: Sequence[dict[str, Any]],
              cancelled: Callable[[], bool] | None = None) -> list[Outcome]:
        """One outcome per item payload; blocks the calling thread, not the loop."""
        future = asyncio.run_coroutine_threadsafe(self._score_all(items), self.loop)
        while True:
            try:
                return future.result(timeout=0.2)
            except TimeoutError:
                if cancelled is not None and cancelled():
                    future.cancel()
                    return [Outcome(0.0, "cancelled", "cancelled")] * len(items)

    def close(self) -> None:
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self.loop).result(5)

    # ------------------------------------------------------------------ on the loop

    async def _score_all(self, items: Sequence[dict[str, Any]]) -> list[Outcome]:
        if self._session is None:
            self._limit = asyncio.Semaphore(self.cfg.max_concurrency)
            self._session = aiohttp.ClientSession(headers=self.headers)
        return list(await asyncio.gather(*(self._score_one(item) for item in items)))

    async def _score_one(self, item: dict[str, Any]) -> Outcome:
        start = time.perf_counter()
        try:
            text = await self._ask(self._body(render(self.cfg.prompt_template, item)))
        except JudgeUnavailable as e:
            return Outcome(0.0, f"{UNAVAILABLE}: judge {self.name!r}: {e}", UNAVAILABLE,
                           time.perf_counter() - start)
        except JudgeRefused as e:
            return Outcome(0.0, f"{ERROR_PREFIX}judge {self.name!r}: {e}", "error",
                           time.perf_counter() - start)
        score = parse_verdict(text, self.pattern, self.cfg.verdict_scores)
        seconds = time.perf_counter() - start
        if score is None:
            if self.cfg.no_verdict_score is None:
                return Outcome(0.0, f"{ERROR_PREFIX}{NO_VERDICT}", "error", seconds)
            return Outcome(self.cfg.no_verdict_score, NO_VERDICT, "ok", seconds)
        return Outcome(score, "", "ok", seconds)

    def _body(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model, "temperature": self.cfg.temperature,
                                "max_tokens": self.cfg.max_tokens}
        if self.cfg.seed is not None:
            body["seed"] = self.cfg.seed
        if self.cfg.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def _ask(self, body: dict[str, Any]) -> str:
        """The judge's reply text; identical requests share one call (cached)."""
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None and not (cached.done() and cached.exception() is not None):
            self._cache.move_to_end(key)
            CALLS.labels(self.name, "cached").inc()
            return await asyncio.shield(cached)
        future = asyncio.ensure_future(self._call(body))
        self._cache[key] = future
        while len(self._cache) > self.cfg.cache_size:
            self._cache.popitem(last=False)
        return await asyncio.shield(future)

    async def _call(self, body: dict[str, Any]) -> str:
        assert self._session is not None and self._limit is not None
        attempts = 1 + (self.cfg.max_retries if self.idempotent else 0)
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        last = ""
        for attempt in range(attempts):
            if attempt:
                CALLS.labels(self.name, "retried").inc()
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
            start = time.perf_counter()
            try:
                async with self._limit, self._session.post(self.url, json=body,
                                                           timeout=timeout) as reply:
                    payload = await reply.json(content_type=None)
                    status = reply.status
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            finally:
                CALL_SECONDS.labels(self.name).observe(time.perf_counter() - start)
            if status == 200:
                CALLS.labels(self.name, "ok").inc()
                return _reply_text(payload, self.cfg.api)
            error = payload.get("error") if isinstance(payload, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            last = f"HTTP {status} ({code or 'no code'})"
            if status not in RETRY_HTTP:
                CALLS.labels(self.name, "refused").inc()
                raise JudgeRefused(f"{self.url} answered {last}")
        CALLS.labels(self.name, UNAVAILABLE).inc()
        raise JudgeUnavailable(f"{self.url} did not answer after {attempts} attempt(s): {last}")


def _reply_text(payload: Any, api: str) -> str:
    try:
        choice = payload["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise JudgeRefused("the reply has no choices[0] text") from None
    return text or ""


class JudgeLoop:
    """The event loop every judge of a process runs on (a daemon thread)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reward-judges",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
