"""Sends the queue's work to samplers and reports what comes back.

The trainer *pulls*: a dispatch thread asks the :class:`~trainer_service.orchestration.queue.
RolloutQueue` for a request's worth of items for each ready sampler with spare capacity,
sends it as one ``Rollout`` call, and streams the scored groups back into the queue. The queue
owns the items (what is queued, in flight, buffered); this class owns only the calls, so it can
cancel them, and tells the sampler pool how each sampler behaved.

How a call ends decides what happens next:

- complete: the groups are the queue's; the sampler is healthy;
- FAILED_PRECONDITION: the sampler's weights are older than the request allows (it restarted,
  or a push is on its way); it is re-synced, not blamed;
- INVALID_ARGUMENT: the sampler refused the request as invalid; the queue isolates and, the
  second time, drops the prompt (no endless re-dispatch);
- UNAVAILABLE with the cause ``REWARD_UNAVAILABLE`` (``splitrl.error_cause``, in the trailing
  metadata): scoring is down, not the sampler; dispatching pauses with an exponential back-off
  instead of re-sending in a tight loop;
- INTERNAL: the request failed inside the sampler (its engine); suspect, and refused after
  ``services.sampler_max_internal_failures`` such failures in a row (it answers probes, so
  it would otherwise get every prompt again, failing each);
- anything else (a dead process, a timeout): the sampler is suspect; the items go back to the
  queue for another sampler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from splitrl.config import SamplingConfig
from splitrl.error_cause import Cause, cause_of
from splitrl.reward_protocol import RewardOutcome, encode_columns
from splitrl.v1 import common_pb2, sampler_pb2
from trainer_service.orchestration.membership import SamplerHandle, SamplerPool
from trainer_service.orchestration.queue import Claim, Failure, RolloutQueue
from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem

log = logging.getLogger(__name__)

_BACKOFF_START_S, _BACKOFF_MAX_S = 0.5, 8.0


def sampling_params(cfg: SamplingConfig, *, greedy: bool = False) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=0.0 if greedy else cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=cfg.stop_token_ids,
        seed=cfg.seed,
        has_seed=True,
        greedy=greedy,
    )


def prompt_message(item: WorkItem) -> common_pb2.Prompt:
    """A work item as a wire ``Prompt`` (text, chat messages or token ids) with its seed."""
    row = item.row
    prompt = common_pb2.Prompt(
        prompt_id=item.uid,
        reference=str(row.get("reference", "")),
        columns_json=encode_columns(row.get("columns")),  # typed, for the reward functions
        seed=item.seed,
        has_seed=True,
    )
    if row.get("messages"):
        for m in row["messages"]:
            prompt.messages.add(role=m["role"], content=m["content"])
    elif row.get("token_ids"):
        prompt.token_ids.extend(row["token_ids"])
    else:
        prompt.text = row["prompt"]
    return prompt


def group_from_wire(item: WorkItem, msg: sampler_pb2.ScoredGroup,
                    request_id: str = "") -> RolloutGroup:
    completions = [
        Completion(
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            reward=c.total_reward,
            rewards=dict(c.rewards),
            finish_reason=c.finish_reason,
            text=c.text,
            reasons=dict(c.reward_reasons),
            outcomes={name: RewardOutcome.from_wire(v) for name, v in c.reward_outcomes.items()},
            weight_versions=list(c.weight_versions) or [msg.weight_version],
            model_token_mask=list(c.model_token_mask) or None,
            turns=[{"generated": t.generated_tokens, "observation": t.observation_tokens,
                    "tool_calls": [(call.name, call.status) for call in t.tool_calls]}
                   for t in c.turns],
            episode_end=c.episode_end,
        )
        for c in msg.completions
    ]
    oldest = min((v for c in completions for v in c.weight_versions), default=msg.weight_version)
    return RolloutGroup(
        item=item,
        prompt_token_ids=list(msg.prompt_token_ids),
        completions=completions,
        weight_version=oldest,
        sampler_id=msg.sampler_id,
        request_id=request_id,
        generate_s=msg.timings.generate_s,
        score_s=msg.timings.score_s,
    )


class Dispatcher:
    """Keeps samplers busy with the queue's work; see the module docstring."""

    def __init__(self, pool: SamplerPool, queue: RolloutQueue, *, rollout_timeout_s: float,
                 metadata: tuple = ()):
        """``rollout_timeout_s``: the deadline of each Rollout call
        (``trainer.rollout_timeout_s``); a call past it fails like a dead sampler."""
        self.pool = pool
        self.queue = queue
        self.metadata = metadata
        self.rollout_timeout_s = rollout_timeout_s
        self._calls: dict[str, grpc.Future] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backoff_s = 0.0
        self._paused_until = 0.0
        # When each sampler was last sent a request (a count of requests): each round offers
        # work to the one that waited longest first.
        self._sends = itertools.count()
        self._last_sent: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            launched = False
            try:
                if time.monotonic() >= self._paused_until:
                    launched = self.dispatch_once()
            except Exception:  # never let dispatch die silently; log and keep going
                log.exception("dispatch round failed")
            if not launched:
                if self.queue.has_queued():
                    self._stop.wait(0.05)  # work but no free sampler: poll the pool again
                else:
                    self.queue.wait_for_work(0.2)

    # -- dispatch -------------------------------------------------------------------------

    def dispatch_once(self) -> bool:
        """One round: at most one new request per ready sampler, offered first to the sampler
        sent a request longest ago (never: first of all). A synchronous step's requests then
        rotate over every sampler, instead of always going to the first ones in the pool while
        the rest stand idle. True if any was sent."""
        ready = sorted(self.pool.ready(), key=lambda h: self._last_sent.get(h.address, -1))
        launched = False
        for handle in ready:
            claim = self.queue.claim(handle.address, handle.weight_version, handle.capacity,
                                     len(ready))
            if claim is None:
                continue
            self._last_sent[handle.address] = next(self._sends)
            try:
                self._launch(handle, claim)
            except Exception as e:  # the call could not even start: the items go back
                self.queue.finish(claim.request_id, Failure(f"rollout could not start: {e}"))
                self.pool.report_failure(handle, f"rollout could not start: {e}")
                continue
            launched = True
        return launched

    def _launch(self, handle: SamplerHandle, claim: Claim) -> None:
        request = sampler_pb2.RolloutRequest(
            request_id=claim.request_id,
            prompts=[prompt_message(i) for i in claim.items],
            group_size=claim.lane.group_size,
            sampling=claim.lane.sampling,
            min_version=claim.min_version,
            reproducible=claim.lane.reproducible,
        )
        call = handle.stub.Rollout(request, timeout=self.rollout_timeout_s,
                                   metadata=self.metadata)
        with self._lock:
            self._calls[claim.request_id] = call
        threading.Thread(target=self._consume, args=(handle, claim, call), daemon=True,
                         name=f"rollout-{claim.request_id}").start()

    def _consume(self, handle: SamplerHandle, claim: Claim, call) -> None:
        by_uid = {i.uid: i for i in claim.items}
        failure: Failure | None = None
        start = time.monotonic()
        try:
            for msg in call:
                item = by_uid.get(msg.prompt_id)
                if item is None:
                    log.warning("unexpected group", extra={"prompt_id": msg.prompt_id,
                                                           "request_id": claim.request_id})
                    continue
                self.queue.deliver(claim.request_id, group_from_wire(item, msg,
                                                                     claim.request_id))
            self.pool.report_rollout_ok(handle)
            self._backoff_s = 0.0
        except grpc.RpcError as e:
            failure = self._classify(handle, claim, e)
        finally:
            with self._lock:
                self._calls.pop(claim.request_id, None)
            lost = self.queue.finish(claim.request_id, failure)
        if lost and not self._stop.is_set():
            log.warning("rollout incomplete; prompts re-queued" if not failure or
                        not failure.refused else "rollout refused as invalid",
                        extra={"address": handle.address, "request_id": claim.request_id,
                               "prompts": len(lost), "error": failure.message if failure
                               else "missing groups",
                               "seconds": round(time.monotonic() - start, 2)})

    def _classify(self, handle: SamplerHandle, claim: Claim, e: grpc.RpcError) -> Failure:
        code, details = e.code(), e.details() or ""
        message = f"{code.name}: {details}"
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            log.info("sampler behind", extra={"address": handle.address, "msg": details})
            self.pool.behind(handle, claim.min_version)
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            return Failure(message, refused=True)
        elif code == grpc.StatusCode.UNAVAILABLE and cause_of(e) == Cause.REWARD_UNAVAILABLE:
            self._back_off(details)
        elif code == grpc.StatusCode.INTERNAL:
            self.pool.report_internal_failure(handle, message)
        elif code != grpc.StatusCode.CANCELLED or not self._stop.is_set():
            self.pool.report_failure(handle, message)
        return Failure(message)

    def _back_off(self, details: str) -> None:
        """The reward service is down: pause dispatching (doubling, capped) rather than blame
        the samplers or re-send in a tight loop."""
        self._backoff_s = min(_BACKOFF_MAX_S, max(_BACKOFF_START_S, 2 * self._backoff_s))
        self._paused_until = time.monotonic() + self._backoff_s
        log.warning("reward service unavailable; dispatch paused",
                    extra={"seconds": self._backoff_s, "error": details})
