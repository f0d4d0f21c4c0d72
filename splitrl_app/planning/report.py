"""`splitrl plan`: compile a run's programs for its targets and report memory per device.

    reports = plan_run(cfg, model_config, {"trainer": target, "sampler": target}, search=True)
    print(format_reports(reports)); exit_code = 0 if all(r.fits for r in reports) else 1
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from splitrl.config import Config
from splitrl.models import TransformerConfig
from splitrl_app.planning.memory import Measurement, format_bytes, largest_fitting
from splitrl_app.planning.targets import GIB, Target

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclasses.dataclass
class ServiceReport:
    service: str
    target: Target
    mesh: dict[str, int]
    unit: str
    shape: str  # the configured shape, described
    measurement: Measurement  # at the configured batch
    largest: Measurement | None = None  # the largest batch found to fit (if searched)
    largest_shape: str | None = None
    first_failing: int | None = None  # the smallest batch found not to fit (if searched)
    searched: bool = False

    @property
    def fits(self) -> bool:
        return self.measurement.fits

    def to_json(self) -> dict[str, Any]:
        m = self.measurement
        out = {
            "service": self.service, "target": self.target.name,
            "device_kind": self.target.device_kind, "devices": len(self.target.devices),
            "hbm_bytes": self.target.hbm_bytes, "mesh": self.mesh, "shape": self.shape,
            "rows": m.rows, "bytes": m.categories, "peak_bytes": m.peak, "fits": m.fits,
            "error": m.error,
            "programs": [dataclasses.asdict(p) for p in m.programs],
            "compile_seconds": m.compile_seconds,
        }
        if self.searched:
            out["largest_fitting"] = None if self.largest is None else {
                "rows": self.largest.rows, "shape": self.largest_shape,
                "peak_bytes": self.largest.peak}
            out["first_not_fitting"] = self.first_failing
        return out


def plan_service(planner, *, search: bool) -> ServiceReport:
    """Compiles `planner`'s programs at its configured batch (and, with `search`, finds the
    largest batch that fits)."""
    base = planner.measure(planner.rows)
    report = ServiceReport(
        service=planner.service, target=planner.target, mesh=dict(planner.mesh.shape),
        unit=planner.unit, shape=planner.describe(planner.rows), measurement=base)
    if search:
        largest, failing = largest_fitting(planner.measure, base, planner.step, planner.limit)
        report.searched = True
        report.largest, report.first_failing = largest, failing
        report.largest_shape = None if largest is None else planner.describe(largest.rows)
    return report


def plan_run(cfg: Config, model_config: TransformerConfig, targets: dict[str, Target], *,
             search: bool = True, extrapolate_layers: bool = False) -> list[ServiceReport]:
    """One report per service in `targets` ("trainer", "sampler"; "reward": one per reward model
    of `reward.models`, at full depth); with `extrapolate_layers` the trainer's and sampler's
    from compiles of two and three of the model's layers (`LayerExtrapolation`)."""
    from splitrl_app.planning.services import (
        RewardModelPlanner,
        SamplerPlanner,
        TrainerPlanner,
    )

    planners = {"trainer": TrainerPlanner, "sampler": SamplerPlanner}
    reports = []
    for name, target in targets.items():
        if name == "reward":  # each reward model at full depth (its own checkpoint's config)
            reports += [plan_service(RewardModelPlanner(cfg, model, target), search=search)
                        for model in cfg.reward.models]
            continue
        make = lambda config, kind=planners[name], target=target: kind(cfg, config, target)
        planner = (LayerExtrapolation(make, model_config) if extrapolate_layers
                   else make(model_config))
        reports.append(plan_service(planner, search=search))
    return reports


