"""What ``splitrl up`` shows while a run goes: one progress bar from the trainer's ``Status``,
a line when the trainer enters a phase (so a bar standing still is never silent), and the error
lines of every service's log as they are written."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitrl_app.launch.service_logs import LogFollower
from splitrl_app.plots import load_matplotlib_in_background

if TYPE_CHECKING:
    from splitrl_app.launch.supervisor import Launcher


def say(message: str) -> None:
    print(message, flush=True)


def sampler_count(status) -> str:
    """The bar's ``samplers=R/N``: R samplers ready (holding the current weights, taking
    work) of the N the trainer knows (docs/runs.md), both from the trainer's own pool."""
    return f"{sum(s.healthy for s in status.samplers)}/{len(status.samplers)}"


class PhaseReporter:
    """One console line when the trainer enters a phase, so a bar at 0 is never silent."""

    def __init__(self, write: Callable[[str], object]):
        self.write = write
        self.state: str | None = None
        self.trained = False
        self.start_step: int | None = None

    def observe(self, state: str, step: int) -> None:
        if self.start_step is None:  # the trainer's first status: the step it resumed at (or
            self.start_step = step  # 0), before a step that may end between two polls
        if state == self.state:
            return
        self.state = state
        if state == "starting":
            self.write("trainer: loading the model, restoring a checkpoint if there is one, "
                       "waiting for the samplers")
        elif state == "evaluating":
            self.write(f"trainer: greedy evaluation at step {step}" + (
                "" if self.trained else " (the samplers compile their programs on first use)"))
        elif state == "training" and not self.trained:
            self.trained = True
            self.write(f"trainer: training from step {self.start_step} (the first step compiles "
                       "the train program)")


def watch(launcher: Launcher) -> int:
    """Combined progress of ``launcher``'s run until the trainer exits; returns its exit code:
    the trainer's ``Status`` as a bar, a line per phase, every service's error lines as they are
    written and the exit report of a service that exits."""
    from tqdm import tqdm

    trainer = launcher.procs["trainer"]
    bar = tqdm(total=launcher.cfg.trainer.steps, desc="splitrl", unit="step",
               dynamic_ncols=True, file=sys.stdout)
    follower = LogFollower({n: launcher.log_dir / f"{n}.log" for n in launcher.procs},
                           launcher.log_starts)
    reported: set[str] = set()
    phases = PhaseReporter(bar.write)
    plots_loader = None

    def show_errors() -> None:
        for line in follower.new_errors():
            bar.write(line, file=sys.stderr)
        for name, proc in launcher.procs.items():
            if name != "trainer" and name not in reported and proc.poll() is not None:
                reported.add(name)
                bar.write(launcher.exit_report(name), file=sys.stderr)

    try:
        while trainer.poll() is None:
            launcher.check_interrupted()
            show_errors()
            try:
                status = launcher.status()
            except Exception:
                time.sleep(1.0)
                continue
            metrics = status.last_metrics
            phases.observe(status.state, status.step)
            if status.state == "training" and plots_loader is None:
                plots_loader = load_matplotlib_in_background()
            bar.n = status.step
            bar.set_postfix(
                state=status.state,
                v=status.weight_version,
                reward=f"{metrics.get('reward/mean', 0.0):.2f}",
                acc=f"{metrics.get('accuracy/mean', 0.0):.2f}",
                samplers=sampler_count(status),
                refresh=True,
            )
            try:  # a second between refreshes, but the trainer's exit is seen at once
                trainer.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        show_errors()
    finally:
        bar.close()
    return trainer.returncode
