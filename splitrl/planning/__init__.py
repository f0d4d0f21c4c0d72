"""Ahead-of-time plans: will this run compile and fit on that slice? (`splitrl plan`)

The trainer's and the sampler's real programs are built from a Hugging Face config.json alone
(abstract parameters, no weights) and compiled for a TPU topology through libtpu, without a
TPU, or for this host's CPU devices; the report gives per-device memory by category against
the chip's HBM and the largest batch that fits. See docs/plan.md.
"""

from splitrl.planning.report import ServiceReport, format_reports, plan_run
from splitrl.planning.targets import (
    LIBTPU_MISSING,
    PlanError,
    Target,
    cpu_target,
    libtpu_installed,
    tpu_target,
)

__all__ = [
    "LIBTPU_MISSING",
    "PlanError",
    "ServiceReport",
    "Target",
    "cpu_target",
    "format_reports",
    "libtpu_installed",
    "plan_run",
    "tpu_target",
]
