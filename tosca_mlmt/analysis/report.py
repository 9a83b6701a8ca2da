"""The Markdown report of ``mlmt analyze``: every table inline, every figure linked by a
relative path, so the output folder can be moved or shared as a whole. ``html`` renders the
curated, self-contained page next to it."""

from __future__ import annotations

import pandas as pd

from tosca_mlmt.analysis.tables import CELLS, Tables, curve_table


def _cell(v) -> str:
    if not isinstance(v, str) and pd.isna(v):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def md_table(df: pd.DataFrame) -> str:
    """GitHub-flavoured Markdown; numeric columns right-aligned, NaN as an empty cell."""
    align = ["---:" if pd.api.types.is_numeric_dtype(df[c]) else "---" for c in df.columns]
    rows = [[_cell(c) for c in df.columns], align, *[[_cell(v) for v in r] for r in df.itertuples(index=False)]]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _figure(figures: dict[str, str], key: str, title: str) -> list[str]:
    return [f"![{title}]({figures[key]})", ""] if key in figures else []


def _missing(what: str) -> list[str]:
    return [f"_Not available: {what}._", ""]


def _inputs(t: Tables) -> list[str]:
    out = ["## Inputs", ""]
    out += ["Run metrics (`metrics.jsonl`):", "", md_table(t.runs), ""] if len(t.runs) else _missing("no metrics.jsonl")
    snaps = t.snapshots.rename(columns={"order": "#"})
    out += ["Snapshots, oldest first (`#` is the x axis of the snapshot figures):", "", md_table(snaps), ""] \
        if len(snaps) else _missing("no snapshots")
    return out


def _curves(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Learning curves per level", "",
           "Every numeric `lower/*`, `upper/*`, `joint/*` metric per logged step (timings and throughput "
           "left out); tables show at most 10 evenly spread steps, the figures all of them, for the metrics "
           "that changed over two or more steps (constant ones, such as a fixed `lr`, are only in the tables).", ""]
    if not len(t.curves):
        return out + _missing("no lower/upper/joint metrics in the metrics.jsonl files")
    for (run, level), g in t.curves.groupby(["run", "level"]):
        out += [f"### {run}: {level}", "", f"Steps logged: {g['step'].nunique()}.", ""]
        out += _figure(figures, f"curves:{run}:{level}", f"{run} {level} learning curves")
        out += [md_table(curve_table(g)), ""]
    return out


def _accuracy(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Accuracy per turn over snapshots", "",
           "Attempt 1 is the solver's first answer (turn 1); attempt k+1 its answer after feedback round k.", ""]
    if not len(t.accuracy):
        return out + _missing("no snapshots")
    wide = t.accuracy.pivot(index=["order", "snapshot"], columns="attempt", values="accuracy")
    wide.columns = [f"attempt {a}" for a in wide.columns]
    episodes = t.accuracy[t.accuracy["attempt"] == 1].set_index(["order", "snapshot"])["episodes"]
    wide.insert(0, "episodes", episodes)
    out += _figure(figures, "accuracy", "accuracy per turn")
    return out + [md_table(wide.reset_index().rename(columns={"order": "#"})), ""]


def _cells(matrix: pd.DataFrame) -> pd.DataFrame:
    """One row per snapshot: 'count (rate)' per cell, episodes, and Acc@final - Acc@t1."""
    text = matrix.assign(cell=matrix["turn1"] + "->" + matrix["final"],
                         value=[f"{c} ({r:.1%})" for c, r in zip(matrix["count"], matrix["rate"])])
    wide = text.pivot(index=["order", "snapshot"], columns="cell", values="value")[[f"{a}->{b}" for a, b in CELLS]]
    rate = matrix.set_index(["order", "snapshot", "turn1", "final"])["rate"]
    wide.insert(0, "episodes", matrix.groupby(["order", "snapshot"])["count"].sum())
    wide["acc_final - acc_t1"] = (rate.xs(("wrong", "right"), level=["turn1", "final"])
                                  - rate.xs(("right", "wrong"), level=["turn1", "final"]))
    return wide.reset_index().rename(columns={"order": "#"})


