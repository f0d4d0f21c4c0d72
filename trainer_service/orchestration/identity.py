"""Which samplers the trainer accepts: a SplitRL sampler of this model, once per process.

A sampler reports, in ``GetInfo``, the architecture and every parameter's name and shape it
serves, and an instance id unique to its process. The trainer accepts a sampler whose
architecture and parameter shapes are its own (dtypes may differ: a sampler may serve bf16
from f32 master weights), and keeps one entry per instance however many addresses reach it
(``127.0.0.1:50300`` and ``dns:///localhost:50300`` are one sampler, and two concurrent pushes
to one process would fail each other).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from splitrl.v1 import sampler_pb2


class RefusedSampler(Exception):
    """An address is not a sampler this trainer can use; the message says why."""


@dataclass(frozen=True)
class ModelIdentity:
    """The architecture and parameter shapes a sampler must serve to take our weights; with
    LoRA also the fingerprint of the base checkpoint it must have loaded (an adapter push is
    applied to the sampler's own copy of the base)."""

    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    base_fingerprint: str | None = None

    @classmethod
    def of(cls, architecture: str, params: Mapping[str, np.ndarray],
           base_fingerprint: str | None = None) -> ModelIdentity:
        return cls(architecture, {n: tuple(int(d) for d in a.shape) for n, a in params.items()},
                   base_fingerprint)

    def mismatch(self, info: sampler_pb2.SamplerInfo) -> str | None:
        """Why ``info`` describes another model, or None when it is ours."""
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
            theirs = info.base_fingerprint
            if not theirs:
                problems.append("it keeps no base checkpoint for LoRA adapter pushes (start it "
                                "with the run's config: model.lora set)")
            elif theirs != self.base_fingerprint:
                problems.append(f"its base checkpoint differs from the trainer's (fingerprint "
                                f"{theirs[:19]}... instead of {self.base_fingerprint[:19]}...): "
                                "the LoRA adapters would apply to other weights; start it "
                                "from the trainer's model.path")
        return "; ".join(problems) or None
