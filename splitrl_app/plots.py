"""``splitrl plot RUN_DIR``: a run's curves from ``metrics.jsonl`` to ``RUN_DIR/plots/*.png``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from splitrl.extras import MissingExtra, require
from splitrl.jsonl import read_jsonl

PANELS = [
    ("reward", ["reward/mean"], "mean total reward"),
    ("accuracy", ["accuracy/mean", "eval_before/accuracy", "eval/accuracy",
                  "eval_after/accuracy"], "accuracy"),
    ("kl", ["kl"], "KL to reference"),
    ("loss", ["loss", "policy_loss"], "loss"),
    ("entropy", ["entropy"], "entropy (nats/token)"),
    ("staleness", ["staleness/mean", "staleness/max"], "versions behind"),
    ("throughput", ["throughput/tokens_per_s"], "completion tokens / s"),
    ("time", ["time/wait_rollouts_s", "time/train_s", "time/push_s"], "seconds per step"),
]


# Fast zlib level: small line plots compress about as well, in a fraction of the time.
_PNG: dict[str, Any] = {"compress_level": 1}
_DPI = 90


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a SplitRL run directory?")
    return read_jsonl(path)  # a torn last line (a crash, a full disk) is skipped


def load_matplotlib():
    """matplotlib's pyplot on the Agg backend (files only, no display). Its import is about
    half of what plotting a run costs: `splitrl up` calls this while the run trains, so
    only the drawing is left when it ends."""
    matplotlib = require("matplotlib", "plots", "plotting a run")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | Path) -> list[Path]:
    """overview.png (every panel) and one PNG per panel. The figure is drawn once and each
    panel's file is cut from that drawing (its axes, title, tick labels and legend): drawing
    every panel a second time in a figure of its own was most of what plotting cost at the
    end of every `splitrl up`."""
    import numpy as np
    from PIL import Image

    plt = load_matplotlib()

    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    omit = {"staleness"} if synchronous(run_dir, records) else set()
    panels = [(n, [k for k in keys if any(k in r for r in records)], label)
              for n, keys, label in PANELS if n not in omit]
    panels = [p for p in panels if p[1]]
    if not panels:
        return []
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False, dpi=_DPI)
    # Fixed margins, not tight_layout: the panels' text is the same every run, and measuring
    # it was ~40% of the time `splitrl up` spent plotting after a run.
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.55 / (3.2 * rows),
                        top=1 - 0.35 / (3.2 * rows),
                        hspace=0.55, wspace=0.25)
    for ax, (_, keys, label) in zip(axes.flat, panels, strict=False):
        _draw(ax, records, keys, label)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3]  # opaque white background
    height, width = image.shape[:2]
    overview = out_dir / "overview.png"
    Image.fromarray(image).save(overview, **_PNG)
    written = [overview]
    # Each panel's file is its cell of the grid, split halfway between neighbouring axes: the
    # fixed margins leave every panel's title, tick labels and legend inside its cell, and
    # measuring each panel's text for a tight box cost a third of the plotting.
    xs = [0.0, *((axes[0, c - 1].get_position().x1 + axes[0, c].get_position().x0) / 2
                 for c in range(1, cols)), 1.0]
    ys = [1.0, *((axes[r - 1, 0].get_position().y0 + axes[r, 0].get_position().y1) / 2
                 for r in range(1, rows)), 0.0]
    for i, (name, _, _) in enumerate(panels):
        r, c = divmod(i, cols)
        cell = image[round((1 - ys[r]) * height):round((1 - ys[r + 1]) * height),
                     round(xs[c] * width):round(xs[c + 1] * width)]
        path = out_dir / f"{name}.png"
        Image.fromarray(cell).save(path, **_PNG)
        written.append(path)
    plt.close(fig)
    return written


def synchronous(run_dir: str | Path, records: list[dict]) -> bool:
    """Whether the run trained on-policy (``trainer.max_staleness: 0``, from the run's
    config.yaml; without one, whether no group was ever behind): its staleness is 0 at every
    step, and a panel of zeros says nothing."""
    config = Path(run_dir) / "config.yaml"
    if config.is_file():
        import yaml

        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
        if "max_staleness" in trainer:
            return trainer["max_staleness"] == 0
    return not any(r.get(k) for r in records for k in ("staleness/mean", "staleness/max"))


def _draw(ax, records: list[dict], keys: list[str], label: str) -> None:
    """One panel. Evaluations (a few points: before, every N steps, after) are drawn as
    markers, so a single before or after point is visible."""
    from matplotlib.ticker import MaxNLocator

    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        xs, ys = zip(*points, strict=True)
        if key.startswith("eval") or len(points) <= 2:
            ax.plot(xs, ys, marker="o", markersize=6, linestyle="--" if len(xs) > 1 else "",
                    label=key)
        else:
            ax.plot(xs, ys, label=key)
    ax.set_title(label)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: never 0.5
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(run_dir: str) -> int:
    try:
        written = plot_run(run_dir)
    except (FileNotFoundError, MissingExtra) as e:
        print(f"splitrl plot: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def plot_quietly(run_dir: Path) -> None:
    """`splitrl plot` of a run at the end of `splitrl up`: a convenience that never fails the
    run (what stopped it is said instead)."""
    try:
        main(str(run_dir))
    except Exception as e:  # plots are a convenience; never fail the run on them
        print(f"(plots skipped: {e})", flush=True)


def load_matplotlib_in_background() -> threading.Thread:
    """Import matplotlib in a thread while the run trains (a synchronous run keeps about one
    core busy, the sampler or the trainer), so plotting at the end only draws."""

    def load():
        try:
            load_matplotlib()
        except Exception:  # plot_quietly reports it at the end, if plotting fails
            pass

    thread = threading.Thread(target=load, name="plots-import", daemon=True)
    thread.start()
    return thread


def plot_in_background(run_dir: Path) -> threading.Thread:
    """:func:`plot_quietly` of a finished run in a thread, so the plots render while the
    services shut down."""
    thread = threading.Thread(target=plot_quietly, args=(run_dir,), name="plots", daemon=True)
    thread.start()
    return thread
