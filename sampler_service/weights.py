"""The sampler's weights: a versioned, double-buffered copy of the policy on the sampler's mesh.

:class:`WeightStore` holds ``(version, nnx.State)`` behind a lock. Generation takes a
:meth:`~WeightStore.snapshot` at the start of a batch and keeps those arrays for the whole
batch, so a push never changes weights under a running generation.

A push (:meth:`WeightStore.apply_push`) is staged on the side:

1. the header's version must be newer than the serving one (else FAILED_PRECONDITION), unless
   ``header.reset`` is set (a trainer resumed from a checkpoint rolls samplers back);
2. every chunk is verified by :class:`splitrl.wire.ChunkAssembler` (names, dtypes, shapes,
   regions, offsets, duplicates, CRC-32) and assembled on the host one tensor at a time;
3. as soon as a tensor is complete it is placed on the sampler's mesh with the sampler's own
   ``NamedSharding`` (``jax.device_put``) and its host copy dropped, so host memory holds at
   most the tensors still in flight, not a second copy of the model;
4. once all tensors arrived (else INVALID_ARGUMENT naming the missing ones) and are on device,
   the new state replaces the old one in one assignment under the lock.

Any failure discards the staging copy; the old weights keep serving. Pushes are serialised:
a push that arrives while another is being received is refused at once with ABORTED (the
message names the version in progress) rather than queued, because a trainer pushes to one
sampler sequentially and a second concurrent pusher is a deployment error the operator should
see; the caller may retry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from splitrl import wire
from splitrl.mesh import param_shardings, spec_to_strings
from splitrl.models import TransformerConfig, hf_from_state, state_from_hf
from splitrl.v1 import sampler_pb2
from splitrl.wire import ChunkAssembler, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    version: int
    bytes_received: int
    chunks: int
    seconds: float
    swap_seconds: float


class WeightStore:
    """Versioned model state on the sampler's mesh; see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        state: nnx.State,
        mesh: Mesh,
        shardings: Mapping[str, NamedSharding],
        *,
        version: int = 0,
        max_chunk_bytes: int,
    ):
        self.config = config
        self.mesh = mesh
        self.shardings = dict(shardings)
        self.max_chunk_bytes = max_chunk_bytes
        flat = hf_from_state(state)
        self.manifest = {n: (wire.dtype_name(a.dtype), tuple(a.shape)) for n, a in flat.items()}
        self.fingerprint = wire.model_fingerprint(config.architecture, self.manifest)
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()
        self._pushing: tuple[int, str] | None = None
        self._version = version
        self._state = state
        self._digests: tuple[int, dict[str, str]] | None = None
        self._generation = 0  # swaps so far

    @classmethod
    def from_state(cls, config: TransformerConfig, state: nnx.State, mesh: Mesh, *,
                   strategy: str | None = None, version: int = 0,
                   max_chunk_bytes: int) -> WeightStore:
        """Place ``state`` on ``mesh`` with the partition rules' shardings for ``strategy``."""
        flat = hf_from_state(state)
        shardings = param_shardings(mesh, {n: a.shape for n, a in flat.items()}, strategy)
        placed = {n: jax.device_put(a, shardings[n]) for n, a in flat.items()}
        return cls(config, state_from_hf(config, placed), mesh, shardings, version=version,
                   max_chunk_bytes=max_chunk_bytes)

    # -- serving side ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def snapshot(self) -> tuple[int, nnx.State]:
        """The serving ``(version, state)``; keep using it for a whole batch."""
        with self._lock:
            return self._version, self._state

    def param_infos(self, include_digests: bool = False) -> list[sampler_pb2.ParamInfo]:
        """One ``ParamInfo`` per parameter, with the partition of the *served* arrays.

        With ``include_digests`` each carries :func:`splitrl.wire.array_digest` of the served
        tensor (gathered to the host once per version, then cached): equal to the sender's
        digest iff the weights are bitwise equal.
        """
        with self._lock:
            generation, state = self._generation, self._state
        flat = hf_from_state(state)
        digests = self._digests_of(generation, state) if include_digests else {}
        infos = []
        for name in sorted(flat):
            array = flat[name]
            spec = getattr(array.sharding, "spec", None)
            partition = spec_to_strings(spec, array.ndim) if spec is not None else []
            infos.append(sampler_pb2.ParamInfo(
                name=name, dtype=wire.dtype_name(array.dtype), shape=list(array.shape),
                partition=partition, digest=digests.get(name, "")))
        return infos

    def digests(self) -> dict[str, str]:
        """``{name: array_digest}`` of the serving weights (cached per swapped-in state)."""
        with self._lock:
            generation, state = self._generation, self._state
        return self._digests_of(generation, state)

    def _digests_of(self, generation: int, state: nnx.State) -> dict[str, str]:
        # Keyed by swap count, not version: a reset push may repeat a version.
        cached = self._digests
        if cached is not None and cached[0] == generation:
            return cached[1]
        out = {n: wire.array_digest(np.asarray(jax.device_get(a)))
               for n, a in hf_from_state(state).items()}
        self._digests = (generation, out)
        return out

    @property
    def push_in_progress(self) -> tuple[int, str] | None:
        return self._pushing

    # -- intake ---------------------------------------------------------------------------------

    def apply_push(self, messages: Iterable[sampler_pb2.WeightPushMessage]) -> PushResult:
        """Receive, verify, stage and swap in one push. Raises :class:`WireError`."""
        if not self._push_lock.acquire(blocking=False):
            busy = self._pushing
            what = f"version {busy[0]} from {busy[1] or 'an unnamed sender'}" if busy else "one"
            raise WireError(grpc.StatusCode.ABORTED,
                            f"another weight push ({what}) is in progress; pushes are applied "
                            "one at a time, retry when it finishes")
        try:
            return self._receive(iter(messages))
        finally:
            self._pushing = None
            self._push_lock.release()

    def _receive(self, messages) -> PushResult:
        start = time.perf_counter()
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            got = "nothing" if first is None else f"a {first.WhichOneof('kind')}"
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a push must start with a PushHeader, got {got}")
        header = first.header
        current = self.version
        if header.version <= current and not header.reset:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"push version {header.version} is not newer than the serving "
                            f"version {current}; versions must increase (or set "
                            "header.reset to roll back to a checkpoint's weights)")
        self._pushing = (header.version, header.sender)
        log.info("weight push started", extra={"push_version": header.version,
                                                "sender": header.sender,
                                                "total_bytes": header.total_bytes})
        assembler = ChunkAssembler(
            self.manifest, version=header.version, max_chunk_bytes=self.max_chunk_bytes,
            tensor_count=header.tensor_count, total_bytes=header.total_bytes)
        staged: dict[str, jax.Array] = {}
        for message in messages:
            kind = message.WhichOneof("kind")
            if kind != "chunk":
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"message #{assembler.chunks_received + 1}: expected a "
                                f"TensorChunk, got {kind or 'an empty message'}")
            done = assembler.add(message.chunk)
            if done is not None:
                staged[done] = jax.device_put(assembler.pop(done), self.shardings[done])
        assembler.finish()
        state = state_from_hf(self.config, staged)
        jax.block_until_ready(staged)
        swap_start = time.perf_counter()
        with self._lock:
            if header.version <= self._version and not header.reset:  # defensive
                raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"push version {header.version} is not newer than the serving "
                                f"version {self._version}")
            self._version, self._state = header.version, state
            self._generation += 1
        end = time.perf_counter()
        result = PushResult(header.version, assembler.bytes_received, assembler.chunks_received,
                            end - start, end - swap_start)
        log.info("weight push applied", extra={"weight_version": result.version,
                                                "bytes": result.bytes_received,
                                                "chunks": result.chunks,
                                                "seconds": round(result.seconds, 4),
                                                "swap_seconds": round(result.swap_seconds, 6)})
        return result
