"""Adapter pushes: the ``PushHeader.lora`` description and the receiver's layout of adapters.

An adapter push carries a LoRA adapter's factors instead of the model's weights (see
``LoraAdapters`` in ``protos/splitrl/v1/sampler.proto``): every ``<target>.lora_A.weight`` and
``<target>.lora_B.weight``, float32 and whole (they are small; the receiver merges them into its
own base checkpoint on its own mesh, ``splitrl.models.lora.merge``).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from splitrl.models.config import TransformerConfig
from splitrl.models.lora import LoraSpec
from splitrl.v1 import sampler_pb2
from splitrl.wire._core import WireArray
from splitrl.wire._layout import TargetLayout
from splitrl.wire_error import WireError

ADAPTER_DTYPE = "float32"


def adapter_header(spec: LoraSpec, base_fingerprint: str) -> sampler_pb2.LoraAdapters:
    """``PushHeader.lora`` for adapters of ``spec`` trained on the base ``base_fingerprint``."""
    return sampler_pb2.LoraAdapters(rank=spec.rank, alpha=spec.alpha,
                                    target_modules=list(spec.targets),
                                    base_fingerprint=base_fingerprint)


def spec_from_header(lora: sampler_pb2.LoraAdapters, config: TransformerConfig) -> LoraSpec:
    """The :class:`LoraSpec` an adapter push describes, checked against the receiver's model;
    :class:`WireError` (INVALID_ARGUMENT) naming the field otherwise."""
    try:
        spec = LoraSpec(int(lora.rank), float(lora.alpha), tuple(lora.target_modules))
        spec.shapes(config)  # every target is a Linear module of this model
    except ValueError as e:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"header.lora: {e}") from None
    if not lora.alpha > 0:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"header.lora.alpha: expected > 0, got {lora.alpha}")
    return spec


def adapter_layouts(info: sampler_pb2.SamplerInfo, adapters: Mapping[str, WireArray]
                    ) -> dict[str, TargetLayout]:
    """How a sampler (its ``GetInfo``) receives ``adapters``: whole float32 tensors."""
    axes = tuple(zip(info.mesh.axis_names, (int(s) for s in info.mesh.axis_sizes), strict=True))
    return {name: TargetLayout((), axes, ADAPTER_DTYPE, tuple(int(d) for d in array.shape))
            for name, array in adapters.items()}
