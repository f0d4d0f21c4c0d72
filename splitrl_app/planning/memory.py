"""Per-device memory of compiled programs, and the search for the largest batch that fits.

A service's peak per device is what it keeps between programs (parameters, optimizer state,
gradient accumulator, staged weights...: computed from the arrays' shardings) plus the largest
transient of the programs it runs (XLA's `memory_analysis()` of each compiled program:
temporaries, outputs that do not reuse a donated input, generated code). Both are what XLA
itself allocates on one device, so a plan on the CPU platform is checkable against the
live-array bytes of a real run (tests/splitrl/test_plan_cpu.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitrl import compile_lock

if TYPE_CHECKING:  # jax is imported where it is used: the launch estimate needs none of it
    import jax

# XLA:TPU refuses to compile a program that cannot fit and says how much it needed:
# "Used 20.51G of 15.48G hbm. Exceeded hbm capacity by 5.03G."
# A Pallas TPU kernel's name in a lowered program (the Mosaic custom call's attribute).
_KERNEL_NAME = re.compile(r'kernel_name\s*=\s*"([^"]+)"')
_USED = re.compile(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """What one compiled program allocates on each device beyond its arguments."""

    name: str
    arguments: int
    temporaries: int
    new_outputs: int  # outputs that do not reuse a donated argument's buffer
    code: int
    compile_seconds: float
    kernels: tuple[str, ...] = ()  # the Pallas kernels in the program, by name

    @property
    def transient(self) -> int:
        """Bytes alive only while the program runs (on top of its arguments)."""
        return self.temporaries + self.new_outputs + self.code


@dataclasses.dataclass
class Measurement:
    """One service compiled at one batch size: per-device bytes by category and the peak."""

    rows: int
    categories: dict[str, int]
    programs: list[ProgramMemory]
    capacity: int
    error: str | None = None  # a program the compiler refused (out of memory)
    needed: int | None = None  # the compiler's "Used X" when it refused one

    @property
    def peak(self) -> int | None:
        if self.error is not None:
            return self.needed
        return sum(self.categories.values())

    @property
    def fits(self) -> bool:
        peak = self.peak
        return self.error is None and peak is not None and peak <= self.capacity

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.programs)


def format_bytes(n: float | None, width: int = 8) -> str:
    """GiB from a quarter GiB up, else MiB ("?" for an unknown size)."""
    if n is None:
        return "?"
    gib = 1024**3
    return f"{n / gib:{width}.2f} GiB" if n >= gib // 4 else f"{n / 2**20:{width}.2f} MiB"


class OutOfMemory(Exception):
    def __init__(self, message: str, needed: int | None):
        super().__init__(message)
        self.needed = needed


def compile_program(name: str, lowered: jax.stages.Lowered) -> ProgramMemory:
    """Compiles `lowered`; raises OutOfMemory when the compiler finds it cannot fit."""
    kernels = tuple(sorted(set(_KERNEL_NAME.findall(lowered.as_text()))))
    start = time.perf_counter()
    try:
        # Not through the persistent compilation cache: a plan's executables are measured,
        # never run, and a TPU one cannot be read back from it (see splitrl.compile_lock).
        with compile_lock.without_cache():
            compiled = lowered.compile()
    except Exception as e:  # XlaRuntimeError; its type moved between jax versions
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            raise
        used = _USED.search(text)
        needed = int(float(used.group(1)) * _UNITS[used.group(2)]) if used else None
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise OutOfMemory(f"{name}: {first[:300]}", needed) from e
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"{name}: the compiler reports no memory analysis of the program "
                           "(the plan needs one to measure it)")
    return ProgramMemory(
        name=name,
        arguments=int(stats.argument_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        new_outputs=max(0, int(stats.output_size_in_bytes - stats.alias_size_in_bytes)),
        code=int(stats.generated_code_size_in_bytes),
        compile_seconds=seconds,
        kernels=kernels,
    )


def shard_bytes(tree) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs with NamedShardings): the
    largest per-device total, so uneven layouts count their fullest device."""
    import jax

    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        size = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + size
    return max(per_device.values(), default=0)


def largest_fitting(measure: Callable[[int], Measurement], base: Measurement, step: int,
                    limit: int, max_compiles: int = 4) -> tuple[Measurement | None, int | None]:
    """(the measurement at the largest multiple of `step` rows <= `limit` found to fit, the
    smallest row count found not to fit or None).

    Peak memory grows about linearly in the rows, so a second compile (twice or half the base
    rows) predicts the answer and the next one checks it; then bisection, until the gap is
    within a sixteenth (or one step), or `max_compiles` more compiles were made. (None, ...)
    when not even `step` rows fit.
    """
    seen: dict[int, Measurement] = {base.rows: base}
    lo, hi = 0, limit + step  # largest rows known to fit / smallest known not to

    def at(rows: float) -> Measurement:
        rows = max(step, min(limit, int(rows) // step * step))
        if rows not in seen:
            seen[rows] = measure(rows)
        return seen[rows]

    def record(m: Measurement) -> None:
        nonlocal lo, hi
        if m.fits:
            lo = max(lo, m.rows)
        else:
            hi = min(hi, m.rows)

    record(base)
    probe = at(2 * base.rows if base.fits else base.rows / 2)
    record(probe)
    pending: list[int] = []  # the linear prediction, then its neighbours
    if probe.rows != base.rows and base.peak is not None and probe.peak is not None:
        slope = (probe.peak - base.peak) / (probe.rows - base.rows)
        if slope > 0:
            guess = int(base.rows + (base.capacity - base.peak) / slope) // step * step
            pending = [guess, guess + step, guess - step]
    for _ in range(max_compiles):
        if hi - lo <= max(step, lo // 16):
            break
        while pending and not lo < pending[0] < hi:
            pending.pop(0)
        rows: float
        if pending:
            rows = pending.pop(0)
        elif hi > limit:
            rows = 2 * lo if lo else step
        else:
            rows = (lo + hi) / 2
        m = at(rows)
        if m.rows <= lo or m.rows >= hi:
            break
        record(m)
    return (seen[lo] if lo else None), (hi if hi <= limit else None)
