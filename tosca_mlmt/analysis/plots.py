"""PNG figures for ``mlmt analyze``, one function per figure: table in, file out.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot): no display is needed
and no global figure state leaks between calls. Every per-snapshot figure has one panel per
source (training batches, held-out evals), titled with what a point is (``captions.panel_title``):
no figure pools the two or joins them into one line.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from tosca_mlmt.analysis import curves
from tosca_mlmt.analysis.captions import titles
from tosca_mlmt.analysis.curves import TRANSITION_COLOURS, save_png as _save
from tosca_mlmt.analysis.tables import EVAL, PLURAL, TRAIN, Tables, focus_snapshot

SNAPSHOT_AXIS = "snapshot # (oldest first)"


def _integer_x(ax) -> None:
    ax.xaxis.get_major_locator().set_params(integer=True)


def _present(table: pd.DataFrame, snapshots: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """``table`` with each row's source, and the sources it has, training batches first."""
    table = table.merge(snapshots[["order", "source"]], on="order") if "source" not in table else table
    return table, [s for s in (TRAIN, EVAL) if (table["source"] == s).any()]


def _one_snapshot_axis(ax, orders: pd.Series) -> None:
    if orders.nunique() == 1:  # one eval: centre it instead of a hair-thin autoscaled axis
        ax.set_xlim(orders.iloc[0] - 1, orders.iloc[0] + 1)


