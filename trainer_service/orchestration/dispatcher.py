"""Hands prompts to samplers and collects their scored groups into the buffer.

The trainer *pulls*: it keeps enough ``Rollout`` requests in flight to feed the coming steps,
each to a ready sampler with spare capacity, and streams the groups back into the
:class:`~trainer_service.orchestration.rollouts.RolloutBuffer`. A prompt whose sampler fails
(call error, dead process, dropped from the pool) before its group came back goes to the front
of the queue and is handed to another sampler; a prompt is never given to two samplers at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import grpc

from splitrl.config import SamplingConfig
from splitrl.reward_protocol import encode_columns
from splitrl.v1 import common_pb2, sampler_pb2
from trainer_service.orchestration.membership import READY, SamplerHandle, SamplerPool
from trainer_service.orchestration.rollouts import Completion, RolloutBuffer, RolloutGroup, WorkItem

log = logging.getLogger(__name__)


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


def prompt_message(uid: str, row: dict) -> common_pb2.Prompt:
    """A data row as a wire ``Prompt`` (text, chat messages or token ids)."""
    prompt = common_pb2.Prompt(
        prompt_id=uid,
        reference=str(row.get("reference", "")),
        columns_json=encode_columns(row.get("columns")),  # typed, for the reward functions
    )
    if row.get("messages"):
        for m in row["messages"]:
            prompt.messages.add(role=m["role"], content=m["content"])
    elif row.get("token_ids"):
        prompt.token_ids.extend(row["token_ids"])
    else:
        prompt.text = row["prompt"]
    return prompt


def group_from_wire(item: WorkItem, msg: sampler_pb2.ScoredGroup) -> RolloutGroup:
    return RolloutGroup(
        item=item,
        prompt_token_ids=list(msg.prompt_token_ids),
        completions=[
            Completion(
                token_ids=list(c.token_ids),
                logprobs=list(c.logprobs),
                reward=c.total_reward,
                rewards=dict(c.rewards),
                finish_reason=c.finish_reason,
                text=c.text,
                reasons=dict(c.reward_reasons),
            )
            for c in msg.completions
        ],
        weight_version=msg.weight_version,
        sampler_id=msg.sampler_id,
        generate_s=msg.timings.generate_s,
        score_s=msg.timings.score_s,
    )


class Dispatcher:
    """Keeps samplers busy with the queued work items."""

    def __init__(
        self,
        pool: SamplerPool,
        buffer: RolloutBuffer,
        *,
        group_size: int,
        sampling: SamplingConfig,
        min_version: Callable[[], int],
        metadata: tuple = (),
        rollout_timeout_s: float = 600.0,
    ):
        self.pool = pool
        self.buffer = buffer
        self.group_size = group_size
        self.sampling = sampling_params(sampling)
        self.min_version = min_version
        self.metadata = metadata
        self.rollout_timeout_s = rollout_timeout_s
        self._pending: deque[WorkItem] = deque()
        self._inflight: dict[str, tuple[SamplerHandle, list[WorkItem], grpc.Future]] = {}
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._seeds_used = 0
        self.redispatched = 0
        self.dispatched = 0

    # -- queue ----------------------------------------------------------------------------

    def submit(self, items: list[WorkItem]) -> None:
        with self._lock:
            self._pending.extend(items)
            self._lock.notify_all()

    def requeue(self, item: WorkItem) -> None:
        """Put ``item`` back at the front: it will be handed to a sampler again."""
        item.attempts += 1
        with self._lock:
            self.redispatched += 1
            self._pending.appendleft(item)
            self._lock.notify_all()

    def outstanding(self) -> int:
        """Work items queued or being rolled out (not yet in the buffer)."""
        with self._lock:
            return len(self._pending) + sum(len(v[1]) for v in self._inflight.values())

    def unfinished_items(self) -> list[WorkItem]:
        """Queued and in-flight items, for the checkpoint (nothing is lost on a restart)."""
        with self._lock:
            inflight = [i for _, items, _ in self._inflight.values() for i in items]
            return inflight + list(self._pending)

    def cancel_sampler(self, handle: SamplerHandle) -> None:
        """Cancel the calls in flight on ``handle`` (it left the pool); their items requeue."""
        with self._lock:
            calls = [c for h, _, c in self._inflight.values() if h is handle and c is not None]
        for call in calls:
            call.cancel()

    # -- dispatch loop --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
            calls = [c for _, _, c in self._inflight.values() if c is not None]
        for call in calls:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            launched = False
            try:
                launched = self._dispatch_once()
            except Exception:  # never let dispatch die silently; log and keep going
                log.exception("dispatch round failed")
            if not launched:
                with self._lock:
                    self._lock.wait(timeout=0.1)

    def _dispatch_once(self) -> bool:
        min_version = self.min_version()
        samplers = [
            h for h in self.pool.ready() if h.state == READY and h.weight_version >= min_version
        ]
        launched = False
        for handle in samplers:
            with self._lock:
                if not self._pending:
                    break
                slots = max(1, handle.capacity // self.group_size) - handle.inflight
                if slots <= 0:
                    continue
                share = math.ceil(len(self._pending) / len(samplers))
                items = [self._pending.popleft() for _ in range(min(slots, share))]
                # Registered as in flight in the same critical section that took them from
                # the queue: outstanding() and checkpoints never miss an item.
                request_id = f"r{next(self._ids)}-{uuid.uuid4().hex[:6]}"
                self._inflight[request_id] = (handle, items, None)
                handle.inflight += len(items)
                self.dispatched += len(items)
            try:
                self._launch(request_id, handle, items, min_version)
            except Exception as e:  # the call could not even start: the items go back
                with self._lock:
                    self._inflight.pop(request_id, None)
                    handle.inflight -= len(items)
                    self._pending.extendleft(reversed(items))
                self.pool.report_failure(handle, f"rollout could not start: {e}")
                continue
            launched = True
        return launched

    def _launch(
        self, request_id: str, handle: SamplerHandle, items: list[WorkItem], min_version: int
    ) -> None:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        # A seed per request, derived from the run's seed: reproducible samples for a request,
        # fresh noise for every request (one fixed seed would repeat the same draws each step).
        sampling.seed = (self.sampling.seed * 1_000_003 + self._seeds_used) % (1 << 63)
        self._seeds_used += 1
        request = sampler_pb2.RolloutRequest(
            request_id=request_id,
            prompts=[prompt_message(i.uid, i.row) for i in items],
            group_size=self.group_size,
            sampling=sampling,
            min_version=min_version,
        )
        call = handle.stub.Rollout(
            request, timeout=self.rollout_timeout_s, metadata=self.metadata
        )
        with self._lock:
            self._inflight[request_id] = (handle, items, call)
        threading.Thread(
            target=self._consume, args=(request_id, handle, items, call), daemon=True,
            name=f"rollout-{request_id}",
        ).start()

    def _consume(self, request_id, handle: SamplerHandle, items: list[WorkItem], call) -> None:
        by_uid = {i.uid: i for i in items}
        done: set[str] = set()
        start = time.monotonic()
        try:
            for msg in call:
                item = by_uid.get(msg.prompt_id)
                if item is None or msg.prompt_id in done:
                    log.warning("unexpected group", extra={"prompt_id": msg.prompt_id})
                    continue
                done.add(msg.prompt_id)
                self.buffer.put(group_from_wire(item, msg))
            self.pool.report_ok(handle)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The sampler's weights are older than this request allows; the publisher is
                # bringing it up to date. Not a failure of the sampler.
                log.info("sampler behind", extra={"address": handle.address, "msg": e.details()})
                handle.weight_version = min(handle.weight_version, self.min_version() - 1)
                self.pool.resync(handle)
            elif e.code() != grpc.StatusCode.CANCELLED or not self._stop.is_set():
                self.pool.report_failure(handle, f"{e.code().name}: {e.details()}")
        finally:
            lost = [i for i in items if i.uid not in done]
            with self._lock:  # one critical section: an item is never in neither place
                self._inflight.pop(request_id, None)
                handle.inflight -= len(items)
                if not self._stop.is_set():
                    for item in reversed(lost):
                        item.attempts += 1
                        self._pending.appendleft(item)
                    self.redispatched += len(lost)
                    self._lock.notify_all()
            if lost:
                log.warning(
                    "rollout incomplete; prompts re-queued",
                    extra={"address": handle.address, "requeued": len(lost),
                           "seconds": round(time.monotonic() - start, 2)},
                )
