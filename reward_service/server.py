"""The reward service's gRPC server: ``Score`` (batched) and ``ListRewardFunctions``.

Requests are checked before any work starts, with a status that names the field:
RESOURCE_EXHAUSTED when ``items`` exceeds ``reward.max_items_per_request`` or the request exceeds
``reward.max_request_bytes``; INVALID_ARGUMENT for an unknown or repeated function name, a
metadata key or column that collides with a reserved keyword, ``columns_json`` that is not a
JSON object, or a ``group_id`` shared by items of different prompts. Anything a completion
contains is the workers' problem, never the server's: it scores 0 with a reason
(``reward_service.pool``). UNAVAILABLE when a judge could not be reached (``judges.py``): an
outage is retried later by the caller, never scored as zeros.
Completions that are not valid UTF-8 arrive in ``completion_raw`` and are decoded with U+FFFD
replacement characters.
"""

from __future__ import annotations

import json
import logging
import time

import grpc

from reward_service import metrics
from reward_service.pool import UNAVAILABLE
from reward_service.scoring import Item, RequestError, RewardScorer
from splitrl.config import Config, RewardConfig
from splitrl.logs import configure_logging
from splitrl.metrics import start_metrics_server
from splitrl.reward_protocol import RESERVED_KEYWORDS, decode_columns
from splitrl.serving import Server, serve_until_signal, start_server
from splitrl.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "splitrl.v1.Reward"


