"""Figures of metrics over logged steps (metrics.jsonl): learning curves, Q per strategy, the
context bonus per transition. Each draws the raw series faint and an exponential moving
average on top: RL metrics are noisy step to step, and the trend is what a reader looks for,
but the raw points stay visible so the smoothing cannot hide a spike.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tosca_mlmt.analysis.tables import TRANSITIONS

# one colour per kind of correction, the same in the correction matrix and the bonus figure
TRANSITION_COLOURS = {"right_to_right": "#2e7d32", "wrong_to_right": "#9ccc65",
                      "right_to_wrong": "#c62828", "wrong_to_wrong": "#9e9e9e"}
MIN_POINTS_TO_SMOOTH = 5
DPI = 90


def save_png(fig: Figure, path: Path) -> Path:
    """Figures are drawn on matplotlib's Agg canvas directly (no pyplot): no display is needed
    and no global figure state leaks between calls."""
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def ema_span(n: int) -> int:
    """About a tenth of the series, at least 3 steps: enough to calm step-to-step noise without
    moving a trend that lasts a tenth of the run."""
    return max(3, n // 10)


def x_label(level: str) -> str:
    # a joint run logs every level on one global step (runs from before that: joint/* per round)
    return "step (global)" if level == "joint" else "step"


def smoothed(ax, x: pd.Series, y: pd.Series, colour=None, label: str | None = None) -> None:
    """Raw series faint, its EMA solid; a short series is drawn raw with markers only."""
    ok = y.notna()
    x, y = x[ok], y[ok]
    if len(y) < MIN_POINTS_TO_SMOOTH:
        ax.plot(x, y, marker="o", ms=4, color=colour, label=label)
        return
    raw, = ax.plot(x, y, lw=0.8, alpha=0.3, color=colour)
    ax.plot(x, y.ewm(span=ema_span(len(y))).mean(), lw=1.8, color=raw.get_color(), label=label)


def constant_metrics(curves: pd.DataFrame) -> dict[str, float]:
    """Metrics logged at two or more steps that never changed (a fixed learning rate, a
    coefficient): a flat line says nothing, so the panels leave them out and the report lists
    their value instead. A single point is no evidence of constancy (``single_step_metrics``)."""
    g = curves.groupby("metric")["value"]
    flat = (g.size() >= 2) & (g.max() == g.min())
    return {m: float(v) for m, v in g.first()[flat].items()}


def _grid(n: int, ncols: int, w: float = 3.6, h: float = 2.6):
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows + 0.5), layout="constrained")
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def single_step_metrics(curves: pd.DataFrame) -> list[str]:
    """Metrics logged at one step only (a one-iteration stage of a joint round): a panel with one
    dot is no curve, so they are not plotted; the Markdown report's tables hold their values."""
    n = curves.groupby("metric")["step"].nunique()
    return sorted(n[n < 2].index)


def learning_curves(curves: pd.DataFrame, title: str, path: Path) -> Path | None:
    """One panel per metric of one run and level that changed over two or more steps; None when
    there is no such metric."""
    skip = set(constant_metrics(curves)) | set(single_step_metrics(curves))
    metrics = [(m, g) for m, g in curves.groupby("metric") if m not in skip]
    if not metrics:
        return None
    fig, axes = _grid(len(metrics), 3)
    level = curves["level"].iloc[0]
    for ax, (metric, g) in zip(axes, metrics):
        smoothed(ax, g["step"], g["value"])
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel(x_label(level), fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps and rounds are whole numbers
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_png(fig, path)


def _panels_by_source(table: pd.DataFrame, draw, ylabel: str, title: str, path: Path) -> Path:
    groups = list(table.groupby(["run", "level"], sort=True))
    fig, axes = _grid(len(groups), 2, w=5.2, h=3.4)
    for ax, ((run, level), g) in zip(axes, groups):
        draw(ax, g)
        ax.set(xlabel=x_label(level), ylabel=ylabel, title=f"{run} ({level})")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_png(fig, path)


def q_per_strategy(q: pd.DataFrame, path: Path) -> Path:
    def draw(ax, g):
        for name, s in g.groupby("name"):
            smoothed(ax, s["step"], s["value"], label=name)
    return _panels_by_source(q, draw, "mean Q over logged states", "Q per strategy", path)


def bonus_per_transition(bt: pd.DataFrame, path: Path) -> Path:
    def draw(ax, g):
        for name in TRANSITIONS:
            s = g[g["transition"] == name]
            if s["mean"].notna().any():
                smoothed(ax, s["step"], s["mean"], TRANSITION_COLOURS[name], name.replace("_to_", " → "))
        ax.axhline(0.0, color="grey", lw=0.8)
    return _panels_by_source(bt, draw, "mean bonus per refine", "Context bonus per transition", path)
