"""`splitrl plot RUN_DIR` draws a run's curves from metrics.jsonl."""

from __future__ import annotations

import json

from splitrl_app.cli import main


def test_plot_writes_pngs_for_the_metrics_present(tmp_path, capsys):
    records = [{"step": 0, "eval_before/accuracy": 0.1}]
    records += [{"step": s, "reward/mean": s / 10, "accuracy/mean": s / 10, "kl": 0.01 * s,
                 "staleness/max": 1, "throughput/tokens_per_s": 100.0} for s in range(1, 6)]
    records += [{"step": 5, "eval_after/accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    written = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert {"overview.png", "reward.png", "accuracy.png", "kl.png", "staleness.png"} <= written
    assert "entropy.png" not in written  # no entropy in these metrics: no empty panel
    assert all((tmp_path / "plots" / n).stat().st_size > 1000 for n in written)


def test_plot_of_a_directory_without_metrics_says_so(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_single_evaluation_points_are_drawn_not_only_listed_in_the_legend():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from splitrl_app.plots import _draw

    records = [{"step": 0, "eval_before/accuracy": 0.1}, {"step": 1, "accuracy/mean": 0.2},
               {"step": 2, "accuracy/mean": 0.3}, {"step": 3, "accuracy/mean": 0.4},
               {"step": 3, "eval_after/accuracy": 0.9}]
    fig, ax = plt.subplots()
    _draw(ax, records, ["accuracy/mean", "eval_before/accuracy", "eval_after/accuracy"], "acc")
    lines = {line.get_label(): line for line in ax.get_lines()}
    for key in ("eval_before/accuracy", "eval_after/accuracy"):  # a visible marker each
        assert lines[key].get_marker() == "o" and lines[key].get_markersize() > 0
    assert lines["accuracy/mean"].get_linestyle() == "-"
    plt.close(fig)


def test_a_two_step_run_gets_integer_step_ticks():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from splitrl_app.plots import _draw

    fig, ax = plt.subplots()
    _draw(ax, [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}], ["loss"], "loss")
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


def test_a_synchronous_run_has_no_staleness_panel(tmp_path):
    from splitrl_app.plots import plot_run

    records = [{"step": s, "reward/mean": s / 10, "staleness/mean": 0.0, "staleness/max": 0.0}
               for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    names = lambda: {p.name for p in plot_run(tmp_path)}  # noqa: E731
    assert "staleness.png" not in names()  # no config: staleness was 0 at every step
    (tmp_path / "config.yaml").write_text("trainer:\n  max_staleness: 2\n")
    assert "staleness.png" in names()  # asynchronous: zeros say the samplers kept up
    (tmp_path / "config.yaml").write_text("trainer:\n  max_staleness: 0\n")
    assert "staleness.png" not in names()
