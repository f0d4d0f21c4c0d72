"""Ahead-of-time plans: will this run compile and fit on that slice? (`splitrl plan`)

The trainer's and the sampler's real programs are built from a Hugging Face config.json alone
(abstract parameters, no weights) and compiled for a TPU topology through libtpu, without a
TPU, or for this host's CPU devices; the report gives per-device memory by category against
the chip's HBM and the largest batch that fits. See docs/plan.md.
"""

# The names below import jax; loaded on first use, so that `splitrl_app.planning.estimate` (what
# `splitrl up` runs before anything starts) costs no jax import.
_EXPORTS = {
    "ServiceReport": "report", "format_reports": "report", "plan_run": "report",
    "LIBTPU_MISSING": "targets", "PlanError": "targets", "Target": "targets",
    "cpu_target": "targets", "libtpu_installed": "targets", "tpu_target": "targets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
