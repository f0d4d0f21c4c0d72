"""A fresh interpreter for tests of what a new process imports (a launcher, a service)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_prints(code: str, timeout_s: float = 120.0) -> list[str]:
    """The lines a new Python process prints running ``code`` from the repository root, with
    the hubs offline; AssertionError with its stderr if it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=timeout_s, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()
