"""Optional dependencies: what only some CLI commands use is an extra, not something every
service installs.

``matplotlib`` draws a run's plots (``splitrl plot``, the end of ``splitrl up`` and ``make
demo``: the ``plots`` extra); the ``kubernetes`` client talks to an API server (``splitrl k8s
scale/status/discover``: the ``k8s`` extra). A sampler, reward or trainer process needs
neither. :func:`require` imports one of them or says which extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """``import module``, or MissingExtra naming ``extra`` if its package is not installed."""
    package = module.partition(".")[0]
    try:
        importlib.import_module(package)
    except ImportError as e:
        if e.name != package:  # the package is there but something it imports failed
            raise
        raise MissingExtra(f"{needed_for} needs {package}, which is not installed: "
                           f"pip install 'splitrl[{extra}]'") from None
    return importlib.import_module(module)