def accuracy_per_turn(acc: pd.DataFrame, snapshots: pd.DataFrame, path: Path,
                      panel: dict[str, str] | None = None) -> Path:
    """Accuracy per solver attempt with 95 % bootstrap intervals, training batches and held-out
    evals in separate panels: sampled training episodes and greedy test episodes measure
    different things, and one line through both would read as a trend that is not there.
    ``panel``: title per source (what a point is); default the source's name."""
    acc, sources = _present(acc, snapshots)
    panel = panel or {}
    fig = Figure(figsize=(5.5 * len(sources) + 0.5, 4), layout="constrained")
    axes = fig.subplots(1, len(sources), sharey=True, squeeze=False)[0]
    for ax, source in zip(axes, sources):
        for attempt, g in acc[acc["source"] == source].groupby("attempt"):
            line, = ax.plot(g["order"], g["accuracy"], marker="o", label=f"attempt {attempt}")
            ax.fill_between(g["order"], g["lo"], g["hi"], color=line.get_color(), alpha=0.15, lw=0)
            ax.errorbar(g["order"], g["accuracy"], yerr=[g["accuracy"] - g["lo"], g["hi"] - g["accuracy"]],
                        fmt="none", ecolor=line.get_color(), capsize=3, lw=1)
        orders = acc.loc[acc["source"] == source, "order"]
        _one_snapshot_axis(ax, orders)
        ax.set(xlabel=SNAPSHOT_AXIS, ylim=(-0.02, 1.02))
        ax.set_title(panel.get(source, PLURAL[source]), fontsize=9)
        _integer_x(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy (95 % bootstrap interval)")
    return _save(fig, path)


def correction_matrix(per_snapshot: pd.DataFrame, snapshots: pd.DataFrame, path: Path,
                      panel: dict[str, str] | None = None) -> Path:
    """Left: the 2x2 matrix of one snapshot (``tables.focus_snapshot``: the newest held-out eval,
    else the newest snapshot); right: the four cells' rates per snapshot, stacked to 1, one panel
    per source. No panel pools snapshots: counts of a sampled batch and of a greedy eval do not add."""
    per_snapshot, sources = _present(per_snapshot, snapshots)
    panel = panel or {}
    fig = Figure(figsize=(4.5 + 5 * len(sources), 4), layout="constrained")
    left, *rights = fig.subplots(1, 1 + len(sources), width_ratios=[1] + [1.4] * len(sources))
    focus = focus_snapshot(snapshots, per_snapshot["order"])
    one = per_snapshot[per_snapshot["order"] == focus]
    cells = one.set_index(["turn1", "final"])
    labels = ["right", "wrong"]
    left.imshow([[cells.at[(a, b), "count"] for b in labels] for a in labels], cmap="Blues")
    for i, a in enumerate(labels):
        for j, b in enumerate(labels):
            left.text(j, i, f"{cells.at[(a, b), 'count']}\n({cells.at[(a, b), 'rate']:.1%})", ha="center",
                      va="center", bbox={"facecolor": "white", "alpha": 0.7, "lw": 0})
    kind = "held-out eval" if one["source"].iloc[0] == EVAL else "training batch"
    left.set(xticks=[0, 1], yticks=[0, 1], xticklabels=labels, yticklabels=labels, xlabel="final", ylabel="turn 1")
    left.set_title(f"{kind} #{focus} (n = {int(one['count'].sum())} episodes)", fontsize=9)
    for right, source in zip(rights, sources):
        rates = per_snapshot[per_snapshot["source"] == source]
        rates = rates.assign(cell=rates["turn1"] + "_to_" + rates["final"]).pivot(
            index="order", columns="cell", values="rate")
        bottom = pd.Series(0.0, index=rates.index)
        # right->right at the bottom, wrong->wrong on top: the two middle bands are the corrections
        for cell in ("right_to_right", "wrong_to_right", "right_to_wrong", "wrong_to_wrong"):
            right.bar(rates.index, rates[cell], bottom=bottom, color=TRANSITION_COLOURS[cell],
                      label=cell.replace("_to_", " → "))
            bottom += rates[cell]
        _one_snapshot_axis(right, pd.Series(rates.index))
        right.set(xlabel=SNAPSHOT_AXIS, ylabel="fraction of episodes", ylim=(0, 1))
        right.set_title(panel.get(source, PLURAL[source]), fontsize=9)
        _integer_x(right)
    rights[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def _colours(names) -> dict[str, str]:
    """One colour per strategy across every panel of a figure."""
    return {n: f"C{i % 10}" for i, n in enumerate(sorted(set(names)))}


def strategies(strat: pd.DataFrame, snapshots: pd.DataFrame, path: Path, panel: dict[str, str] | None = None) -> Path:
    """Per source, a row of two panels. Left: share of feedback turns per strategy (stacked);
    right: its mean improvement."""
    strat, sources = _present(strat, snapshots)
    panel, colour = panel or {}, _colours(strat["strategy"])
    fig = Figure(figsize=(11, 3.6 * len(sources) + 0.4), layout="constrained")
    for (left, right), source in zip(fig.subplots(len(sources), 2, squeeze=False), sources):
        g = strat[strat["source"] == source]
        share = g.pivot(index="order", columns="strategy", values="share").fillna(0.0)
        bottom = pd.Series(0.0, index=share.index)
        for name in share.columns:
            left.bar(share.index, share[name], bottom=bottom, label=name, color=colour[name])
            bottom += share[name]
        left.set(xlabel=SNAPSHOT_AXIS, ylabel="share of feedback turns")
        for name, s in g.groupby("strategy"):
            right.plot(s["order"], s["mean_improvement"], marker="o", label=name, color=colour[name])
        right.axhline(0.0, color="grey", lw=0.8)
        right.set(xlabel=SNAPSHOT_AXIS, ylabel="mean r_final - r1")
        left.set_title(f"Strategy distribution, {panel.get(source, PLURAL[source])}", fontsize=9)
        right.set_title(f"Strategy value, {PLURAL[source]}", fontsize=9)
        for ax in (left, right):
            _one_snapshot_axis(ax, g["order"])
            _integer_x(ax)
            ax.legend(fontsize=8)
    return _save(fig, path)


def strategy_by_correctness(sc: pd.DataFrame, snapshots: pd.DataFrame, path: Path,
                            panel: dict[str, str] | None = None) -> Path:
    """Each strategy's share of the feedback after a right attempt (solid) and after a wrong one
    (dashed), per snapshot, in one colour per strategy, one panel per source: lines that sit on
    each other say the writer's choice ignores whether the attempt was right."""
    sc, sources = _present(sc, snapshots)
    panel, colour = panel or {}, _colours(sc["strategy"])
    fig = Figure(figsize=(2 + 5.5 * len(sources), 4.2), layout="constrained")
    axes = fig.subplots(1, len(sources), sharey=True, squeeze=False)[0]
    for ax, source in zip(axes, sources):
        for name, g in sc[sc["source"] == source].groupby("strategy"):
            for after, style in (("right", "-"), ("wrong", "--")):
                s = g[g["after"] == after]
                if len(s):
                    ax.plot(s["order"], s["share"], ls=style, marker="o", color=colour[name],
                            label=f"{name} after {after}")
        ax.set(xlabel=SNAPSHOT_AXIS, ylim=(-0.02, 1.02))
        ax.set_title(panel.get(source, PLURAL[source]), fontsize=9)
        _one_snapshot_axis(ax, sc.loc[sc["source"] == source, "order"])
        _integer_x(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of the feedback")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Writer's choice after right (solid) and wrong (dashed) attempts")
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
    """One panel per source (``fl`` has a ``source`` column): its feedback turns by length bucket."""
    sources = [s for s in (TRAIN, EVAL) if (fl["source"] == s).any()]
    fig = Figure(figsize=(1 + 6 * len(sources), 4), layout="constrained")
    for ax, source in zip(fig.subplots(1, len(sources), squeeze=False)[0], sources):
        g = fl[fl["source"] == source]
        x = list(range(len(g)))
        ax.bar([i - 0.2 for i in x], g["final_accuracy"], width=0.4, label="final accuracy")
        ax.bar([i + 0.2 for i in x], g["mean_improvement"], width=0.4, label="mean r_final - r1")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(x, [f"{t}\nn={n}" for t, n in zip(g["tokens"], g["feedback_turns"])])
        ax.set(xlabel="feedback length (tokens)")
        ax.set_title(f"{PLURAL[source]}: {g['feedback_turns'].sum()} feedback turns", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("Feedback length vs outcome")
    return _save(fig, path)


def draw_all(t: Tables, out: Path) -> dict[str, str]:
    """Every figure whose table has rows, drawn into ``out``. Returns file names by report
    key: ``curves:<run>:<level>`` (absent when all its metrics are constant), ``accuracy``,
    ``correction``, ``q_values``, ``bonus_transitions``, ``strategies``, ``strategy_correctness``,
    ``bonus``, ``feedback_length``."""
    files: dict[str, str] = {}
    for i, ((run, level), g) in enumerate(t.curves.groupby(["run", "level"])):
        drawn = curves.learning_curves(g, f"{run}: {level}", out / f"curves-{i:02d}-{level}.png")
        if drawn is not None:
            files[f"curves:{run}:{level}"] = drawn.name
    panel = titles(t.sources)
    if len(t.accuracy):
        files["accuracy"] = accuracy_per_turn(t.accuracy, t.snapshots, out / "accuracy_per_turn.png", panel).name
    if len(t.correction):
        files["correction"] = correction_matrix(t.correction, t.snapshots, out / "correction_matrix.png", panel).name
    if len(t.q_values):
        files["q_values"] = curves.q_per_strategy(t.q_values, out / "q_per_strategy.png").name
    if len(t.bonus_transitions):
        files["bonus_transitions"] = curves.bonus_per_transition(t.bonus_transitions,
                                                                 out / "bonus_per_transition.png").name
    if len(t.strategies):
        files["strategies"] = strategies(t.strategies, t.snapshots, out / "strategies.png", panel).name
    if len(t.strategy_correctness):
        files["strategy_correctness"] = strategy_by_correctness(t.strategy_correctness, t.snapshots,
                                                                out / "strategy_by_correctness.png", panel).name
    if len(t.bonus):
        files["bonus"] = bonus(t.bonus, out / "bonus_vs_correctness.png").name
    if len(t.feedback_length):
        files["feedback_length"] = feedback_length(t.feedback_length, out / "feedback_length.png").name
    return files
