"""Helpers for the multi-process end-to-end tests: configs, waiting on a run, reading records."""

from __future__ import annotations

import json
import time
from pathlib import Path

from splitrl.config import Config, load_config
from trainer_service.launcher import Launcher, demo_config_path


def run_config(model_dir: Path, run_dir: Path, *overrides: str) -> Config:
    """The demo config pointed at a test model and run directory."""
    return load_config(
        demo_config_path(),
        [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", *overrides],
    )


def wait_for(predicate, timeout_s: float, what: str, launcher: Launcher | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher is not None:
            trainer = launcher.procs.get("trainer")
            if trainer is not None and trainer.poll() is not None and trainer.returncode != 0:
                raise AssertionError(
                    f"trainer exited with {trainer.returncode} while waiting for {what}:\n"
                    + tail(launcher.log_dir / "trainer.log")
                )
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def status_step(launcher: Launcher) -> int:
    try:
        return launcher.status().step
    except Exception:
        return -1


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def trained_records(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def wait_exit(launcher: Launcher, name: str, timeout_s: float) -> int:
    proc = launcher.procs[name]
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name} still running after {timeout_s:.0f}s:\n" + tail(launcher.log_dir /
                                                                          f"{name}.log")
            )
        time.sleep(0.5)
    return proc.returncode
