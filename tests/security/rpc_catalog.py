"""Every RPC of the three services, read from the generated descriptors, and a raw caller.

Listing the methods from ``splitrl.v1`` (not by hand) is the point: an RPC added to a proto
is in these tests the moment the modules are regenerated, so it cannot go unprotected or
unfuzzed by accident.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2

from splitrl.v1 import reward_pb2, sampler_pb2, trainer_pb2

SERVICE_OF_MODULE = {sampler_pb2: "sampler", reward_pb2: "reward", trainer_pb2: "trainer"}


@dataclass(frozen=True)
class Rpc:
    server: str  # which process serves it: "sampler", "reward", "trainer"
    method: MethodDescriptor

    @property
    def name(self) -> str:  # "splitrl.v1.Sampler/Generate"
        return f"{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def path(self) -> str:
        return "/" + self.name

    def __str__(self) -> str:
        return self.name


def splitrl_rpcs() -> list[Rpc]:
    return [Rpc(server, method)
            for module, server in SERVICE_OF_MODULE.items()
            for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods]


def health_rpcs() -> list[Rpc]:
    """The standard health service, which every server also serves."""
    return [Rpc(server, method)
            for server in SERVICE_OF_MODULE.values()
            for service in health_pb2.DESCRIPTOR.services_by_name.values()
            for method in service.methods]


def call_raw(channel: grpc.Channel, rpc: Rpc, payload: bytes | Iterable[bytes], *,
             timeout_s: float, metadata=()) -> tuple[grpc.StatusCode, str]:
    """Send serialized bytes (a list of them for a request stream) with no (de)serializers;
    read every reply; the final status and details."""
    m = rpc.method
    try:
        if m.client_streaming:
            requests = iter([payload] if isinstance(payload, bytes) else list(payload))
            if m.server_streaming:
                list(channel.stream_stream(rpc.path)(requests, timeout=timeout_s,
                                                     metadata=metadata))
            else:
                channel.stream_unary(rpc.path)(requests, timeout=timeout_s, metadata=metadata)
        elif m.server_streaming:
            list(channel.unary_stream(rpc.path)(payload, timeout=timeout_s, metadata=metadata))
        else:
            channel.unary_unary(rpc.path)(payload, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""