def _correction(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Correction matrix (turn 1 vs final)", "",
           "Counts, and in brackets rates as fractions of all episodes (so wrong->right - right->wrong "
           "= Acc@final - Acc@t1).", ""]
    if not len(t.correction):
        return out + _missing("no snapshots")
    pooled = t.correction_all.set_index(["turn1", "final"])
    grid = pd.DataFrame({f"final {b}": [f"{pooled.at[(a, b), 'count']} ({pooled.at[(a, b), 'rate']:.1%})"
                                        for a in ("right", "wrong")] for b in ("right", "wrong")},
                        index=["turn 1 right", "turn 1 wrong"])
    out += ["All snapshots together:", "", md_table(grid.rename_axis("").reset_index()), ""]
    out += _figure(figures, "correction", "correction matrix")
    return out + ["Per snapshot:", "", md_table(_cells(t.correction)), ""]


def _strategies(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Strategy distribution and value over time", "",
           "Per snapshot: feedback turns per strategy, their share, and the mean final reward and mean "
           "improvement (r_final - r1) of their episodes.", ""]
    if not len(t.strategies):
        return out + _missing("no feedback turns in the snapshots")
    out += _figure(figures, "strategies", "strategies")
    out += [md_table(t.strategies.rename(columns={"order": "#"})), "",
            "Per snapshot: each strategy's share of the feedback that followed a right attempt and of the "
            "feedback that followed a wrong one. Equal shares say the writer's choice ignores correctness.", ""]
    out += _figure(figures, "strategy_correctness", "strategy by correctness")
    return out + [md_table(t.strategy_correctness.rename(columns={"order": "#"})), ""]


def _q_and_transitions(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Q per strategy and bonus per transition", "",
           "`q/<strategy>` of the upper level (a joint run: every round's, on its global step) and "
           "`lower/bonus/<transition>/mean` "
           "per step, raw faint and smoothed; the values are in the learning-curve tables above.", ""]
    if not len(t.q_values) and not len(t.bonus_transitions):
        return out + _missing("no q/* or bonus/<transition>/* metrics in the metrics.jsonl files")
    return out + _figure(figures, "q_values", "Q per strategy") + _figure(figures, "bonus_transitions",
                                                                          "bonus per transition")


def _bonus(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Context-dependency bonus vs correctness", "",
           "`lower/bonus/mean` (the solver's bonus for depending on the feedback) and "
           "`lower/bonus/corr_correct` (its correlation with a correct answer) next to the accuracy, per step.", ""]
    if not len(t.bonus):
        return out + _missing("no lower/bonus/mean in the metrics.jsonl files")
    out += _figure(figures, "bonus", "bonus vs correctness")
    return out + [md_table(t.bonus), ""]


def _feedback_length(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Feedback length vs outcome", "",
           "Feedback turns of every snapshot, bucketed by length in tokens: their episodes' final accuracy "
           "and mean improvement (r_final - r1).", ""]
    if not len(t.feedback_length):
        return out + _missing("no feedback turns in the snapshots")
    out += _figure(figures, "feedback_length", "feedback length vs outcome")
    return out + [md_table(t.feedback_length), ""]


def environment_lines(snapshots: pd.DataFrame) -> list[str]:
    """A privileged environment (the writer saw the verifier's verdict) is a sanity check, not a
    result: say so above everything, and name the snapshots, so its numbers are never read as honest."""
    env = snapshots["environment"]
    if not len(env):
        return []
    privileged = sorted(set(e for e in env if e != "honest"))
    if not privileged:
        return ["Environment: **honest** (the writer saw only the problem and the attempts it may see at test "
                "time).", ""]
    mixed = " Honest and privileged snapshots are **mixed** in this report: compare rows only within one " \
            "environment." if (env == "honest").any() else ""
    return [f"> **Privileged environment** ({', '.join(f'`{e}`' for e in privileged)}): the writer saw the "
            "verifier's verdict, which no honest system has at test time. These numbers are a sanity check of "
            f"the learning machinery, not a result.{mixed} The `environment` column of the snapshot table says "
            "which row is which.", ""]


def render_report(t: Tables, figures: dict[str, str], sources: list[str]) -> str:
    lines = ["# mlmt analyze", "", "From " + ", ".join(f"`{s}`" for s in sources) + ". The curated figures, with "
             "captions and sample episodes, are in `report.html` (one self-contained file).", "",
             *environment_lines(t.snapshots),
             *_inputs(t)]
    for section in (_curves, _accuracy, _correction, _strategies, _q_and_transitions, _bonus, _feedback_length):
        lines += section(t, figures)
    return "\n".join(lines).rstrip() + "\n"
