"""Weight pushes over the bulk data plane: receive, relay, stage, and swap on the sender's word.

One connection is one push (``protos/splitrl/v1/dataplane.proto``; docs/weight-sync.md):

1. OPEN: the token is checked as for gRPC ``PushWeights`` (UNAUTHENTICATED otherwise, nothing
   forwarded), the route and the header are checked, and a connection to the next sampler of
   the route (``relay_to[0]``) is opened with this sampler's own credentials;
2. CHUNK ... END: each chunk's bytes are received straight into their place in the staging
   buffer (RAW) or into a scratch buffer (SPARSE), forwarded to the next sampler as they are,
   then verified and staged (:class:`sampler_service.weights.PushSession`). A chunk that fails
   here fails this sampler's push only; the bytes still go on to the next one;
3. the staged report goes upstream: this sampler's outcome, then its downstream's (while
   waiting for those, keepalives go upstream every quarter of the idle deadline);
4. DECISION: forwarded downstream; on "commit" the staged weights are swapped in;
5. the final report goes upstream.

Every read has the idle deadline ``sampler.push_idle_timeout_s``: a sender that stalls, or
hangs up, before its decision leaves nothing applied and releases the push lock. A relay that
loses its downstream reports it (and everything after it as not reached) and carries on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import numpy as np

from sampler_service import metrics
from sampler_service.weights import PushResult, PushSession, WeightStore
from splitrl.auth import AUTH_METADATA_KEY, AuthError, CallGuard
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
    expect,
    parse_meta,
    split_address,
)
from splitrl.dataplane.link import PUSH_METHOD, PushLink, outcome, unreached
from splitrl.logs import set_context
from splitrl.v1 import dataplane_pb2, tensor_pb2
from splitrl.wire import WireError

log = logging.getLogger(__name__)

MAX_ROUTE = 64
_RAW = tensor_pb2.TensorChunk.RAW


def record_push(result: PushResult | None, code: grpc.StatusCode, message: str = "",
                version: int = 0) -> None:
    """Metrics and the log line of one push's outcome (either transport)."""
    metrics.PUSHES.labels(code.name).inc()
    if result is not None:
        metrics.PUSH_SECONDS.observe(result.seconds)
        metrics.PUSH_SWAP_SECONDS.observe(result.swap_seconds)
        metrics.PUSH_BYTES.inc(result.bytes_received)
        metrics.WEIGHT_VERSION.set(result.version)
        set_context(weight_version=result.version)
    elif code == grpc.StatusCode.CANCELLED:
        log.warning("weight push cancelled by the sender", extra={"reason": message,
                                                                  "weight_version": version})
    else:
        log.warning("weight push rejected", extra={"code": code.name, "reason": message,
                                                   "weight_version": version})


