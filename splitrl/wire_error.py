"""The weight-transfer contract's error, in a module of its own so that raising it costs no
import: the gRPC layer (``splitrl.serving``) raises it for an undecodable message of a push's
request stream, in every service, while ``splitrl.wire`` itself pulls in numpy and jax (a
lazy import there would be paid inside the first such request)."""

from __future__ import annotations

import grpc


class WireError(Exception):
    """A push violates the wire contract; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
