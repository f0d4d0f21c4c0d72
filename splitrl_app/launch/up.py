"""``splitrl up``: a whole disaggregated run as local processes on 127.0.0.1.

Starts the reward service, ``services.num_samplers`` samplers and the trainer, each its own
process (`splitrl_app.launch.supervisor`), shows one combined progress view from the trainer's
``Status`` (`splitrl_app.launch.console`), and stops everything cleanly at the end or on Ctrl-C.
The run directory holds the resolved config, one log file per process, metrics, plots,
checkpoints and the exported model.

Mistakes surface on the console, early: the data, a run directory whose checkpoint belongs to
another config, trackers that are not installed and a launch that does not fit in memory are
found before any service starts (`splitrl_app.launch.preflight`); error lines of every
service's log are shown as they are written; and a service that exits leaves its last error
lines on the console, not only its exit code. What the run is doing while the bar stands still
(services starting, programs compiling, the first evaluation) is said in one line per phase.

Ctrl-C (or SIGTERM) stops the run cleanly: the trainer checkpoints the step it is at, and the
launcher says where it stopped and that the same command continues from there; exit code 0.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

from splitrl.config import Config
from splitrl_app.launch.console import say, watch
from splitrl_app.launch.preflight import preflight
from splitrl_app.launch.supervisor import Launcher
from splitrl_app.plots import plot_in_background, plot_quietly
from trainer_service.orchestration.evaluation import accuracy_line


def continue_command(launcher: Launcher) -> str:
    """The command that continues this run: the one that started it, when it was splitrl's."""
    if Path(sys.argv[0]).name in ("splitrl", "__main__.py"):
        return shlex.join(["splitrl", *sys.argv[1:]])
    return f"splitrl up --config {launcher.config_path}"


def main(cfg: Config) -> int:
    problem = preflight(cfg)
    if problem is not None:
        print(f"splitrl up: {problem}", file=sys.stderr, flush=True)
        return 2
    launcher = Launcher(cfg)
    code, interrupted, start_failed = 1, False, False
    say(f"run directory: {launcher.run_dir}")

    def interrupt(signum, _frame):
        launcher.interrupted.set()  # seen at the next wait even if the exception is lost
        raise KeyboardInterrupt

    # Installed for SIGINT too: a process started with SIGINT ignored (a background job of a
    # non-interactive shell, a nohup'd script, some CI runners) keeps it ignored in Python, and
    # Ctrl-C / `kill -INT` would never stop the run.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    plots = None
    try:
        launcher.up()
        say("reward functions: " + "; ".join(launcher.reward_functions()))
        code = watch(launcher)
        launcher.signal_stop()
        if launcher.attempt_summary().get("state") in ("done", "stopped"):
            plots = plot_in_background(launcher.run_dir)  # while the services shut down
    except KeyboardInterrupt:
        interrupted = True
        say("\ninterrupted: stopping the run (the trainer checkpoints the step it is at)")
    except (RuntimeError, TimeoutError) as e:  # a service did not start
        start_failed = True  # the trainer, started beside it, is stopped: nothing to report
        print(f"splitrl up: {e}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        launcher.stop()
    trainer = launcher.procs.get("trainer")
    if interrupted:  # a clean stop is a success; a trainer that failed while stopping is not
        code = 0 if trainer is None or trainer.returncode == -signal.SIGTERM else (
            trainer.returncode)  # -SIGTERM: stopped while starting, before it had a handler
    summary = {} if start_failed else launcher.attempt_summary()
    line = accuracy_line(summary)
    if line:
        say(line)
    if summary.get("state") == "stopped" or (interrupted and code == 0):
        step = int(summary.get("step", 0))
        where = (f"stopped at step {step} of {int(summary.get('total_steps', cfg.trainer.steps))}"
                 f"; checkpoint in {launcher.run_dir}" if step else
                 "stopped before the first step")
        say(f"{where}. To continue from there: {continue_command(launcher)}")
    if plots is not None:  # started when the trainer finished, while the services stopped
        plots.join()
    elif summary.get("state") in ("done", "stopped"):
        plot_quietly(launcher.run_dir)
    if code != 0 and trainer is not None and not start_failed:
        print(launcher.exit_report("trainer"), file=sys.stderr)
    if code != 0:
        print(f"the run failed (exit code {code}); logs: {launcher.log_dir}", file=sys.stderr)
    return code
