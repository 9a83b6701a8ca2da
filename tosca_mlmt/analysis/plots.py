"""PNG figures for ``mlmt analyze``, one function per figure: table in, file out.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot): no display is needed
and no global figure state leaks between calls.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tosca_mlmt.analysis.tables import Tables

DPI = 90
SNAPSHOT_AXIS = "snapshot # (oldest first)"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def _integer_x(ax) -> None:
    ax.xaxis.get_major_locator().set_params(integer=True)


def learning_curves(curves: pd.DataFrame, title: str, path: Path) -> Path:
    """One panel per metric of one run and level."""
    metrics = list(curves.groupby("metric"))
    ncols = min(4, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(3.2 * ncols, 2.3 * nrows + 0.4), layout="constrained")
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax, (metric, g) in zip(axes, metrics):
        ax.plot(g["step"], g["value"], marker="." if len(g) <= 50 else None)
        ax.set_title(metric, fontsize=9)
        ax.tick_params(labelsize=7)
        _integer_x(ax)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return _save(fig, path)


def accuracy_per_turn(acc: pd.DataFrame, path: Path) -> Path:
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    for attempt, g in acc.groupby("attempt"):
        ax.plot(g["order"], g["accuracy"], marker="o", label=f"attempt {attempt}")
    ax.set(xlabel=SNAPSHOT_AXIS, ylabel="accuracy", ylim=(-0.02, 1.02), title="Accuracy per solver attempt")
    _integer_x(ax)
    ax.legend()
    return _save(fig, path)


def correction_matrix(pooled: pd.DataFrame, per_snapshot: pd.DataFrame, path: Path) -> Path:
    """Left: the pooled 2x2 matrix; right: the two off-diagonal rates per snapshot."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.6])
    cells = pooled.set_index(["turn1", "final"])
    labels = ["right", "wrong"]
    left.imshow([[cells.at[(a, b), "count"] for b in labels] for a in labels], cmap="Blues")
    for i, a in enumerate(labels):
        for j, b in enumerate(labels):
            left.text(j, i, f"{cells.at[(a, b), 'count']}\n({cells.at[(a, b), 'rate']:.1%})", ha="center",
                      va="center")
    left.set(xticks=[0, 1], yticks=[0, 1], xticklabels=labels, yticklabels=labels,
             xlabel="final", ylabel="turn 1", title="All snapshots")
    for (a, b), g in per_snapshot.groupby(["turn1", "final"]):
        if a != b:
            right.plot(g["order"], g["rate"], marker="o", label=f"{a} -> {b}")
    right.set(xlabel=SNAPSHOT_AXIS, ylabel="fraction of episodes", title="Corrections per snapshot")
    _integer_x(right)
    right.legend()
    return _save(fig, path)


def strategies(strat: pd.DataFrame, path: Path) -> Path:
    """Left: share of feedback turns per strategy (stacked); right: its mean improvement."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    share = strat.pivot(index="order", columns="strategy", values="share").fillna(0.0)
    bottom = pd.Series(0.0, index=share.index)
    for name in share.columns:
        left.bar(share.index, share[name], bottom=bottom, label=name)
        bottom += share[name]
    left.set(xlabel=SNAPSHOT_AXIS, ylabel="share of feedback turns", title="Strategy distribution")
    for name, g in strat.groupby("strategy"):
        right.plot(g["order"], g["mean_improvement"], marker="o", label=name)
    right.axhline(0.0, color="grey", lw=0.8)
    right.set(xlabel=SNAPSHOT_AXIS, ylabel="mean r_final - r1", title="Strategy value")
    for ax in (left, right):
        _integer_x(ax)
        ax.legend(fontsize=8)
    return _save(fig, path)


def bonus(bonus_table: pd.DataFrame, path: Path) -> Path:
    """Left: bonus and its correlation with correctness over steps; right: bonus vs accuracy."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for run, g in bonus_table.groupby("run"):
        left.plot(g["step"], g["bonus/mean"], marker=".", label=f"{run}: bonus/mean")
        left.plot(g["step"], g["bonus/corr_correct"], marker="x", ls="--", label=f"{run}: corr(bonus, correct)")
        dots = right.scatter(g["bonus/mean"], g["acc_final"], c=g["step"], cmap="viridis", label=run)
    left.set(xlabel="step", title="Context-dependency bonus")
    _integer_x(left)
    left.legend(fontsize=7)
    right.set(xlabel="bonus/mean", ylabel="acc_final", title="Bonus vs final accuracy (colour: step)")
    fig.colorbar(dots, ax=right)
    return _save(fig, path)


def feedback_length(fl: pd.DataFrame, path: Path) -> Path:
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    x = list(range(len(fl)))
    ax.bar([i - 0.2 for i in x], fl["final_accuracy"], width=0.4, label="final accuracy")
    ax.bar([i + 0.2 for i in x], fl["mean_improvement"], width=0.4, label="mean r_final - r1")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(x, [f"{t}\nn={n}" for t, n in zip(fl["tokens"], fl["feedback_turns"])])
    ax.set(xlabel="feedback length (tokens)", title="Feedback length vs outcome")
    ax.legend()
    return _save(fig, path)


def draw_all(t: Tables, out: Path) -> dict[str, str]:
    """Every figure whose table has rows, drawn into ``out``. Returns file names by report
    key: ``curves:<run>:<level>``, ``accuracy``, ``correction``, ``strategies``, ``bonus``,
    ``feedback_length``."""
    files: dict[str, str] = {}
    for i, ((run, level), g) in enumerate(t.curves.groupby(["run", "level"])):
        files[f"curves:{run}:{level}"] = learning_curves(g, f"{run}: {level}", out / f"curves-{i:02d}-{level}.png").name
    if len(t.accuracy):
        files["accuracy"] = accuracy_per_turn(t.accuracy, out / "accuracy_per_turn.png").name
    if len(t.correction):
        files["correction"] = correction_matrix(t.correction_all, t.correction, out / "correction_matrix.png").name
    if len(t.strategies):
        files["strategies"] = strategies(t.strategies, out / "strategies.png").name
    if len(t.bonus):
        files["bonus"] = bonus(t.bonus, out / "bonus_vs_correctness.png").name
    if len(t.feedback_length):
        files["feedback_length"] = feedback_length(t.feedback_length, out / "feedback_length.png").name
    return files
