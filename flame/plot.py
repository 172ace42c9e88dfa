"""Plots of training runs from their metrics.jsonl: training loss (with the validation loss), learning
rate, tokens/s and gradient norm, each in a panel of its own where a run logged it, several runs in
one figure for comparison.

    python -m flame.plot RUN [RUN ...] --out FILE.png [--x step|tokens]

RUN is a run's dump folder (job.dump_folder) or its metrics.jsonl. Every run also writes its own
`<job.dump_folder>/loss.png` at each checkpoint and at the end (`write_run_plot`). A dotted line
marks where a run resumed from a checkpoint; a step logged twice (before and after a resume) is
drawn once, with its last value (`flame.run_metrics`). matplotlib (the `plot` extra) draws without a
display (its Agg canvas, no pyplot); it is imported when a plot is drawn.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from flame.run_metrics import MetricsFileError, RunMetrics, read_run_metrics

RUN_PLOT = "loss.png"
"""The plot a run writes into its dump folder."""
X_AXES = ("step", "tokens")
PANELS = (
    ("loss", "loss (nats/token)"),
    ("lr", "learning rate"),
    ("tokens_per_s", "tokens/s"),
    ("grad_norm", "gradient norm"),
)
"""(training record key, panel title); the validation loss shares the loss panel."""
MARKED_POINTS = 50
"""A run's line has a marker at each point when it has at most this many."""


class PlotError(RuntimeError):
    """A plot that cannot be drawn or written; the message says why."""


class PlotLibraryMissing(PlotError):
    """matplotlib is not installed."""


def plot_runs(runs: list[tuple[str, RunMetrics]], out: str | Path, x: str = "step",
              title: str = "") -> Path:
    """Draw `runs` ((label, metrics) pairs) into the image file `out` (its format from its suffix:
    png, svg, pdf, ...), written whole or not at all; returns `out`."""
    return _save(figure_of_runs(runs, x, title), Path(out))


def figure_of_runs(runs: list[tuple[str, RunMetrics]], x: str = "step", title: str = ""):
    """A matplotlib Figure of `runs`: a panel per metric that some run logged (`PANELS`), a line
    per run, x = step or tokens."""
    if x not in X_AXES:
        raise PlotError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    figure_class = _figure_class()
    panels = [(key, name) for key, name in PANELS
              if any(_has(row, key) for _, metrics in runs for row in metrics.train)]
    if not panels:
        names = ", ".join(str(metrics.path) for _, metrics in runs)
        raise PlotError(f"no training step logged in {names} yet: nothing to plot")
    columns = 1 if len(panels) == 1 else 2
    rows = (len(panels) + columns - 1) // columns
    height = 3.4 * rows + 0.6
    figure = figure_class(figsize=(6.4 * columns, height))
    # fixed margins: a layout engine (constrained, tight) doubles the drawing time
    figure.subplots_adjust(left=0.1 / columns, right=0.98, bottom=0.55 / height,
                           top=1 - 0.6 / height, wspace=0.22, hspace=0.45)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for axis in axes[len(panels):]:
        axis.set_visible(False)
    for index, (label, metrics) in enumerate(runs):
        color = f"C{index % 10}"
        steps = [row["step"] for row in metrics.train]
        position = _positions(metrics, x)
        for axis, (key, name) in zip(axes, panels):
            points = [(position(row["step"]), row[key]) for row in metrics.train if _has(row, key)]
            if points:  # a marker per point while they are few (a single point draws no line)
                axis.plot(*zip(*points), color=color, label=label if len(runs) > 1 else "training",
                          marker="o" if len(points) <= MARKED_POINTS else None, markersize=3)
            if key == "loss":
                val = [(position(row["step"]), row["val_loss"]) for row in metrics.validation]
                if val:
                    axis.plot(*zip(*val), color=color, linestyle="--", marker="o", markersize=3,
                              label=f"{label} validation" if len(runs) > 1 else "validation")
                shown = [step for step in metrics.resumed_from if steps and steps[0] <= step <= steps[-1]]
                for number, step in enumerate(shown):
                    resumed = f"{label} resumed" if len(runs) > 1 else "resumed"
                    axis.axvline(position(step), color=color, linestyle=":", linewidth=1,
                                 label=None if number else resumed)
    for axis, (key, name) in zip(axes, panels):
        axis.set_title(name)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        if key == "loss":
            axis.legend(fontsize="small")
        if key == "lr":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        figure.suptitle(title)
    return figure


def write_run_plot(dump_folder: str | Path) -> Path | None:
    """Draw `<dump_folder>/loss.png`, the plot of the run in that folder; None (and no file) while
    the run has logged no training step."""
    dump_folder = Path(dump_folder)
    metrics = read_run_metrics(dump_folder)
    if not metrics.train:
        return None
    return plot_runs([(dump_folder.name, metrics)], dump_folder / RUN_PLOT, title=dump_folder.name)


def _has(row: dict, key: str) -> bool:
    value = row.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positions(metrics: RunMetrics, x: str):
    """step -> its place on the x axis: the step, or the tokens trained on by then (interpolated
    between logged steps, for validation rows and resumes)."""
    if x == "step":
        return lambda step: step
    known = [(row["step"], row["tokens"]) for row in metrics.train if _has(row, "tokens")]
    if not known:
        raise PlotError(f"{metrics.path} logs no token counts: plot it with --x step")
    steps, tokens = zip(*known)
    return lambda step: float(np.interp(step, steps, tokens))


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotLibraryMissing(
            "matplotlib is not installed (pip install matplotlib, or this project's `plot` extra)"
        ) from None
    return Figure


def _save(figure, out: Path) -> Path:
    """Write the figure to a temporary sibling, renamed to `out` once complete."""
    fmt = out.suffix.removeprefix(".").lower() or "png"
    supported = figure.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise PlotError(f"cannot write {out}: its suffix names no image format matplotlib writes "
                        f"({', '.join(sorted(supported))})")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(tmp, format=fmt, dpi=100)
        os.replace(tmp, out)
    except OSError as err:
        raise PlotError(f"cannot write {out}: {err.strerror or err}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flame.plot", description=__doc__.split("\n\n")[0],
        epilog="Every run also writes <job.dump_folder>/loss.png at each checkpoint and at the end.")
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a run's dump folder or its metrics.jsonl; several runs share the figure")
    parser.add_argument("--out", required=True, metavar="FILE.png",
                        help="the image to write (png; svg or pdf by their suffix)")
    parser.add_argument("--x", choices=X_AXES, default="step",
                        help="the x axis: optimizer steps or tokens trained on (default: step)")
    args = parser.parse_args(argv)
    try:
        runs = []
        for run in args.runs:
            metrics = read_run_metrics(run)
            for number in metrics.unreadable_lines:
                print(f"flame.plot: note: {metrics.path}:{number} is not a metrics row (a line cut "
                      f"by a kill?), skipped", file=sys.stderr)
            runs.append((run.removesuffix("/").removesuffix("/metrics.jsonl"), metrics))
        out = plot_runs(runs, args.out, args.x)
    except (MetricsFileError, PlotError) as err:
        print(f"flame.plot: error: {err}", file=sys.stderr)
        return 1
    print(f"flame.plot: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
