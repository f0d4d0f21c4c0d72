"""Why a call failed, as a typed field, when its status code alone does not tell the causes apart.

A gRPC status code says how a caller should react in general; sometimes one code covers causes
the caller must treat differently. A sampler's ``Rollout`` answers UNAVAILABLE both when the
sampler itself cannot serve (it is stopping) and when the reward service behind it is down: the
trainer blames the sampler in the first case and pauses dispatching to every sampler in the
second. The server names such a cause in the call's trailing metadata (``splitrl-cause``, one of
:class:`Cause`'s values) beside its message, and the client reads it with :func:`cause_of`; the
message is for people and is never parsed (the same scheme as ``splitrl.agreement``'s
``splitrl-differing-keys`` on a refused registration).
"""

from __future__ import annotations

import enum
from typing import NoReturn

import grpc

CAUSE_KEY = "splitrl-cause"


class Cause(enum.Enum):
    """A failure's cause, where the status code leaves it ambiguous."""

    # UNAVAILABLE from a sampler: its reward service cannot be reached or is not serving (or is
    # too busy to answer in time); rollouts cannot be scored, the sampler itself is fine.
    REWARD_UNAVAILABLE = "reward-unavailable"


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str,
          cause: Cause | None = None) -> NoReturn:
    """``context.abort(code, message)``, with ``cause`` in the trailing metadata if given."""
    if cause is not None:
        context.set_trailing_metadata(((CAUSE_KEY, cause.value),))
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # it raises; this keeps NoReturn honest


def cause_of(error: grpc.RpcError) -> Cause | None:
    """The cause a failed call's server named, or None (none named, or one this side does not
    know: a newer peer's cause is treated like no cause)."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    value = dict(metadata or ()).get(CAUSE_KEY)
    try:
        return Cause(value) if value is not None else None
    except ValueError:
        return None