def _grpc_message_limit(max_request_bytes: int) -> int:
    # Room above max_request_bytes so that our own size check, whose message names the config
    # key, sees requests somewhat over the limit; beyond this gRPC rejects them itself (also
    # RESOURCE_EXHAUSTED, "Received message larger than max").
    return max_request_bytes + max(1024 * 1024, max_request_bytes // 4)


def item_from_proto(index: int, msg: reward_pb2.ScoreItem) -> Item:
    completion = msg.completion
    if msg.completion_raw:
        completion = msg.completion_raw.decode("utf-8", errors="replace")
    for key in msg.metadata:
        if key in RESERVED_KEYWORDS:
            raise RequestError(f"items[{index}].metadata[{key!r}]: reserved keyword (reserved: "
                               f"{', '.join(sorted(RESERVED_KEYWORDS))})")
    try:
        columns = decode_columns(msg.columns_json, f"items[{index}].columns_json")
    except ValueError as e:
        raise RequestError(str(e)) from None
    messages = [{"role": m.role, "content": m.content} for m in msg.prompt_messages] or None
    try:
        conversation = [_message(m) for m in msg.completion_messages] or None
    except ValueError as e:
        raise RequestError(f"items[{index}].completion_messages: {e}") from None
    return Item(prompt=msg.prompt, completion=completion, reference=msg.reference,
                completion_tokens=msg.completion_tokens, truncated=msg.truncated,
                metadata=dict(msg.metadata), item_id=msg.item_id, columns=columns,
                prompt_messages=messages, group_id=msg.group_id,
                completion_ids=list(msg.completion_ids), weight_version=msg.weight_version,
                completion_messages=conversation)


def _message(m) -> dict:
    """A ChatMessage of an episode's conversation as the message dict TRL passes: role and
    content, a tool result's ``name``, an assistant turn's ``tool_calls``."""
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls_json:
        try:
            out["tool_calls"] = json.loads(m.tool_calls_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool_calls_json is not valid JSON: {e}") from None
    return out


def check_groups(items: list[Item]) -> None:
    """Items of one group are one prompt's completions: same prompt, reference and columns."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if not item.group_id:
            continue
        j = first.setdefault(item.group_id, i)
        head = items[j]
        for name in ("prompt", "reference", "columns", "prompt_messages"):
            if getattr(item, name) != getattr(head, name):
                raise RequestError(
                    f"items[{i}].group_id: {item.group_id!r} groups the completions of one "
                    f"prompt, but items[{i}].{name} differs from items[{j}].{name}")


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: RewardScorer, cfg: RewardConfig):
        self.scorer = scorer
        self.cfg = cfg

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext):
        start = time.perf_counter()
        n = len(request.items)
        if n > self.cfg.max_items_per_request:
            metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"items: {n} items exceed reward.max_items_per_request="
                          f"{self.cfg.max_items_per_request}; split the request")
        size = request.ByteSize()
        if size > self.cfg.max_request_bytes:
            metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"request: {size} bytes exceed reward.max_request_bytes="
                          f"{self.cfg.max_request_bytes}; split the request")
        try:
            self.scorer.select(request.functions)
            items = [item_from_proto(i, m) for i, m in enumerate(request.items)]
            check_groups(items)
        except RequestError as e:
            metrics.REQUESTS.labels("INVALID_ARGUMENT").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        results = self.scorer.score(items, request.functions,
                                    cancelled=lambda: not context.is_active())
        outage = next(((name, r.reasons.get(name, "")) for r in results
                       for name, status in r.statuses.items() if status == UNAVAILABLE), None)
        if outage is not None:  # a judge is down: the reward-outage policy, not zero scores
            metrics.REQUESTS.labels("UNAVAILABLE").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"functions: {outage[0]!r} could not score ({outage[1]}); retry later")
        reply = reward_pb2.ScoreReply()
        for r in results:
            reply.scores.add(item_id=r.item_id, scores=r.scores, total=r.total,
                             reasons=r.reasons, outcomes=r.outcomes)
            for name, status in r.statuses.items():
                metrics.OUTCOMES.labels(name, status).inc()
        seconds = time.perf_counter() - start
        reply.seconds = seconds
        metrics.REQUESTS.labels("OK").inc()
        metrics.ITEMS.inc(n)
        metrics.REQUEST_SECONDS.observe(seconds)
        if n and seconds > 0:
            metrics.ITEMS_PER_SECOND.set(n / seconds)
        return reply

    def ListRewardFunctions(self, request, context):
        reply = reward_pb2.ListRewardFunctionsReply()
        for spec, description, style in self.scorer.describe():
            reply.functions.add(name=spec.name, weight=spec.weight, description=description,
                                timeout_s=spec.timeout_s, style=style)
        return reply


def serve(config: Config, address: str | None = None) -> tuple[Server, RewardScorer]:
    """Start the workers, then the gRPC server (not blocking). Returns both, for tests."""
    cfg = config.reward
    # Workers first: the forkserver must start before gRPC creates its threads.
    scorer = RewardScorer(cfg, on_event=metrics.record_event)
    metrics.WORKERS.set(cfg.workers)
    try:
        server = start_server(
            lambda s: reward_pb2_grpc.add_RewardServicer_to_server(
                RewardServicer(scorer, cfg), s),
            # Listen on services.host (0.0.0.0 in a container) at the port of reward_address;
            # the address's host is how the others reach us (a compose or k8s Service name).
            address or f"{config.services.host}:{config.services.reward_address.rsplit(':', 1)[1]}",
            service_names=[SERVICE_NAME],
            max_message_bytes=_grpc_message_limit(cfg.max_request_bytes),
            auth=config.services.auth,
        )
    except BaseException:
        scorer.close()
        raise
    return server, scorer


def main(config: Config) -> int:
    """``splitrl reward``: serve until SIGTERM/SIGINT, then finish in-flight calls and exit.

    A function that cannot be loaded (a typo in a module name, an import error, bad options)
    stops the service at start with exit code 2 and the reason logged (stderr)."""
    configure_logging("reward", config.run_name)
    try:
        server, scorer = serve(config)
    except (ValueError, RuntimeError) as e:
        log.error("reward service cannot start: %s", e)  # on stderr, one JSON line
        return 2
    start_metrics_server(config.services.metrics_port)
    log.info("reward service ready", extra={
        "address": server.address, "workers": config.reward.workers,
        "functions": [s.name for s in scorer.specs]})
    try:
        serve_until_signal(server, grace_s=max(10.0, 2 * config.reward.timeout_s))
    finally:
        scorer.close()
    return 0