class BulkIntake:
    """Serves pushes for one :class:`WeightStore` on the data plane (``handle`` per connection)."""

    def __init__(self, store: WeightStore, *, auth: AuthConfig | None, idle_timeout_s: float,
                 sampler_id: str = "", data_address: str = "",
                 after_swap: Callable[[], object] = lambda: None):
        """``after_swap``: called once a push that swapped new weights in has been answered
        (`GenerationEngine.serve_ahead`)."""
        self.store = store
        self.after_swap = after_swap
        self.auth = auth
        self.guard = CallGuard(auth)
        self.idle_timeout_s = idle_timeout_s
        self.sampler_id = sampler_id
        self.data_address = data_address

    def _mine(self, code: grpc.StatusCode, message: str = "", result: PushResult | None = None,
              seconds: float = 0.0) -> dataplane_pb2.PushOutcome:
        version = result.version if result is not None else self.store.version
        return outcome(self.data_address, code, message, sampler_id=self.sampler_id,
                       version=version,
                       bytes_received=result.bytes_received if result else 0,
                       seconds=result.seconds if result else seconds,
                       swap_seconds=result.swap_seconds if result else 0.0)

    def handle(self, stream: FrameStream) -> None:
        try:
            _, meta, _ = expect(stream, [OPEN], "OPEN")
            request = parse_meta(dataplane_pb2.BulkOpen, meta, "OPEN")
        except (PeerGone, WireError) as e:
            log.warning("data plane connection dropped before OPEN",
                        extra={"peer": stream.peer, "error": str(e)})
            return
        route = list(request.relay_to)
        try:
            sent = [(AUTH_METADATA_KEY, request.authorization)] if request.authorization else []
            self.guard.check(PUSH_METHOD, sent)
        except AuthError as e:
            log.warning("call refused: not authenticated",
                        extra={"method": "data plane push", "peer": stream.peer})
            self._refuse(stream, e.code, e.message, route)
            return
        try:
            self._check_route(route)
        except WireError as e:
            self._refuse(stream, e.code, e.message, route)
            return
        self._push(stream, request.header, route)

    def _check_route(self, route: list[str]) -> None:
        if len(route) > MAX_ROUTE:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"relay_to has {len(route)} addresses, more than {MAX_ROUTE}")
        for address in route:
            try:
                split_address(address)
            except ValueError as e:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"relay_to: {e}") from None
        if len(set(route)) != len(route) or self.data_address in route:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"relay_to {route} repeats an address or names this sampler "
                            f"({self.data_address}): a chain visits each sampler once")

    def _refuse(self, stream: FrameStream, code: grpc.StatusCode, message: str,
                route: list[str]) -> None:
        """Answer a push refused at OPEN with its final report, then drain the sender's bytes
        until it hangs up (closing with unread data would reset the connection and lose the
        report)."""
        record_push(None, code, message, self.store.version)
        report = dataplane_pb2.BulkReport(final=True, outcomes=[
            self._mine(code, message),
            *unreached(route, f"{self.data_address or 'the relay'} refused the push")])
        try:
            stream.send(REPORT, report)
            deadline = time.monotonic() + self.idle_timeout_s
            while time.monotonic() < deadline and stream.sock.recv(1 << 20):
                pass
        except (PeerGone, OSError):
            pass

    def _push(self, stream: FrameStream, header, route: list[str]) -> None:
        started = time.perf_counter()
        link = PushLink(route, header, auth=self.auth, idle_timeout_s=self.idle_timeout_s) \
            if route else None
        session: PushSession | None = None
        error: WireError | None = None
        try:
            try:
                session = self.store.begin_push(header)
            except WireError as e:
                error = e
            try:
                session, error = self._receive(stream, link, session, error)
            except PeerGone as e:  # the sender hung up or went quiet: nobody to answer
                log.warning("weight push abandoned: the sender's stream broke",
                            extra={"peer": stream.peer, "error": str(e),
                                   "push_version": header.version})
                record_push(None, grpc.StatusCode.CANCELLED, str(e), self.store.version)
                return
            except WireError as e:  # the stream is malformed (or oversized): say so, hang up
                if link is not None:
                    link.close(f"{self.data_address} refused the push: {e.message}")
                self._refuse(stream, e.code, e.message, route)
                return
            if session is not None:
                try:
                    session.finish()
                except WireError as e:
                    session.close()
                    session, error = None, e
            mine = (self._mine(grpc.StatusCode.OK, seconds=time.perf_counter() - started)
                    if error is None else self._mine(error.code, error.message))
            try:
                keepalive = (lambda: stream.send(KEEPALIVE))
                downstream = link.report(final=False, on_keepalive=keepalive) if link else []
                stream.send(REPORT, dataplane_pb2.BulkReport(final=False,
                                                             outcomes=[mine, *downstream]))
                _, meta, _ = expect(stream, [DECISION], "the DECISION")
                commit = parse_meta(dataplane_pb2.BulkDecision, meta, "DECISION").commit
            except (PeerGone, WireError) as e:
                why = f"the sender went away before its decision ({e}); not applied"
                record_push(None, grpc.StatusCode.CANCELLED, why, self.store.version)
                return
            if link is not None:
                link.decide(commit)
            result = None
            if session is not None and commit:
                try:
                    result = session.swap()
                except WireError as e:
                    error = e
            elif session is not None:
                error = WireError(grpc.StatusCode.ABORTED, "the sender decided not to commit "
                                  f"push version {header.version}; version "
                                  f"{self.store.version} still serving")
            if session is not None:  # release the push lock before anyone hears the result
                session.close()
                session = None
            code = error.code if error is not None else grpc.StatusCode.OK
            record_push(result, code, error.message if error else "", self.store.version)
            mine = self._mine(code, error.message if error else "", result)
            downstream = link.report(final=True, on_keepalive=keepalive) if link else []
            try:
                stream.send(REPORT, dataplane_pb2.BulkReport(final=True,
                                                             outcomes=[mine, *downstream]))
            except PeerGone:
                pass
            if result is not None:
                self.after_swap()
        finally:
            if session is not None:
                session.close()
            if link is not None:
                link.close()

    def _receive(self, stream: FrameStream, link: PushLink | None, session: PushSession | None,
                 error: WireError | None) -> tuple[PushSession | None, WireError | None]:
        """CHUNK frames until END: each forwarded, and staged while this sampler's push is
        still good. Raises what breaks the stream itself."""
        # Delta payloads and bytes this sampler does not keep land here (a reused buffer).
        scratch = self.store.staging.take((self.store.max_chunk_bytes,), np.uint8).data
        while True:
            kind, meta, size, head = stream.recv_head()
            if kind == END and not size:
                if link is not None:
                    link.end()
                return session, error
            if kind != CHUNK:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{stream.peer}: expected CHUNK or END, got frame kind {kind}")
            if size > self.store.max_chunk_bytes:
                raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{stream.peer}: a chunk payload of {size} bytes, more than "
                                f"the sampler's max_chunk_bytes {self.store.max_chunk_bytes}")
            chunk = parse_meta(tensor_pb2.TensorChunk, meta, "CHUNK")
            place = None
            if session is not None:
                try:
                    if chunk.data or chunk.payload_bytes != size:
                        raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"chunk for {chunk.name!r}: payload_bytes is "
                                        f"{chunk.payload_bytes} and data {len(chunk.data)} bytes "
                                        f"for a frame payload of {size} bytes")
                    if chunk.encoding == _RAW:
                        place = session.reserve(chunk, size)
                except WireError as e:
                    session.close()
                    session, error = None, e
            target = place if place is not None else scratch[:size]
            stream.recv_into(target)
            if link is not None:
                link.forward(head, [target])
                metrics.PUSH_RELAYED_BYTES.inc(size)
            if session is None:
                continue
            try:
                if place is not None:
                    session.commit()
                else:
                    session.add(chunk, target)
            except WireError as e:
                session.close()
                session, error = None, e
