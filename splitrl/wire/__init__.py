"""Tensors on the wire: bounded, checksummed chunks of (regions of) named parameters.

This package is the whole weight-transfer contract between the trainer's publisher and the
sampler's receiver (``TensorChunk`` / ``PushHeader`` in ``protos/splitrl/v1``), whichever
transport carries it (gRPC ``PushWeights`` or the bulk data plane, ``splitrl.dataplane``). It
is pure: no network calls, no global state.

Sender (:func:`push_header`, :func:`iter_push_frames`; :func:`iter_push_messages` for gRPC)
    A header, then for every parameter the *regions* the receiver's layout needs: each of the
    receiver's device blocks (from ``GetInfo``: each parameter's partition strings and the
    mesh's axis sizes) is one region. So:

    - the sender never gathers a whole tensor: it copies each shard to the host
      (``np.asarray(shard.data)``, zero-copy for CPU devices) and casts it to the receiver's
      dtype once; a region inside one shard where it is contiguous there goes straight from
      that memory, any other is gathered from the shards a slab of whole rows (at most one
      chunk) at a time into a reused buffer (the payload of a frame is valid until the next
      frame is drawn);
    - every chunk is one contiguous run of one receiver block, so a receiver can land it in
      place (and route each region straight to the device that owns that block);
    - replicas are sent once (shards with ``replica_id == 0``).

    Without the receiver's layout each sender shard is one region.

    With the blocks of the weights the receiver serves (``base``), a chunk goes as a delta (only
    the elements that changed: SPARSE or BITMAP, see ``_delta.py``) when that is smaller. Byte
    order is little-endian.

Receiver (:class:`ChunkAssembler`)
    Checks every chunk against the receiver's manifest ``{name: (dtype, shape)}``: known name,
    version, chunk size, dtype, shape, region bounds, byte range, CRC-32C of the decoded bytes,
    overlaps and duplicates (between regions and between chunks of a region), and at
    :meth:`ChunkAssembler.finish` that every tensor arrived completely and the byte count matches
    the header. RAW bytes can be received straight into their place (:meth:`~ChunkAssembler.
    reserve` / :meth:`~ChunkAssembler.commit`), into buffers a :class:`StagingPool` reuses
    from push to push, and every float chunk is checked for NaN/Inf while it is in the cache
    (:func:`has_nonfinite`). A tensor is returned as a numpy array the moment
    its last byte arrives, so the caller can place it on devices while later tensors are still in
    flight.

Adapter pushes (``_adapters.py``): with LoRA the push carries the adapters' factors, whole and
float32, and ``PushHeader.lora`` says which base checkpoint they belong to; the receiver merges
them into its own copy of that base.

Every violation raises :class:`WireError`, carrying the gRPC status code to return and a
message naming the parameter, the field, the value received and the expectation.
"""

from splitrl.wire._adapters import (
    ADAPTER_DTYPE,
    adapter_header,
    adapter_layouts,
    spec_from_header,
)
from splitrl.wire._assembler import ChunkAssembler
from splitrl.wire._core import (
    FLOAT_DTYPES,
    array_digest,
    byte_view,
    checksum,
    dtype_name,
    has_nonfinite,
    model_fingerprint,
    numpy_dtype,
)
from splitrl.wire._delta import (
    BITMAP,
    RAW,
    SPARSE,
    delta_apply,
    delta_encode,
    sparse_apply,
    sparse_encode,
)
from splitrl.wire._layout import (
    Bounds,
    SenderBlock,
    TargetLayout,
    build_shard_lists,
    layout_from_sharding,
    layouts_from_info,
    plan_regions,
    sender_blocks,
    target_blocks,
)
from splitrl.wire._sender import (
    BaseBlocks,
    BlockSink,
    Frame,
    check_targets,
    iter_push_frames,
    iter_push_messages,
    iter_region_chunks,
    iter_region_frames,
    iter_tensor_chunks,
    iter_tensor_frames,
    push_header,
)
from splitrl.wire._staging import StagingPool
from splitrl.wire_error import WireError

__all__ = [
    "ADAPTER_DTYPE", "adapter_header", "adapter_layouts", "spec_from_header",
    "BITMAP", "FLOAT_DTYPES", "RAW", "SPARSE", "BaseBlocks", "BlockSink", "Bounds",
    "ChunkAssembler", "Frame", "SenderBlock", "StagingPool", "TargetLayout", "WireError",
    "array_digest", "build_shard_lists", "byte_view",
    "check_targets", "checksum", "delta_apply", "delta_encode", "dtype_name",
    "has_nonfinite", "iter_push_frames", "iter_push_messages",
    "iter_region_chunks", "iter_region_frames", "iter_tensor_chunks", "iter_tensor_frames",
    "layout_from_sharding", "layouts_from_info", "model_fingerprint", "numpy_dtype",
    "plan_regions", "push_header", "sender_blocks", "sparse_apply", "sparse_encode",
    "target_blocks",
]
