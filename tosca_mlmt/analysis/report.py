"""The Markdown report of ``mlmt analyze``: the result first (``headline``), then every table
inline, every figure linked by a relative path, so the output folder can be moved or shared as a
whole. ``html`` renders the curated, self-contained page next to it."""

from __future__ import annotations

import pandas as pd

from tosca_mlmt.analysis.captions import data_sentence, md_table
from tosca_mlmt.analysis.headline import Headline, headline_md
from tosca_mlmt.analysis.tables import CELLS, EVAL, TRAIN, Tables, curve_table, focus_snapshot


def _figure(figures: dict[str, str], key: str, title: str, caption: str = "") -> list[str]:
    if key not in figures:
        return []
    return [f"![{title}]({figures[key]})", ""] + ([f"_{caption}_", ""] if caption else [])


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
           "that changed over two or more steps (constant ones, such as a fixed `lr`, are only in the tables). "
           "They are training metrics, each computed on its step's sampled batch, not held-out results.", ""]
    if not len(t.curves):
        return out + _missing("no lower/upper/joint metrics in the metrics.jsonl files")
    for (run, level), g in t.curves.groupby(["run", "level"]):
        out += [f"### {run}: {level}", "", f"Steps logged: {g['step'].nunique()}.", ""]
        out += _figure(figures, f"curves:{run}:{level}", f"{run} {level} learning curves")
        out += [md_table(curve_table(g)), ""]
    return out


def _accuracy(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Accuracy per turn over snapshots", "",
           "Attempt 1 is the solver's first answer (turn 1); attempt k+1 its answer after feedback round k. "
           "Training batches and held-out evals are in separate panels.", ""]
    if not len(t.accuracy):
        return out + _missing("no snapshots")
    wide = t.accuracy.pivot(index=["order", "snapshot"], columns="attempt", values="accuracy")
    wide.columns = [f"attempt {a}" for a in wide.columns]
    first = t.accuracy[t.accuracy["attempt"] == 1].set_index(["order", "snapshot"])
    wide.insert(0, "problems", first["problems"])
    wide.insert(0, "episodes", first["episodes"])
    wide = wide.reset_index().merge(t.snapshots[["order", "source"]], on="order")
    wide.insert(2, "source", wide.pop("source"))
    out += _figure(figures, "accuracy", "accuracy per turn", data_sentence(t.sources, explain=True))
    return out + [md_table(wide.rename(columns={"order": "#"})), ""]


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


def focus_grid(t: Tables) -> tuple[str, pd.DataFrame]:
    """The 2 x 2 turn-1 vs final grid of the one snapshot the report shows alone (the newest held-out
    eval, else the newest snapshot), and a line saying which snapshot that is. One snapshot, never a
    pool: a sampled training batch and a greedy eval do not add up."""
    order = focus_snapshot(t.snapshots, t.correction["order"])
    one = t.correction[t.correction["order"] == order].set_index(["turn1", "final"])
    snap = t.snapshots.set_index("order").loc[order]
    grid = pd.DataFrame({f"final {b}": [f"{one.at[(a, b), 'count']} ({one.at[(a, b), 'rate']:.1%})"
                                        for a in ("right", "wrong")] for b in ("right", "wrong")},
                        index=["turn 1 right", "turn 1 wrong"])
    kind = "newest held-out eval" if snap["source"] == EVAL else "newest snapshot (no held-out eval among the inputs)"
    return f"The {kind}, #{order} `{snap['snapshot']}` ({int(one['count'].sum())} episodes)", grid


def _correction(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Correction matrix (turn 1 vs final)", "",
           "Counts, and in brackets rates as fractions of the snapshot's episodes (so wrong->right - right->wrong "
           "= Acc@final - Acc@t1). No table pools snapshots.", ""]
    if not len(t.correction):
        return out + _missing("no snapshots")
    which, grid = focus_grid(t)
    out += [f"{which}:", "", md_table(grid.rename_axis("").reset_index()), ""]
    out += _figure(figures, "correction", "correction matrix", data_sentence(t.sources))
    cells = _cells(t.correction).merge(t.snapshots[["order", "source"]].rename(columns={"order": "#"}), on="#")
    cells.insert(2, "source", cells.pop("source"))
    return out + ["Per snapshot:", "", md_table(cells), ""]