class LayerExtrapolation:
    """A planner for a deep model from compiles of the same model cut to two and to three
    layers, extrapolated linearly to its depth (`splitrl plan --extrapolate-layers`).

    The model's forward scans its layers, so a full-depth compile costs about what a shallow
    one does and is the reference; this remains for quick looks. Two and three layers, not
    one and two: XLA compiles a one-trip loop as straight-line code, whose buffers are not the
    loop's. Every category is linear in the number of layers: parameters,
    optimizer state, gradients and KV cache exactly (embeddings + L x a layer's), temporaries
    approximately (each layer keeps its activations for the backward pass; XLA may schedule
    the full program differently, e.g. rematerialise to fit, so the full compile stays the
    reference). Shapes, shardings and the searched batch are the full model's.
    """

    # The full model's, copied in __init__.
    service: str
    unit: str
    target: Target
    mesh: Mesh
    rows: int
    step: int
    limit: int

    def __init__(self, make, model_config: TransformerConfig):
        self.full = make(model_config)
        self.layers = model_config.num_layers
        self.base = min(2, max(1, self.layers - 1))  # a deeper model's two compiles: 2, 3
        self.parts = [make(dataclasses.replace(model_config, num_layers=n))
                      for n in (self.base, self.base + 1)]
        for name in ("service", "unit", "target", "mesh", "rows", "step", "limit"):
            setattr(self, name, getattr(self.full, name))

    def describe(self, rows: int) -> str:
        return (f"{self.full.describe(rows)}; {self.layers} layers extrapolated from compiles "
                f"of {self.base} and {self.base + 1}")

    def measure(self, rows: int) -> Measurement:
        one, two = (part.measure(rows) for part in self.parts)
        programs = [dataclasses.replace(p, name=f"{p.name}[{n} layer{'s' * (n > 1)}]")
                    for n, m in ((self.base, one), (self.base + 1, two)) for p in m.programs]
        capacity = self.target.hbm_bytes
        if one.error or two.error:
            return Measurement(rows, {}, programs, capacity, error=one.error or two.error)
        per_layer = {k: two.categories[k] - one.categories[k] for k in two.categories}
        categories = {k: max(0, one.categories[k] + per_layer[k] * (self.layers - self.base))
                      for k in two.categories}
        return Measurement(rows, categories, programs, capacity)


def format_report(r: ServiceReport) -> str:
    m = r.measurement
    mesh = " x ".join(f"{k}={v}" for k, v in r.mesh.items())
    lines = [f"{r.service}: {r.target.describe()}, mesh {mesh}", f"  {r.shape}"]
    if m.error is None:
        assert m.peak is not None  # a measurement without error: its categories' sum
        for name, value in m.categories.items():
            lines.append(f"  {name:<22}{format_bytes(value)}")
        lines.append(f"  {'peak per device':<22}{format_bytes(m.peak)} of "
                     f"{r.target.hbm_bytes / GIB:.2f} GiB "
                     f"({100 * m.peak / r.target.hbm_bytes:.0f}%): "
                     f"{'fits' if m.fits else 'DOES NOT FIT'}")
        lines.append("  compiled: " + ", ".join(
            f"{p.name} {p.compile_seconds:.1f} s" for p in m.programs))
        lines.extend(f"  Pallas kernels in {p.name}: {', '.join(p.kernels)}"
                     for p in m.programs if p.kernels)
    else:
        needed = "" if m.needed is None else f" (needs about {m.needed / GIB:.2f} GiB)"
        lines.append(f"  DOES NOT FIT: the compiler refused {m.error}{needed}")
    if r.searched:
        if r.largest is None:
            lines.append(f"  largest that fits: none (not even {r.first_failing} {r.unit})")
        else:
            above = (" (the search's limit: more was not tried)" if r.first_failing is None
                     else f"; {r.first_failing} {r.unit} do not")
            assert r.largest.peak is not None  # it fits: no error
            lines.append(f"  largest that fits: {r.largest_shape}, peak "
                         f"{r.largest.peak / GIB:.2f} GiB{above}")
    return "\n".join(lines)


def format_reports(reports: list[ServiceReport]) -> str:
    return "\n\n".join(format_report(r) for r in reports)
