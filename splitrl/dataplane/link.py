"""The sending end of one push connection: what the trainer holds to the head of a chain, and
what each relaying sampler holds to the next one.

:class:`PushLink` opens the connection (OPEN with the rest of the route), sends or forwards
chunks, notices a receiver that refused early (it answers with a final report while we are
still sending, and drains until we stop), collects the staged report (waiting through the
receiver's keepalives), sends the decision and collects the final report. Anything that goes
wrong on the connection turns into outcomes: the first hop failed (``UNAVAILABLE``, with the
reason), every hop after it not reached (``relay_failure``), so the caller can push to those
again by another way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import grpc

from splitrl.auth import resolve_token
from splitrl.config import AuthConfig
from splitrl.dataplane.frames import (
    CHUNK,
    DECISION,
    END,
    KEEPALIVE,
    OPEN,
    REPORT,
    FrameStream,
    PeerGone,
    connect,
    expect,
    parse_meta,
)
from splitrl.v1 import dataplane_pb2, sampler_pb2, tensor_pb2
from splitrl.wire import Frame, WireError

PUSH_METHOD = "splitrl.v1.Sampler/PushWeights"  # the permission a data-plane push needs
# How often a sender looks for an early answer (a refusal) between chunks: a system call per
# chunk cost more than the rest of the sender's Python per chunk; a refusal is noticed within
# this, or when the receiver stops reading.
_LOOK_EVERY_S = 0.02


def outcome(address: str, code: grpc.StatusCode, message: str = "",
            **fields) -> dataplane_pb2.PushOutcome:
    return dataplane_pb2.PushOutcome(data_address=address, code=code.value[0], message=message,
                                     **fields)


def status_code(value: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` for a ``PushOutcome.code`` (UNKNOWN for a value we do not know)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def unreached(route: Sequence[str], why: str) -> list[dataplane_pb2.PushOutcome]:
    return [outcome(a, grpc.StatusCode.UNAVAILABLE, f"not reached: {why}", relay_failure=True)
            for a in route]


def authorization(auth: AuthConfig | None) -> str:
    token = resolve_token(auth)
    return f"Bearer {token}" if token else ""


class PushLink:
    """Upstream end of a push to ``route[0]``, which forwards it along ``route[1:]``."""

    def __init__(self, route: Sequence[str], header: sampler_pb2.PushHeader, *,
                 auth: AuthConfig | None, idle_timeout_s: float):
        if not route:
            raise ValueError("a push needs at least one receiver")
        self.route = list(route)
        self.idle_timeout_s = idle_timeout_s
        self.stream: FrameStream | None = None
        self._result: list[dataplane_pb2.PushOutcome] | None = None  # set once settled
        self._next_look = 0.0  # when to look again for an early answer (a refusal)
        try:
            self.stream = connect(self.route[0], auth=auth, idle_timeout_s=idle_timeout_s)
            self.stream.send(OPEN, dataplane_pb2.BulkOpen(
                authorization=authorization(auth), header=header, relay_to=self.route[1:]))
        except PeerGone as e:
            self._fail(str(e))

    @property
    def bytes_sent(self) -> int:
        return self.stream.bytes_sent if self.stream is not None else 0

    @property
    def _open_stream(self) -> FrameStream:
        """The stream of an open link (a link that failed to connect is settled, not open)."""
        assert self.stream is not None, "an open link has a stream"
        return self.stream

    @property
    def open(self) -> bool:
        """Still sending: connected, and the receiver has not answered yet."""
        return self._result is None

    # -- sending ----------------------------------------------------------------------------

    def send_chunk(self, chunk: tensor_pb2.TensorChunk, payload) -> None:
        if not self.open:
            return
        chunk.payload_bytes = len(payload)
        self._guard(lambda: self._open_stream.send(CHUNK, chunk, payload))

    def forward(self, head: bytes, payload: Sequence[memoryview]) -> None:
        """A frame exactly as it was received (a relay passing it on from where it landed)."""
        if self.open:
            self._guard(lambda: self._open_stream.send_raw(head, payload))

    def end(self) -> None:
        if self.open:
            self._guard(lambda: self._open_stream.send(END))

    def _guard(self, send: Callable[[], None]) -> None:
        try:
            now = time.monotonic()
            if now >= self._next_look:  # the receiver answered before the end: it refused
                self._next_look = now + _LOOK_EVERY_S
                if self._open_stream.readable(0):
                    self._take_report(final=None)
                    return
            send()
        except (PeerGone, WireError) as e:
            self._fail(str(e))

    # -- reports ----------------------------------------------------------------------------

    def report(self, *, final: bool, deadline: float | None = None,
               on_keepalive: Callable[[], None] | None = None) -> list[dataplane_pb2.PushOutcome]:
        """The receiver's staged (``final`` False) or final report: one outcome per hop of the
        route, in order. Waits through keepalives (passing each on) until ``deadline``; a
        receiver silent for ``idle_timeout_s`` has failed."""
        silent_since = time.monotonic()
        while self.open:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._fail("no report before the push deadline")
                break
            wait = self.idle_timeout_s / 4
            if deadline is not None:
                wait = min(wait, deadline - now)
            try:
                if not self._open_stream.readable(max(wait, 0.0)):
                    if time.monotonic() - silent_since > self.idle_timeout_s:
                        self._fail(f"no report and no keepalive for {self.idle_timeout_s:.0f}s")
                    continue
                kind, meta, _ = expect(self._open_stream, [REPORT, KEEPALIVE], "a REPORT")
                if kind == KEEPALIVE:
                    silent_since = time.monotonic()
                    if on_keepalive is not None:
                        on_keepalive()
                    continue
                report = parse_meta(dataplane_pb2.BulkReport, meta, "REPORT")
                if report.final or not final:
                    return self._settle(report)
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{self.route[0]}: a staged report where the final one was due")
            except (PeerGone, WireError) as e:
                self._fail(str(e))
        assert self._result is not None  # the loop ends once the link is settled
        return self._result

    def _take_report(self, final: bool | None) -> None:
        kind, meta, _ = expect(self._open_stream, [REPORT, KEEPALIVE], "a REPORT")
        if kind == REPORT:
            self._settle(parse_meta(dataplane_pb2.BulkReport, meta, "REPORT"))

    def _settle(self, report: dataplane_pb2.BulkReport) -> list[dataplane_pb2.PushOutcome]:
        """The outcomes of ``report`` in route order (missing hops: failed). A final report
        settles the link; a staged one is returned and the link stays open for the decision."""
        got = list(report.outcomes)
        out = []
        for i, address in enumerate(self.route):
            if i < len(got):
                got[i].data_address = address
                out.append(got[i])
            else:
                out.append(outcome(address, grpc.StatusCode.UNAVAILABLE,
                                   f"{self.route[0]} reported no outcome for it",
                                   relay_failure=True))
        if report.final:
            self._result = out
            self._close_stream()
        return out

    def decide(self, commit: bool) -> None:
        """Tell the receiver to swap in what it staged (or to drop it)."""
        if self.open:
            self._guard(lambda: self._open_stream.send(DECISION, dataplane_pb2.BulkDecision(
                commit=commit)))

    def run(self, frames: Iterable[Frame], *, deadline: float
            ) -> tuple[list[dataplane_pb2.PushOutcome], bool]:
        """A whole push: ``frames``, END, the staged report, the decision (commit if still
        before ``deadline``), the final report. Returns the final outcomes and whether every
        frame was sent (False: the receiver refused or failed first, or the deadline passed)."""
        sent_all = True
        for chunk, payload in frames:
            left = deadline - time.monotonic()
            if self.stream is not None and left < self.idle_timeout_s:
                self.stream.set_timeout(left)  # a send blocked past the deadline fails at it
            self.send_chunk(chunk, payload)
            if not self.open or time.monotonic() > deadline:
                sent_all = False
                break
        self.end()
        self.report(final=False, deadline=deadline)
        self.decide(commit=time.monotonic() < deadline)
        outcomes = self.report(final=True, deadline=deadline)
        self.close()
        return outcomes, sent_all

    # -- failure ----------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        if self._result is not None:
            return
        self._result = [outcome(self.route[0], grpc.StatusCode.UNAVAILABLE, why),
                        *unreached(self.route[1:], f"relay {self.route[0]} failed: {why}")]
        self._close_stream()

    def _close_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def close(self, why: str = "the push was abandoned upstream"
              ) -> list[dataplane_pb2.PushOutcome]:
        """Hang up (the receiver then drops what it staged); returns the settled outcomes."""
        self._fail(why)
        assert self._result is not None  # _fail settles the link
        return self._result
