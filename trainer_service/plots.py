"""``splitrl plot RUN_DIR``: a run's curves from ``metrics.jsonl`` to ``RUN_DIR/plots/*.png``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
_PNG = {"compress_level": 1}


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a SplitRL run directory?")
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            records.append(json.loads(line))
    return records


def load_matplotlib():
    """matplotlib's pyplot on the Agg backend (files only, no display). Its import is about
    half of what plotting a run costs: `splitrl up` calls this while the run trains, so
    only the drawing is left when it ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | Path) -> list[Path]:
    plt = load_matplotlib()

    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    panels = [(n, [k for k in keys if any(k in r for r in records)], label)
              for n, keys, label in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        return written
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
    # Fixed margins, not tight_layout: the panels' text is the same every run, and measuring
    # it was ~40% of the time `splitrl up` spent plotting after a run.
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.55 / (3.2 * rows),
                        top=1 - 0.35 / (3.2 * rows),
                        hspace=0.55, wspace=0.25)
    for ax, (name, keys, label) in zip(axes.flat, panels, strict=False):
        _draw(ax, records, keys, label)
        single, single_ax = plt.subplots(figsize=(6, 3.5))
        single.subplots_adjust(left=0.13, right=0.97, bottom=0.14, top=0.91)
        _draw(single_ax, records, keys, label)
        path = out_dir / f"{name}.png"
        single.savefig(path, dpi=90, pil_kwargs=_PNG)
        plt.close(single)
        written.append(path)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    overview = out_dir / "overview.png"
    fig.savefig(overview, dpi=90, pil_kwargs=_PNG)
    plt.close(fig)
    return [overview, *written]


def _draw(ax, records: list[dict], keys: list[str], label: str) -> None:
    """One panel. Evaluations (a few points: before, every N steps, after) are drawn as
    markers, so a single before or after point is visible."""
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
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(run_dir: str) -> int:
    try:
        written = plot_run(run_dir)
    except FileNotFoundError as e:
        print(f"splitrl plot: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
