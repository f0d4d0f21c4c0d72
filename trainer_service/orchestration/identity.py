"""Which samplers the trainer accepts: a SplitRL sampler of this run, once per process.

A sampler reports, in ``GetInfo``, the settings a trainer must share with it
(``splitrl.agreement``: config fields such as ``trainer.steps``, the model's ``config.json``
fields, a tokenizer fingerprint), the architecture and every parameter's name and shape it
serves, and an instance id unique to its process. The trainer accepts a sampler whose settings,
architecture and parameter shapes are its own (dtypes may differ: a sampler may serve bf16
from f32 master weights) and refuses any other at registration, naming every differing key:
one check for another model and for another config. It keeps one entry per instance however
many addresses reach it (``127.0.0.1:50300`` and ``dns:///localhost:50300`` are one sampler,
and two concurrent pushes to one process would fail each other). Weights are not compared: a
sampler of the same model with other weights is reset to ours by its first push.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from splitrl.agreement import differences
from splitrl.v1 import sampler_pb2

if TYPE_CHECKING:
    import jax


class RefusedSampler(Exception):
    """An address is not a sampler this trainer can use; the message says why and ``keys``
    lists the settings that differ (``splitrl.agreement``), if any."""

    def __init__(self, message: str, keys: list[str] | None = None):
        super().__init__(message)
        self.keys = keys or []


@dataclass(frozen=True)
class ModelIdentity:
    """What a sampler must match to take our weights: the agreed settings (config, model,
    tokenizer), the architecture and parameter shapes it serves; with LoRA also the
    fingerprint of the base checkpoint it must have loaded (an adapter push is applied to the
    sampler's own copy of the base)."""

    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    base_fingerprint: str | None = None
    settings: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, architecture: str,
           params: Mapping[str, np.ndarray | jax.Array | jax.ShapeDtypeStruct],
           base_fingerprint: str | None = None,
           settings: Mapping[str, str] | None = None) -> ModelIdentity:
        return cls(architecture, {n: tuple(int(d) for d in a.shape) for n, a in params.items()},
                   base_fingerprint, dict(settings or {}))

    def differing_keys(self, info: sampler_pb2.SamplerInfo) -> list[str]:
        """The agreed settings ``info`` has other values for (none checked without ours)."""
        return [key for key, _, _ in differences(self.settings, info.agreed)] \
            if self.settings else []

    def mismatch(self, info: sampler_pb2.SamplerInfo) -> str | None:
        """Why ``info`` describes a sampler we cannot use, or None when it is ours."""
        differing = differences(self.settings, info.agreed) if self.settings else []
        if differing:
            return ("its settings differ from the trainer's (start it with the trainer's "
                    "config and model): " + "; ".join(
                        f"{key}: trainer {ours}, sampler {theirs}"
                        for key, ours, theirs in differing))
        if info.architecture != self.architecture:
            return (f"it serves architecture {info.architecture or '(none)'!r}, this trainer "
                    f"trains {self.architecture!r}")
        theirs = {p.name: tuple(int(d) for d in p.shape) for p in info.params}
        missing = sorted(set(self.shapes) - set(theirs))
        extra = sorted(set(theirs) - set(self.shapes))
        shapes = sorted(n for n in set(theirs) & set(self.shapes) if theirs[n] != self.shapes[n])
        problems = []
        if missing:
            problems.append(f"{len(missing)} of our parameters are missing, e.g. {missing[:3]}")
        if extra:
            problems.append(f"{len(extra)} parameters are not ours, e.g. {extra[:3]}")
        if shapes:
            n = shapes[0]
            problems.append(f"{len(shapes)} shapes differ, e.g. {n}: {list(theirs[n])} "
                            f"instead of {list(self.shapes[n])}")
        if not problems and self.base_fingerprint is not None:
            their_base = info.base_fingerprint
            if not their_base:
                problems.append("it keeps no base checkpoint for LoRA adapter pushes (start it "
                                "with the run's config: model.lora set)")
            elif their_base != self.base_fingerprint:
                problems.append(f"its base checkpoint differs from the trainer's (fingerprint "
                                f"{their_base[:19]}... instead of "
                                f"{self.base_fingerprint[:19]}...): "
                                "the LoRA adapters would apply to other weights; start it "
                                "from the trainer's model.path")
        return "; ".join(problems) or None
