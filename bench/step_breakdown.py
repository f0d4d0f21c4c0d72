"""SplitRL's own step time, split: wait for rollouts / train / push / other, and the start-up.

    HF_HUB_OFFLINE=1 python bench/step_breakdown.py --config CONFIG [key=value ...]
    python bench/step_breakdown.py --run-dir RUN_DIR          # an existing run, no new one

With ``--config`` it runs ``splitrl up`` on the config (in a fresh run directory unless
``trainer.run_dir=`` is given) and then reads the run; with ``--run-dir`` it only reads. From
the run's ``metrics.jsonl`` (one record per step, written by ``trainer_service/run.py``):

- wait:  ``time/wait_rollouts_s``, the trainer blocked on the step's rollouts
- train: ``time/train_s``, building the batch and the update (loss, gradient, optimizer)
- push:  ``time/push_s``, the weights to every sampler (synchronous runs wait for it)
- other: ``time/other_s``, from the previous step's push to this step's start: drawing the next
         prompts, the audit record, a checkpoint if due, writing metrics. With
         ``max_staleness: 0`` the samplers generate during it, so it is part of what a step
         costs; ``time/step_s`` (wait + train + push) leaves it out.

Medians are over steps 3..N (the first two include compilation). From the services' logs
(``logs/*.log``, JSON lines with a ``ts``) it prints the start-up: each service's time to its
"ready" line, the time to the first finished step and to the end, counted from the launch
(``--config``) or from the earliest log line (``--run-dir``).

Wall times on a shared machine move with the load: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = [("wait", "time/wait_rollouts_s"), ("train", "time/train_s"), ("push", "time/push_s"),
         ("other", "time/other_s")]
READY = {  # (log file, message) of each service's "serving" line
    "reward": ("reward.log", "reward service ready"),
    "sampler-0": ("sampler-0.log", "sampler ready"),
    "trainer": ("trainer.log", "grpc server listening"),
}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"no metrics in {run_dir} (expected {path})")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "time/step_s" in r]  # evaluation records have no timing


def read_log(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "ts" in rec:
            out.append(rec)
    return out


def breakdown(steps: list[dict], first: int = 3) -> dict[str, float]:
    """Median of each part (and of their sum, the step interval) over steps first..N."""
    window = steps[first - 1:] or steps
    out = {name: statistics.median(r.get(key, 0.0) for r in window) for name, key in PARTS}
    out["interval"] = statistics.median(sum(r.get(k, 0.0) for _, k in PARTS) for r in window)
    out["step_s"] = statistics.median(r["time/step_s"] for r in window)
    return out


def startup(run_dir: Path, launched: float | None) -> dict[str, float]:
    """Seconds from the launch to each service's ready line, the first step and the last."""
    logs = {name: read_log(run_dir / "logs" / f) for name, (f, _) in READY.items()}
    trainer = logs["trainer"]
    all_ts = [r["ts"] for recs in logs.values() for r in recs]
    if not all_ts:
        return {}
    origin = launched if launched is not None else min(all_ts)
    out = {}
    for name, (_, msg) in READY.items():
        ts = [r["ts"] for r in logs[name] if r.get("msg") == msg]
        if ts:
            out[f"{name} ready"] = ts[0] - origin
    synced = [r["ts"] for r in trainer if r.get("msg") == "sampler synced"]
    if synced:
        out["first weights on the sampler"] = synced[0] - origin
    step_ts = [r["ts"] for r in trainer if r.get("msg") == "step"]
    if step_ts:
        out["first step done"] = step_ts[0] - origin
        out["last step done"] = step_ts[-1] - origin
    return out


def run(config: str, overrides: list[str]) -> tuple[Path, float, float]:
    """``splitrl up`` on the config; (run dir, launch time, wall seconds)."""
    run_dir = Path(next(o for o in overrides if o.startswith("trainer.run_dir=")).split("=", 1)[1])
    splitrl = Path(sys.executable).with_name("splitrl")
    cmd = [str(splitrl), "up", "--config", config, *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    launched = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    wall = time.time() - launched
    if proc.returncode != 0:
        raise SystemExit(f"splitrl up failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_dir, launched, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="run `splitrl up` on this config first")
    src.add_argument("--run-dir", help="read an existing run directory")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (with --config)")
    ap.add_argument("--per-step", action="store_true", help="print every step's split too")
    args = ap.parse_args()
    if args.run_dir:
        report(Path(args.run_dir), None, None, args.per_step)
    elif any(o.startswith("trainer.run_dir=") for o in args.overrides):
        report(*run(args.config, args.overrides), args.per_step)
    else:
        # A run directory of our own holds checkpoints: removed once read, so that measuring
        # again and again does not fill the disk.
        with tempfile.TemporaryDirectory(prefix="breakdown-") as tmp:
            overrides = [*args.overrides, f"trainer.run_dir={tmp}/run"]
            report(*run(args.config, overrides), args.per_step)


def report(run_dir: Path, launched: float | None, wall: float | None, per_step: bool) -> None:
    """Print the step split and the start-up of the run in ``run_dir``."""
    steps = read_metrics(run_dir)
    if not steps:
        raise SystemExit(f"no step records in {run_dir}/metrics.jsonl")
    print(f"run: {run_dir} ({len(steps)} steps); load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    if per_step:
        print("step   " + "  ".join(f"{n:>7s}" for n, _ in PARTS) + "  step_s")
        for r in steps:
            print(f"{r['step']:4d}   " + "  ".join(f"{r.get(k, 0.0):7.3f}" for _, k in PARTS)
                  + f"  {r['time/step_s']:6.3f}")
    b = breakdown(steps)
    share = lambda k: 100 * b[k] / max(b["interval"], 1e-9)  # noqa: E731
    print(f"median of steps 3..{len(steps)}: " + ", ".join(
        f"{n} {b[n]:.3f} s ({share(n):.0f}%)" for n, _ in PARTS)
        + f"; interval {b['interval']:.3f} s; time/step_s {b['step_s']:.3f} s")
    print("steps 1, 2 (with compilation): "
          + ", ".join(f"{r.get('time/interval_s', r['time/step_s']):.2f} s"
                      for r in steps[:2]))
    for name, seconds in startup(run_dir, launched).items():
        print(f"  {name:30s} {seconds:7.2f} s")
    if wall is not None:
        print(f"  {'whole process':30s} {wall:7.2f} s")


if __name__ == "__main__":
    main()
