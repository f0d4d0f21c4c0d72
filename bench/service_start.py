"""CPU seconds of each process of a short local launch: what every multi-process test and every
`splitrl up` pays per service, start-up included.

Launches the demo config on the tiny model for ``--steps`` steps through the launcher, with each
service process started under a small wrapper that reports its CPU seconds (user + system, its
children included) when it exits, ``--repeat`` times; prints each process's median and the
launch's total (the launcher included). The first launch fills the compilation cache
(``--cache``, a new directory by default) unless it is already warm; ``--warm`` drops it from the
medians, leaving what a launch of a config already compiled costs.

    .venv/bin/python bench/service_start.py [--steps 2] [--repeat 3] [--warm] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs the service's command line as a child and writes its CPU seconds to REPORT_DIR once it
# exits, passing the launcher's signals on (the launcher stops services with SIGTERM).
WRAPPER = """#!{python}
import os, signal, sys
args = sys.argv[1:]
name = next((a for a in args if a in ("sampler", "trainer", "reward")), "other")
pid = os.fork()
if pid == 0:
    os.execv({python!r}, [{python!r}, *args])
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: os.kill(pid, n))
while True:
    try:
        _, status, usage = os.wait4(pid, 0)
        break
    except InterruptedError:
        continue
with open(os.path.join({reports!r}, f"{{name}}.{{pid}}"), "w") as f:
    f.write(f"{{usage.ru_utime + usage.ru_stime}}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def launch(model: Path, run_dir: Path, steps: int, python: str) -> float:
    """One launch of ``steps`` steps; the launcher's own CPU seconds (this process's part)."""
    from splitrl.config import load_config
    from splitrl_app.launch.demo import demo_config_path
    from splitrl_app.launch.supervisor import Launcher

    before = resource.getrusage(resource.RUSAGE_SELF)
    cfg = load_config(demo_config_path(), [f"model.path={model}", f"trainer.run_dir={run_dir}",
                                           f"trainer.steps={steps}"])
    launcher = Launcher(cfg, python=python)
    try:
        launcher.up()
        code = launcher.procs["trainer"].wait()
    finally:
        launcher.stop()
    if code != 0:
        raise SystemExit(f"the trainer exited with {code}: see {run_dir / 'logs'}")
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", action="store_true",
                        help="one launch first, left out of the medians (fills the cache)")
    parser.add_argument("--cache", help="SPLITRL_CACHE_DIR (default: a new directory)")
    args = parser.parse_args()
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPLITRL_CACHE_DIR"] = args.cache or str(Path(tmp) / "cache")
        from splitrl.init_model import init_model

        model = init_model(Path(tmp) / "tiny", family="qwen2", preset="tiny",
                           vocab="arithmetic", seed=0)
        reports = Path(tmp) / "reports"
        wrapper = Path(tmp) / "wrapper.py"
        wrapper.write_text(WRAPPER.format(python=sys.executable, reports=str(reports)))
        wrapper.chmod(0o755)
        per_process: dict[str, list[float]] = defaultdict(list)
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {args.steps} "
              f"steps of the demo config; cache {os.environ['SPLITRL_CACHE_DIR']}", flush=True)
        for i in range(args.repeat + args.warm):
            reports.mkdir(exist_ok=True)
            for stale in reports.iterdir():
                stale.unlink()
            launcher = launch(model, Path(tmp) / f"run-{i}", args.steps, str(wrapper))
            seconds = {"launcher": launcher}
            for report in sorted(reports.iterdir()):
                name = report.name.split(".")[0]
                key = name if name not in seconds else f"{name}-{len(seconds)}"
                seconds[key] = float(report.read_text())
            kept = not (args.warm and i == 0)
            print(("" if kept else "(warm-up) ") + "  ".join(
                f"{k} {v:.2f}" for k, v in seconds.items())
                + f"  total {sum(seconds.values()):.2f} s CPU", flush=True)
            if kept:
                for name, value in seconds.items():
                    per_process[name.split("-")[0]].append(value)
                per_process["total"].append(sum(seconds.values()))
        print("median s CPU: " + "  ".join(f"{k} {statistics.median(v):.2f}"
                                            for k, v in per_process.items()))


if __name__ == "__main__":
    main()
