"""Delta pushes in a real training run: bytes on the wire per step against a full push.

Runs the demo (tiny Qwen2 learning single-digit addition: reward, two samplers, trainer, as
separate processes) for a few dozen steps with the samplers serving bfloat16 while the trainer
keeps float32 master weights, once at lr 1e-5 and once at the demo's lr (1e-3), and reads each
step's push from ``metrics.jsonl``: payload bytes the samplers received (``push/mb``) against
what full pushes would have carried (``push/full_mb``), and the trainer's egress.

    python bench/delta_push.py             # two runs of 30 steps (a few minutes)
    python bench/delta_push.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from splitrl.config import load_config  # noqa: E402
from splitrl.init_model import init_model  # noqa: E402
from splitrl_app.launch.demo import demo_config_path  # noqa: E402
from splitrl_app.launch.up import main as launch  # noqa: E402


def run(model: Path, run_dir: Path, lr: float, steps: int, dtype: str) -> list[dict]:
    cfg = load_config(demo_config_path(), [
        f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        f"trainer.optimizer.lr={lr:.1e}", f"sampler.dtype={dtype}",
        "trainer.eval_before=false", "trainer.eval_after=false",
        f"trainer.checkpoint.every={steps + 1}"])
    if launch(cfg) != 0:
        raise RuntimeError(f"the run failed; logs in {run_dir}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "push/full_mb" in r]


def summarise(name: str, records: list[dict]) -> dict:
    wire = sum(r["push/mb"] for r in records)
    full = sum(r["push/full_mb"] for r in records)
    per_step = [r["push/mb"] / r["push/full_mb"] for r in records if r["push/full_mb"]]
    out = {"run": name, "steps": len(records), "wire_mb": wire, "full_mb": full,
           "ratio": wire / full, "egress_mb": sum(r["push/egress_mb"] for r in records),
           "delta_pushes": sum(r["push/delta"] > 0 for r in records),
           "first_5": [round(x, 3) for x in per_step[:5]],
           "last_5": [round(x, 3) for x in per_step[-5:]]}
    print(f"[{name}] delta bytes per step / full push: {out['ratio']:.3f} "
          f"({wire:.2f} MB of {full:.2f} MB over {len(records)} steps; "
          f"{out['delta_pushes']} delta pushes; trainer egress {out['egress_mb']:.2f} MB; "
          f"per step first {out['first_5']} last {out['last_5']})", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "tiny-arith", family="qwen2", preset="tiny",
                           vocab="arithmetic", seed=0)
        for name, lr, dtype in [("bf16 lr 1e-5", 1e-5, "bfloat16"),
                                ("bf16 lr 1e-3 (demo)", 1e-3, "bfloat16"),
                                ("f32 lr 1e-3 (demo)", 1e-3, "float32")]:
            records = run(model, work / name.split()[0] / str(lr), lr, args.steps, dtype)
            rows.append(summarise(name, records))
    print(f"\nload average: {os.getloadavg()}")
    for row in rows:
        print(f"[{row['run']}] delta bytes per step / full push: {row['ratio']:.3f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
