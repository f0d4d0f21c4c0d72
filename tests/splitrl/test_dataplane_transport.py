"""The data plane's transport on its own (no JAX): frames, scatter/gather, TLS and mutual TLS,
strangers at the port, and a sender that hears a refusal while it is still sending."""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from splitrl import wire
from splitrl.config import AuthConfig
from splitrl.dataplane.frames import (
    CHUNK,
    END,
    OPEN,
    PREFIX,
    REPORT,
    FrameStream,
    PeerGone,
    connect,
    expect,
    parse_meta,
)
from splitrl.dataplane.link import PushLink, outcome, status_code
from splitrl.dataplane.server import DataServer
from splitrl.v1 import dataplane_pb2, tensor_pb2
from tests.tls_certs import SERVER_NAME, make_pki


class Receiver:
    """A data-plane server whose handler records what it got and answers with ``answer``."""

    def __init__(self, answer, auth=None):
        self.answer = answer
        self.got: list = []
        self.server = DataServer("127.0.0.1:0", self.handle, auth=auth,
                                 idle_timeout_s=5.0).start()
        self.address = f"127.0.0.1:{self.server.port}"

    def handle(self, stream: FrameStream) -> None:
        self.answer(self, stream)

    def close(self):
        self.server.stop(1)


def _echo_chunks(receiver: Receiver, stream: FrameStream) -> None:
    """Takes OPEN, CHUNKs (scattered into two halves each) and END; answers final OK."""
    _, meta, _ = expect(stream, [OPEN], "OPEN")
    receiver.got.append(parse_meta(dataplane_pb2.BulkOpen, meta, "OPEN"))
    while True:
        kind, meta, size, _ = stream.recv_head()
        if kind == END:
            break
        assert kind == CHUNK
        halves = [memoryview(bytearray(size // 2)), memoryview(bytearray(size - size // 2))]
        stream.recv_scatter(halves)
        receiver.got.append(b"".join(bytes(h) for h in halves))
    stream.send(REPORT, dataplane_pb2.BulkReport(final=True, outcomes=[
        outcome("me", grpc.StatusCode.OK, version=7)]))


def test_frames_carry_payloads_gathered_from_many_views_and_scattered_into_others():
    receiver = Receiver(_echo_chunks)
    try:
        stream = connect(receiver.address, auth=None, idle_timeout_s=5.0)
        stream.send(OPEN, dataplane_pb2.BulkOpen(relay_to=["a:1"]))
        data = np.random.default_rng(0).integers(0, 255, 3000, np.uint8)
        views = [memoryview(data[i : i + 2]) for i in range(0, 3000, 2)]  # > IOV_MAX pieces
        body = tensor_pb2.TensorChunk(name="w").SerializeToString()
        stream.send_raw(PREFIX.pack(CHUNK, len(body), 3000) + body, views)
        stream.send(END)
        _, meta, _ = expect(stream, [REPORT], "REPORT")
        report = parse_meta(dataplane_pb2.BulkReport, meta, "REPORT")
        stream.close()
    finally:
        receiver.close()
    assert list(receiver.got[0].relay_to) == ["a:1"]
    assert receiver.got[1] == data.tobytes()
    assert report.final and report.outcomes[0].version == 7
    assert stream.bytes_sent > 3000


def test_a_stranger_at_the_port_is_refused_in_one_log_line(caplog):
    receiver = Receiver(_echo_chunks)
    try:
        with caplog.at_level(logging.WARNING, logger="splitrl.dataplane.server"):
            with socket.create_connection(("127.0.0.1", receiver.server.port)) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                try:
                    assert sock.recv(10) == b""  # hung up on
                except ConnectionResetError:  # (with our bytes unread: a reset)
                    pass
            deadline = time.monotonic() + 5
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        receiver.close()
    assert [r.getMessage() for r in caplog.records] == [
        "data plane connection refused: not a SplitRL data-plane stream"]
    assert not receiver.got


def test_tls_and_mutual_tls_guard_the_data_plane(tmp_path):
    pki = make_pki(tmp_path)
    receiver = Receiver(_echo_chunks, auth=pki.auth())
    try:
        stream = connect(receiver.address, auth=pki.auth(), idle_timeout_s=5.0)
        assert stream.tls
        stream.send(OPEN, dataplane_pb2.BulkOpen())
        payload = memoryview(b"x" * 100_000)
        stream.send(CHUNK, tensor_pb2.TensorChunk(name="w"), payload)
        stream.send(END)
        _, meta, _ = expect(stream, [REPORT], "REPORT")
        stream.close()
        assert receiver.got[1] == bytes(payload)

        trusts_another_ca = AuthConfig(tls_ca=str(pki.other_ca), tls_server_name=SERVER_NAME)
        with pytest.raises(PeerGone, match="TLS handshake failed"):
            connect(receiver.address, auth=trusts_another_ca, idle_timeout_s=5.0)
        # A client without our certificate gets nowhere under mutual TLS.
        for auth in (None, pki.auth(cert=pki.other_cert, key=pki.other_key)):
            with pytest.raises(PeerGone):
                stranger = connect(receiver.address, auth=auth, idle_timeout_s=5.0)
                stranger.send(OPEN, dataplane_pb2.BulkOpen())
                stranger.send(END)
                expect(stranger, [REPORT], "REPORT")
        assert len(receiver.got) == 2
    finally:
        receiver.close()


def _refuse_at_once(receiver: Receiver, stream: FrameStream) -> None:
    """What a sampler does with a push it refuses at OPEN: answer, then drain."""
    expect(stream, [OPEN], "OPEN")
    stream.send(REPORT, dataplane_pb2.BulkReport(final=True, outcomes=[
        outcome("x", grpc.StatusCode.UNAUTHENTICATED, "no token"),
        outcome("y", grpc.StatusCode.UNAVAILABLE, "not reached", relay_failure=True)]))
    while stream.sock.recv(1 << 16):
        pass


def test_a_sender_hears_a_refusal_while_it_is_still_sending():
    receiver = Receiver(_refuse_at_once)
    try:
        header = wire.push_header({"w": np.zeros(1 << 20, np.float32)}, 1)
        link = PushLink([receiver.address, "127.0.0.1:9"], header, auth=None,
                        idle_timeout_s=5.0)
        frames = wire.iter_push_frames({"w": np.zeros(1 << 20, np.float32)}, 1,
                                       max_chunk_bytes=64 * 1024)
        outcomes, _ = link.run(frames, deadline=time.monotonic() + 30)
    finally:
        receiver.close()
    assert [status_code(o.code) for o in outcomes] == [grpc.StatusCode.UNAUTHENTICATED,
                                                       grpc.StatusCode.UNAVAILABLE]
    assert [o.data_address for o in outcomes] == [receiver.address, "127.0.0.1:9"]
    assert outcomes[1].relay_failure and outcomes[0].message == "no token"


def test_an_unreachable_head_fails_the_chain_as_a_relay_failure_behind_it():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connection refused
        header = wire.push_header({"w": np.zeros(4, np.float32)}, 1)
        link = PushLink([f"127.0.0.1:{port}", "127.0.0.1:9"], header, auth=None,
                        idle_timeout_s=5.0)
        outcomes, _ = link.run(iter([]), deadline=time.monotonic() + 10)
    assert status_code(outcomes[0].code) == grpc.StatusCode.UNAVAILABLE
    assert "cannot connect" in outcomes[0].message and not outcomes[0].relay_failure
    assert outcomes[1].relay_failure and f"127.0.0.1:{port} failed" in outcomes[1].message


def test_a_silent_receiver_fails_at_the_idle_deadline():
    hold = threading.Event()

    def silent(receiver, stream):
        hold.wait(10)

    receiver = Receiver(silent)
    try:
        header = wire.push_header({"w": np.zeros(4, np.float32)}, 1)
        link = PushLink([receiver.address], header, auth=None, idle_timeout_s=1.0)
        started = time.monotonic()
        outcomes, _ = link.run(wire.iter_push_frames({"w": np.zeros(4, np.float32)}, 1,
                                                     max_chunk_bytes=64),
                               deadline=time.monotonic() + 30)
        assert time.monotonic() - started < 10
    finally:
        hold.set()
        receiver.close()
    assert status_code(outcomes[0].code) == grpc.StatusCode.UNAVAILABLE
    assert "no report and no keepalive for 1s" in outcomes[0].message


def _two_phase(receiver: Receiver, stream: FrameStream) -> None:
    """A receiver that takes a whole push, reports it staged, and commits on the decision."""
    from splitrl.dataplane.frames import DECISION

    expect(stream, [OPEN], "OPEN")
    while True:
        kind, _, size, _ = stream.recv_head()
        if kind == END:
            break
        receiver.got.append(bytes(stream.recv_payload(size)))
    ok = outcome("me", grpc.StatusCode.OK, version=1)
    stream.send(REPORT, dataplane_pb2.BulkReport(final=False, outcomes=[ok]))
    _, meta, _ = expect(stream, [DECISION], "DECISION")
    assert parse_meta(dataplane_pb2.BulkDecision, meta, "DECISION").commit
    stream.send(REPORT, dataplane_pb2.BulkReport(final=True, outcomes=[ok]))


def test_a_whole_push_over_mutual_tls_is_not_fooled_by_tls_records_without_data(tmp_path):
    # A TLS 1.3 server sends session tickets after the handshake: the socket turns readable
    # with no data, which must not be taken for the receiver's report (it would wait forever).
    pki = make_pki(tmp_path)
    receiver = Receiver(_two_phase, auth=pki.auth())
    params = {"w": np.arange(50_000, dtype=np.float32)}
    try:
        link = PushLink([receiver.address], wire.push_header(params, 1), auth=pki.auth(),
                        idle_timeout_s=5.0)
        outcomes, sent_all = link.run(wire.iter_push_frames(params, 1, max_chunk_bytes=4096),
                                      deadline=time.monotonic() + 30)
    finally:
        receiver.close()
    assert sent_all and status_code(outcomes[0].code) == grpc.StatusCode.OK
    assert b"".join(receiver.got) == params["w"].tobytes()
