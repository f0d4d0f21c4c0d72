"""The sampler's weights: a versioned, double-buffered copy of the policy on the sampler's mesh.

:class:`WeightStore` holds ``(version, weights id, nnx.State)`` behind a lock. Generation takes
a :meth:`~WeightStore.snapshot` at the start of a batch and keeps those arrays for the whole
batch, so a push never changes weights under a running generation.

A push is a :class:`PushSession` (:meth:`WeightStore.begin_push`), whichever transport carries
it (gRPC ``PushWeights`` through :meth:`WeightStore.apply_push`, or the bulk data plane):

1. the header is checked first: the version must not be negative and must be newer than the
   serving one (else FAILED_PRECONDITION) unless ``header.reset`` (a trainer resumed from a
   checkpoint rolls samplers back; always a full push); a delta push (``header.base_id``) must
   name the weights this sampler serves. No upper bound: versions only grow and pushes are
   authenticated, so a run resumed with more steps keeps its samplers;
2. every chunk is verified by :class:`splitrl.wire.ChunkAssembler` (names, dtypes, shapes,
   regions, offsets, duplicates, CRC-32C; deltas decoded against the served bytes) and
   assembled on the host one tensor at a time;
3. the bytes are assembled per device shard of the sampler's own ``NamedSharding`` (in 64-byte
   aligned host buffers of the store's :class:`splitrl.wire.StagingPool`, reused from push to
   push once nothing refers to them; straight from the socket where the regions allow it) and
   every float chunk is checked for NaN/Inf as it lands; complete tensors go to their devices
   in batches (``jax.device_put`` of a host block per device shard: on CPU it aliases the
   buffer, no copy). A tensor a delta left bitwise unchanged keeps the served array;
4. :meth:`PushSession.finish`: all tensors arrived (else INVALID_ARGUMENT naming the missing
   ones), are on device, and are finite (else INVALID_ARGUMENT naming the tensors with NaN/Inf
   and how many: a diverged trainer must not poison the samplers);
5. :meth:`PushSession.swap`: if the sender is still there (``sender_alive``: connected, within
   its deadline as this sampler counts it; else CANCELLED: a push its sender gave up on is
   never applied), the new state replaces the old one in one assignment under the lock.

An **adapter push** (``header.lora``, LoRA runs) carries only the adapters' factors (whole,
float32). The sampler merges them into the base checkpoint it loaded at start and kept
(:meth:`WeightStore.keep_base`, when its config sets ``model.lora``): in :meth:`PushSession.
finish` every targeted weight becomes ``W + alpha / rank * A B`` on the sampler's mesh
(``splitrl.models.lora.merge``, bitwise what the trainer's own merge gives) and is checked
finite; the rest of the served state is the base's arrays themselves. Merging into the serving
weights rather than applying the adapters in the forward costs a second copy of the targeted
weights (the kept base) but nothing per generated token (``bench/lora_serving.py`` measures
both). A push for another base (``lora.base_fingerprint``), or to a sampler that kept none, is
refused with FAILED_PRECONDITION.

Any failure discards the staging copy; the old weights keep serving. Pushes are serialised:
a push that arrives while another is being received is refused at once with ABORTED (the
message names the version in progress) rather than queued, because a trainer pushes to one
sampler at a time and a second concurrent pusher is a deployment error the operator should
see; the caller may retry. How long a push may sit idle is the transport's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from splitrl import wire
from splitrl.mesh import param_shardings, spec_to_strings
from splitrl.models import TransformerConfig, hf_from_state, state_from_hf
from splitrl.models.lora import merge as merge_adapters
from splitrl.v1 import sampler_pb2, tensor_pb2
from splitrl.wire import ChunkAssembler, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    version: int
    bytes_received: int  # payload bytes on the wire
    chunks: int
    seconds: float
    swap_seconds: float
    decoded_bytes: int = 0  # the weights' bytes (more than bytes_received for a delta)


@jax.jit
def _finite_shard(x: jax.Array) -> jax.Array:
    """False iff ``x`` holds a NaN or an Inf: max(|x|) is NaN or Inf then (one read of x)."""
    return jnp.isfinite(jnp.max(jnp.abs(x))) if x.size else jnp.bool_(True)


def _finite(array: jax.Array) -> list[jax.Array]:
    """:func:`_finite_shard` of every shard, each on the device that holds it, for weights
    computed on the sampler (adapters merged into the base); received bytes are checked on
    the host as they land (:func:`splitrl.wire.has_nonfinite`)."""
    return [_finite_shard(s.data) for s in array.addressable_shards if s.replica_id == 0]


def _bounds(index: tuple[slice, ...] | None, shape) -> wire.Bounds:
    """The ``[start, stop)`` per dim of a shard's index (``jax`` gives slices)."""
    assert index is not None  # jax types it optional; a NamedSharding's shards have one
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def _block_bounds(sharding: NamedSharding, shape) -> list[wire.Bounds]:
    """The distinct blocks of a tensor this process's devices hold (replicas once), sorted."""
    indices = sharding.addressable_devices_indices_map(tuple(shape)).values()
    return sorted({_bounds(index, shape) for index in indices})