def _strategies(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Strategy distribution and value over time", "",
           "Per snapshot: feedback turns per strategy, their share, and the mean final reward and mean "
           "improvement (r_final - r1) of their episodes.", ""]
    if not len(t.strategies):
        return out + _missing("no feedback turns in the snapshots")
    out += _figure(figures, "strategies", "strategies", data_sentence(t.sources, only=sources_of(t, t.strategies)))
    out += [md_table(t.strategies.rename(columns={"order": "#"})), "",
            "Per snapshot: each strategy's share of the feedback that followed a right attempt and of the "
            "feedback that followed a wrong one. Equal shares say the writer's choice ignores correctness.", ""]
    out += _figure(figures, "strategy_correctness", "strategy by correctness",
                   data_sentence(t.sources, only=sources_of(t, t.strategy_correctness)))
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
           "`lower/bonus/corr_correct` (its correlation with a correct answer) next to the accuracy, per step: "
           "training metrics of each PPO update's sampled batch (`metrics.jsonl`).", ""]
    if not len(t.bonus):
        return out + _missing("no lower/bonus/mean in the metrics.jsonl files")
    out += _figure(figures, "bonus", "bonus vs correctness")
    return out + [md_table(t.bonus), ""]


def sources_of(t: Tables, table: pd.DataFrame) -> tuple[str, ...]:
    """The sources (training batches, held-out evals) of a per-snapshot table's rows."""
    have = set(t.snapshots.loc[t.snapshots["order"].isin(table["order"]), "source"])
    return tuple(s for s in (TRAIN, EVAL) if s in have)


def _feedback_length(t: Tables, figures: dict[str, str]) -> list[str]:
    out = ["## Feedback length vs outcome", "",
           "Feedback turns, per source (training batches and held-out evals apart), bucketed by length in "
           "tokens: their episodes' final accuracy and mean improvement (r_final - r1).", ""]
    if not len(t.feedback_length):
        return out + _missing("no feedback turns in the snapshots")
    out += _figure(figures, "feedback_length", "feedback length vs outcome",
                   data_sentence(t.sources, only=tuple(dict.fromkeys(t.feedback_length["source"]))))
    return out + [md_table(t.feedback_length), ""]


def environment_lines(snapshots: pd.DataFrame) -> list[str]:
    """A privileged environment (the writer saw the verifier's verdict or grading output) is a sanity check,
    not a result: say so above everything, and name the snapshots, so its numbers are never read as honest."""
    env = snapshots["environment"]
    if not len(env):
        return []
    privileged = sorted(set(e for e in env if str(e).startswith("privileged")))  # honest:tool is honest
    if not privileged:
        return ["Environment: **honest** (the writer saw only the problem and the attempts it may see at test "
                "time).", ""]
    mixed = " Honest and privileged snapshots are **mixed** in this report: compare rows only within one " \
            "environment." if (~env.astype(str).str.startswith("privileged")).any() else ""
    return [f"> **Privileged environment** ({', '.join(f'`{e}`' for e in privileged)}): the writer saw the "
            "verifier's verdict or its grading tests' output, which no honest system has at test time. These "
            f"numbers are a sanity check of the learning machinery, not a result.{mixed} The `environment` column "
            "of the snapshot table says which row is which.", ""]


def render_report(t: Tables, figures: dict[str, str], sources: list[str], headline: Headline | None = None) -> str:
    """``headline``: the before/after result (``pipelines.analyze.before_after``); None says no eval
    folder was given."""
    headline = headline or Headline(note="no eval folder (one holding an eval.json) among the inputs")
    lines = ["# mlmt analyze", "", "From " + ", ".join(f"`{s}`" for s in sources) + ". The curated figures, with "
             "captions and sample episodes, are in `report.html` (one self-contained file).", "",
             *headline_md(headline, t),
             *environment_lines(t.snapshots),
             *_inputs(t)]
    for section in (_curves, _accuracy, _correction, _strategies, _q_and_transitions, _bonus, _feedback_length):
        lines += section(t, figures)
    return "\n".join(lines).rstrip() + "\n"