def _count_nonfinite(array: jax.Array) -> int:
    """For the error message only (a push that is refused anyway)."""
    return sum(int(np.count_nonzero(~np.isfinite(np.asarray(s.data, np.float32))))
               for s in array.addressable_shards if s.replica_id == 0)


class PushSession:
    """One push being received: verified, staged on the sampler's mesh, then swapped in.

    Created by :meth:`WeightStore.begin_push` holding the store's push lock; :meth:`close`
    (or leaving the ``with`` block) releases it and drops whatever was staged.
    """

    def __init__(self, store: WeightStore, header: sampler_pb2.PushHeader):
        self.store = store
        self.header = header
        self.started = time.perf_counter()
        served = store._flat if header.base_id else {}  # the push lock keeps it current
        self._served = served
        # An adapter push: the adapters' factors, whole, on the host until finish() merges.
        self.lora = (wire.spec_from_header(header.lora, store.config)
                     if header.HasField("lora") else None)
        self._adapters: dict[str, np.ndarray] = {}
        manifest = store.manifest
        blocks: dict[str, list[wire.Bounds]] | None = store.block_bounds
        if self.lora is not None:
            manifest = {n: (wire.ADAPTER_DTYPE, shape)
                        for n, shape in self.lora.shapes(store.config).items()}
            blocks = None
        self.assembler = ChunkAssembler(
            manifest, version=header.version, max_chunk_bytes=store.max_chunk_bytes,
            tensor_count=header.tensor_count, total_bytes=header.total_bytes,
            base=(lambda name: np.asarray(jax.device_get(served[name]))) if served else None,
            blocks=blocks, allocate=store.staging.take)
        self.staged: dict[str, jax.Array] = {}
        self._finite: dict[str, list[jax.Array]] = {}  # weights merged here (adapter pushes)
        self._finished = False
        self._closed = False

    # -- chunks -----------------------------------------------------------------------------

    def add(self, chunk: tensor_pb2.TensorChunk, payload=None) -> None:
        """One chunk whose bytes are ``payload`` (default ``chunk.data``)."""
        self._place(self.assembler.add(chunk, payload))

    def reserve(self, chunk: tensor_pb2.TensorChunk, size: int) -> memoryview:
        """Where to receive a RAW chunk's ``size`` bytes; then :meth:`commit`."""
        return self.assembler.reserve(chunk, size)

    def commit(self) -> None:
        self._place(self.assembler.commit())

    def _place(self, name: str | None) -> None:
        if name is None:
            return
        if self.lora is not None:
            self._adapters[name] = self.assembler.pop(name)
            return
        if self.header.base_id and not self.assembler.modified(name):
            self.assembler.pop(name)
            self.staged[name] = self._served[name]  # bitwise equal: keep the served array
            return
        self.staged[name] = self._to_devices(name, self.assembler.pop_blocks(name))

    def _to_devices(self, name: str, blocks: Mapping[wire.Bounds, np.ndarray]) -> jax.Array:
        """A complete tensor on its devices, each device shard made from the host block the
        assembler filled for it (64-byte aligned: XLA:CPU aliases it, no copy). One
        ``make_array_from_callback`` per tensor makes every shard in one native call, rather
        than a ``device_put`` per shard and assembling the shards (a replicated tensor's one
        block serves every device)."""
        shape = self.store.manifest[name][1]
        return jax.make_array_from_callback(shape, self.store.shardings[name],
                                            lambda index: blocks[_bounds(index, shape)])

    # -- completion -------------------------------------------------------------------------

    def finish(self) -> None:
        """Every tensor arrived, is on device and is finite; else :class:`WireError`."""
        self.assembler.finish()
        if self.lora is not None:
            self._merge_adapters()
        jax.block_until_ready(self.staged)
        finite = jax.device_get(self._finite)
        bad = sorted({*self.assembler.nonfinite_names(),
                      *(n for n, flags in finite.items() if not all(bool(f) for f in flags))})
        if bad:
            names = ", ".join(f"{n!r} ({_count_nonfinite(self.staged[n])} of "
                              f"{self.staged[n].size} values)" for n in bad[:5])
            more = f" ... (+{len(bad) - 5} more)" if len(bad) > 5 else ""
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"push version {self.header.version} has non-finite values (NaN or "
                            f"Inf) in {len(bad)} tensors: {names}{more}; not applied, version "
                            f"{self.store.version} still serving")
        self._finished = True

    def _merge_adapters(self) -> None:
        """Stage the kept base with the received adapters merged (on the sampler's mesh)."""
        bad = sorted(n for n, a in self._adapters.items() if not np.isfinite(a).all())
        if bad:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"adapter push version {self.header.version} has non-finite values "
                            f"(NaN or Inf) in {len(bad)} tensors, e.g. {bad[:3]}; not applied, "
                            f"version {self.store.version} still serving")
        # An adapter push (lora set) is accepted only by a store that keeps its base.
        assert self.lora is not None and self.store._base is not None
        self.staged = merge_adapters(self.store._base, self._adapters, self.lora)
        for target in self.lora.targets:
            name = f"{target}.weight"
            self._finite[name] = _finite(self.staged[name])

    def swap(self, sender_alive: Callable[[], bool] = lambda: True) -> PushResult:
        """Swap the staged weights in, unless the sender has gone (CANCELLED)."""
        if not self._finished:
            raise RuntimeError("swap() before finish()")
        store, header = self.store, self.header
        wire.build_shard_lists(self.staged.values())
        state = state_from_hf(store.config, self.staged)
        swap_start = time.perf_counter()
        with store._lock:
            if not sender_alive():
                raise WireError(grpc.StatusCode.CANCELLED,
                                f"the sender of push version {header.version} went away (it "
                                "cancelled, disconnected or passed its deadline) before the "
                                f"swap; not applied, version {store._version} still serving")
            store._version, store._state, store._flat = header.version, state, self.staged
            store._weights_id = header.push_id
            store._generation += 1
        end = time.perf_counter()
        result = PushResult(header.version, self.assembler.payload_bytes,
                            self.assembler.chunks_received, end - self.started, end - swap_start,
                            self.assembler.bytes_received)
        log.info("weight push applied", extra={
            "weight_version": result.version, "bytes": result.bytes_received,
            "decoded_bytes": result.decoded_bytes, "chunks": result.chunks,
            "delta": bool(header.base_id), "adapters": self.lora is not None,
            "seconds": round(result.seconds, 4),
            "swap_seconds": round(result.swap_seconds, 6)})
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.staged, self._finite, self._served, self._adapters = {}, {}, {}, {}
        del self.assembler  # its blocks go back to the staging pool
        self.store.staging.trim()
        self.store._pushing = None
        self.store._push_lock.release()

    def __enter__(self) -> PushSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        wire.build_shard_lists(flat.values())
        self.manifest = {n: (wire.dtype_name(a.dtype), tuple(a.shape)) for n, a in flat.items()}
        # The blocks of each tensor the devices hold: a push is assembled in these.
        self.block_bounds = {n: _block_bounds(self.shardings[n], a.shape)
                             for n, a in flat.items()}
        self.fingerprint = wire.model_fingerprint(config.architecture, self.manifest)
        self.staging = wire.StagingPool()  # host buffers pushes are assembled in
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()
        self._pushing: tuple[int, str] | None = None
        self._version = version
        self._weights_id = ""  # the push_id of the served weights; "" = the checkpoint's
        self._state = state
        self._flat = flat  # the served arrays by name (the leaves of _state), swapped with it
        self._digests: tuple[int, dict[str, str]] | None = None
        self._generation = 0  # swaps so far
        # The checkpoint's weights, kept for adapter pushes (keep_base), and their fingerprint.
        self._base: dict[str, jax.Array] | None = None
        self.base_fingerprint = ""

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

    def keep_base(self, fingerprint: str) -> None:
        """Keep the weights serving now (the checkpoint's, before any push) as the base that
        adapter pushes are merged into; ``fingerprint`` names it
        (``splitrl.models.hf_io.checkpoint_fingerprint`` of the checkpoint directory)."""
        with self._lock:
            if self._weights_id or self._generation:
                raise RuntimeError("keep_base() must be called before any push: the base is "
                                   "the checkpoint's weights")
            self._base = dict(self._flat)
            self.base_fingerprint = fingerprint

    # -- serving side ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    @property
    def weights_id(self) -> str:
        with self._lock:
            return self._weights_id

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
            generation, flat = self._generation, self._flat
        digests = self._digests_of(generation, flat) if include_digests else {}
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
            generation, flat = self._generation, self._flat
        return self._digests_of(generation, flat)

    def _digests_of(self, generation: int, flat: Mapping[str, jax.Array]) -> dict[str, str]:
        # Keyed by swap count, not version: a reset push may repeat a version.
        cached = self._digests
        if cached is not None and cached[0] == generation:
            return cached[1]
        out = {n: wire.array_digest(np.asarray(jax.device_get(a))) for n, a in flat.items()}
        self._digests = (generation, out)
        return out

    def warm_up(self) -> None:
        """Allocate (and fault in) the staging buffers of one push now, so that not even the
        first push pays for fresh pages. A sampler keeping a base for adapter pushes instead
        compiles the NaN/Inf check of the weights it merges (its pushes are adapters)."""
        if self._base is not None:
            arrays = [a for a in self._base.values()
                      if wire.dtype_name(a.dtype) in wire.FLOAT_DTYPES]
            jax.block_until_ready([_finite(a) for a in arrays])
            return
        if self._push_lock.locked():
            return  # a push is already taking its own (never hold the push lock here: a
            # push arriving meanwhile would be refused)
        self.staging.prefill(
            [(tuple(b - a for a, b in bounds), wire.numpy_dtype(self.manifest[name][0]))
             for name, blocks in self.block_bounds.items() for bounds in blocks])

    @property
    def push_in_progress(self) -> tuple[int, str] | None:
        return self._pushing

    # -- intake ---------------------------------------------------------------------------------

    def check_header(self, header: sampler_pb2.PushHeader) -> None:
        """Raise :class:`WireError` unless ``header`` may be applied on top of what serves."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if header.version < 0:
            raise WireError(invalid, f"push version {header.version} is negative; versions "
                            "count the trainer's updates from 0")
        if header.reset and header.base_id:
            raise WireError(invalid, f"push version {header.version} is a reset and a delta "
                            f"(base_id {header.base_id!r}); a reset must be a full push")
        if header.HasField("lora"):
            self._check_adapter_header(header)
        with self._lock:
            current, weights_id = self._version, self._weights_id
        if header.version <= current and not header.reset:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"push version {header.version} is not newer than the serving "
                            f"version {current}; versions must increase (or set "
                            "header.reset to roll back to a checkpoint's weights)")
        if header.base_id and header.base_id != weights_id:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"delta push version {header.version} is against base "
                            f"{header.base_id!r}, but the sampler serves "
                            f"{weights_id or 'the checkpoint'!r} (version {current}); send a "
                            "full push")

    def _check_adapter_header(self, header: sampler_pb2.PushHeader) -> None:
        if header.base_id:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"adapter push version {header.version} names base_id "
                            f"{header.base_id!r}: adapter pushes carry every adapter, never a "
                            "delta")
        theirs = header.lora.base_fingerprint
        if self._base is None:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"adapter push version {header.version}: this sampler keeps no base "
                            "checkpoint for LoRA adapters (model.lora is unset in its config); "
                            "start it with the run's config, or push full weights")
        if theirs != self.base_fingerprint:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"adapter push version {header.version} is for the base checkpoint "
                            f"{theirs or '(none given)'}, but this sampler's base is "
                            f"{self.base_fingerprint}: the adapters would apply to other "
                            "weights; start it from the trainer's model.path")
        wire.spec_from_header(header.lora, self.config)

    def begin_push(self, header: sampler_pb2.PushHeader, *,
                   deadline: float | None = None) -> PushSession:
        """Take the push lock (ABORTED if another push holds it), check ``header``, and return
        the session that receives the push. ``deadline`` (seconds since the epoch) is the
        sender's deadline as this sampler holds it, for the log line (gRPC pushes)."""
        if not self._push_lock.acquire(blocking=False):
            busy = self._pushing
            what = f"version {busy[0]} from {busy[1] or 'an unnamed sender'}" if busy else "one"
            raise WireError(grpc.StatusCode.ABORTED,
                            f"another weight push ({what}) is in progress; pushes are applied "
                            "one at a time, retry when it finishes")
        try:
            self.check_header(header)
            self._pushing = (header.version, header.sender)
            log.info("weight push started", extra={
                "push_version": header.version, "sender": header.sender,
                "total_bytes": header.total_bytes, "delta": bool(header.base_id),
                "reset": header.reset, "deadline": deadline})
            return PushSession(self, header)
        except BaseException:
            self._pushing = None
            self._push_lock.release()
            raise

    def apply_push(self, messages: Iterable[sampler_pb2.WeightPushMessage], *,
                   sender_alive: Callable[[], bool] = lambda: True,
                   deadline: float | None = None) -> PushResult:
        """Receive, verify, stage and swap in one push given as ``WeightPushMessage``s (the
        gRPC transport, ``deadline`` the call's). Raises :class:`WireError`."""
        messages = iter(messages)
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            got = "nothing" if first is None else f"a {first.WhichOneof('kind')}"
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a push must start with a PushHeader, got {got}")
        with self.begin_push(first.header, deadline=deadline) as session:
            for message in messages:
                kind = message.WhichOneof("kind")
                if kind != "chunk":
                    raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"message #{session.assembler.chunks_received + 1}: expected "
                                    f"a TensorChunk, got {kind or 'an empty message'}")
                if message.chunk.payload_bytes:
                    raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"message #{session.assembler.chunks_received + 1}: "
                                    "payload_bytes is for the bulk data plane; over gRPC the "
                                    "bytes go in TensorChunk.data")
                session.add(message.chunk)
            session.finish()
            return session.swap(sender_alive)
