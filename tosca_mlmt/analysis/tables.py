"""Pure table builders for ``mlmt analyze``: DataFrames in, DataFrames out.

Inputs (``sources`` reads them):

* ``records``: one row per metrics.jsonl line: ``run``, ``line`` (1-based), the optional
  ``step`` and every logged key as a column.
* ``manifests``: snapshot manifests (dicts).
* ``turns``: one row per turn of every snapshot, the same columns whatever the snapshot's
  format version: ``snapshot``, ``episode_id``, ``problem_id``, ``turn_index``, ``round``, ``role``,
  ``kind``, ``reward``, ``correct`` (bool), ``response_len``, ``strategy_name``.
  ``compute_tables`` adds ``order``, the snapshot's position oldest first, and every
  per-snapshot table is sorted by it; and ``source`` (training batch or held-out eval): no table
  pools snapshots of the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tosca_mlmt.analysis.stats import bootstrap_mean
from tosca_mlmt.store import environment_of

LEVELS = ("lower", "upper", "joint")
# Clocks, throughput and the iteration, round and step counters describe the machine or the x axis, not
# learning (``<level>/step``: the stage's own step that a joint run's records carry beside the global one).
_BOOKKEEPING = re.compile(r"(^|/)time/|_seconds$|_per_s$|^iteration$|^round$|^step$")
CURVE_COLUMNS = ["run", "level", "metric", "step", "value"]
BONUS_METRICS = ["bonus/mean", "bonus/corr_correct", "acc_t1", "acc_final"]
CELLS = [("right", "right"), ("right", "wrong"), ("wrong", "right"), ("wrong", "wrong")]
SNAPSHOT_KEYS = ["order", "snapshot", "episode_id"]
# What a snapshot's episodes are: held-out evals (mlmt eval, greedy, the test split) answer a
# different question than the sampled batches training collects, so no figure puts them on one line.
TRAIN, EVAL = "training batch", "held-out eval"
PLURAL = {TRAIN: "training batches", EVAL: "held-out evals"}
SOURCE_ORDER = {TRAIN: 0, EVAL: 1}  # panels and rows: training first, then the evals that measure it
# lower/bonus/<transition>/mean (lower/stats.py): the four kinds of correction a refine made
TRANSITIONS = ["right_to_right", "right_to_wrong", "wrong_to_right", "wrong_to_wrong"]
# resamples per accuracy interval: enough for a figure's band, cheap over hundreds of snapshots
ACCURACY_BOOTSTRAP = 1000


@dataclass
class Tables:
    runs: pd.DataFrame  # run, records
    snapshots: pd.DataFrame  # snapshot_index
    outcomes: pd.DataFrame  # episode_outcomes (order added)
    curves: pd.DataFrame  # learning_curves
    q_values: pd.DataFrame  # metric_family(curves, "q/")
    bonus_transitions: pd.DataFrame  # bonus_per_transition
    bonus: pd.DataFrame  # bonus_vs_correctness
    accuracy: pd.DataFrame  # accuracy_per_turn
    correction: pd.DataFrame  # correction_matrix per snapshot
    strategies: pd.DataFrame  # strategy_over_time
    strategy_correctness: pd.DataFrame  # strategy_by_correctness
    feedback_length: pd.DataFrame  # feedback_length_outcome (per source)
    sources: pd.DataFrame  # source_summary: what a point of each source is


def compute_tables(records: pd.DataFrame, manifests: list[dict], turns: pd.DataFrame) -> Tables:
    snapshots = snapshot_index(manifests)
    turns = turns.merge(snapshots[["order", "snapshot", "source"]], on="snapshot")
    outcomes = episode_outcomes(turns)
    curves = learning_curves(records)
    accuracy = accuracy_per_turn(turns)
    return Tables(
        runs=records.groupby("run", sort=False).size().rename("records").reset_index(),
        snapshots=snapshots, outcomes=outcomes, curves=curves, q_values=metric_family(curves, "q/"),
        bonus_transitions=bonus_per_transition(curves), bonus=bonus_vs_correctness(curves),
        accuracy=accuracy, correction=correction_matrix(outcomes),
        strategies=strategy_over_time(turns, outcomes), strategy_correctness=strategy_by_correctness(turns),
        feedback_length=feedback_length_outcome(turns, outcomes), sources=source_summary(snapshots, accuracy))


# ---------------------------------------------------------------------- run metrics


def _is_learning_key(key: str) -> bool:
    level, _, metric = key.partition("/")
    return level in LEVELS and bool(metric) and not _BOOKKEEPING.search(metric)


def learning_curves(records: pd.DataFrame) -> pd.DataFrame:
    """Every numeric ``lower/*``, ``upper/*``, ``joint/*`` learning metric as (run, level,
    metric, step, value). ``step`` is the record's ``step`` or, without one, its line number."""
    keys = [c for c in records.columns if _is_learning_key(c)]
    if not keys:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    step = pd.to_numeric(records["step"], errors="coerce") if "step" in records else pd.Series(np.nan, records.index)
    long = (records[keys].assign(run=records["run"], step=step.fillna(records["line"]))
            .melt(["run", "step"], var_name="key", value_name="value"))
    long["value"] = pd.to_numeric(long["value"], errors="coerce")  # ids and other strings are not curves
    long = long.dropna(subset=["value"])
    # A resumed run logs the steps after its last checkpoint again: the later record wins.
    long = long.drop_duplicates(["run", "key", "step"], keep="last")
    long[["level", "metric"]] = long["key"].str.split("/", n=1, expand=True)
    long["step"] = long["step"].astype("int64")
    return long.sort_values(["run", "level", "metric", "step"])[CURVE_COLUMNS].reset_index(drop=True)


def curve_table(curves: pd.DataFrame, max_steps: int = 10) -> pd.DataFrame:
    """One run and level: a row per metric, a column per step. At most ``max_steps`` evenly
    spread steps (first and last kept) so long runs stay readable; the plot has them all."""
    wide = curves.pivot(index="metric", columns="step", values="value")
    if wide.shape[1] > max_steps:
        wide = wide.iloc[:, np.unique(np.linspace(0, wide.shape[1] - 1, max_steps).round().astype(int))]
    wide.columns = [f"step {s}" for s in wide.columns]
    return wide.reset_index()


def bonus_vs_correctness(curves: pd.DataFrame) -> pd.DataFrame:
    """The solver's context-dependency bonus next to its accuracy, per run and step, for the
    steps that logged ``lower/bonus/mean``. ``bonus/corr_correct`` is NaN where undefined."""
    low = curves[(curves["level"] == "lower") & curves["metric"].isin(BONUS_METRICS)]
    wide = (low.pivot(index=["run", "step"], columns="metric", values="value")
            .reindex(columns=BONUS_METRICS).rename_axis(columns=None).reset_index())
    return wide.dropna(subset=["bonus/mean"]).reset_index(drop=True)


def _nested_in_joint(run: str, joint_runs: set[str]) -> bool:
    return any(run.startswith(j + "/") for j in joint_runs)


def metric_family(curves: pd.DataFrame, prefix: str, levels=("upper", "joint")) -> pd.DataFrame:
    """The curves whose metric starts with ``prefix`` (``q/`` gives one row per strategy and
    step), with ``name`` = the rest of the metric. A joint run logs its stages' records on one
    global step (older joint runs: each round's final value under ``joint/``); its rounds' nested
    stage runs restart their steps every round, so they are left out where a run they sit in has
    the family: one line per name across the whole run."""
    fam = curves[curves["level"].isin(levels) & curves["metric"].str.startswith(prefix)]
    fam = fam.assign(name=fam["metric"].str[len(prefix):])
    runs = set(fam["run"])
    keep = [not _nested_in_joint(r, runs) for r in fam["run"]]
    return fam[keep].reset_index(drop=True)


def bonus_per_transition(curves: pd.DataFrame) -> pd.DataFrame:
    """``bonus/<transition>/mean`` and ``/count`` per run, level and step: the context bonus the
    refines of each kind of correction earned (NaN mean where a step had none of that kind)."""
    fam = metric_family(curves, "bonus/", levels=("lower", "joint"))
    parts = fam["name"].str.split("/", expand=True) if len(fam) else pd.DataFrame(columns=[0, 1])
    fam = fam.assign(transition=parts[0], stat=parts[1] if 1 in parts else None)
    fam = fam[fam["transition"].isin(TRANSITIONS) & fam["stat"].isin(["mean", "count"])]
    cols = ["run", "level", "step", "transition", "mean", "count"]
    if not len(fam):
        return pd.DataFrame(columns=cols)
    wide = fam.pivot_table(index=["run", "level", "step", "transition"], columns="stat", values="value",
                           aggfunc="last", dropna=False).reindex(columns=["mean", "count"])
    return wide.rename_axis(columns=None).reset_index()[cols].dropna(subset=["count"]).reset_index(drop=True)


# ---------------------------------------------------------------------- snapshots


def snapshot_index(manifests: list[dict]) -> pd.DataFrame:
    """One row per snapshot, oldest first: by ``created_at``, then ``iteration`` (train-lower
    can write several snapshots within the same second), then id; ``order`` numbers them."""
    df = pd.DataFrame([{
        "snapshot": m["id"], "created_at": m.get("created_at", ""), "iteration": m.get("iteration"),
        "kind": m.get("kind", ""), "format_version": m["format_version"],
        "episodes": m.get("rows", {}).get("episodes"),
        "source": EVAL if (m.get("task") or {}).get("split") in ("test", "test-unseen") else TRAIN,
        "temperature": solve_temperature(m),
        # the label mlmt snapshots shows too: "privileged:..." when the writer saw the verifier
        "environment": environment_of(m)} for m in manifests],
        columns=["snapshot", "created_at", "iteration", "kind", "format_version", "episodes", "source", "temperature",
                 "environment"])
    df["iteration"] = df["iteration"].astype("Int64")
    df["temperature"] = df["temperature"].astype(float)
    df = df.sort_values(["created_at", "iteration", "snapshot"], na_position="last").reset_index(drop=True)
    return df.rename_axis("order").reset_index()


def solve_temperature(manifest: dict) -> float | None:
    """The solver's turn-1 temperature of a snapshot's episodes (0 = greedy): a collect's
    ``collect.solve_temperature`` where it set one (>= 0), else the manifest's solver sampling
    (train-lower's batches always sample at it). None for a manifest that records neither."""
    t = ((manifest.get("sampling") or {}).get("solver") or {}).get("temperature")
    override = (((manifest.get("config") or {}).get("collect") or {}).get("solve_temperature"))
    if manifest.get("kind") == "collect" and isinstance(override, (int, float)) and override >= 0:
        t = override
    return None if t is None else float(t)


def source_summary(snapshots: pd.DataFrame, accuracy: pd.DataFrame) -> pd.DataFrame:
    """What one point of each source's per-snapshot figures stands for: per source (training batch,
    held-out eval) the number of snapshots, the range of episodes and problems per snapshot, and the
    solver's turn-1 temperatures (NaN dropped). Captions and panel titles are written from it."""
    cols = ["source", "snapshots", "episodes_min", "episodes_max", "problems_min", "problems_max", "temperatures"]
    first = accuracy[accuracy["attempt"] == 1].merge(snapshots[["order", "source", "temperature"]], on="order")
    rows = [(src, g["order"].nunique(), int(g["episodes"].min()), int(g["episodes"].max()),
             int(g["problems"].min()), int(g["problems"].max()), tuple(sorted(g["temperature"].dropna().unique())))
            for src, g in first.groupby("source")]
    return by_source(pd.DataFrame(rows, columns=cols))


def by_source(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of training batches first, then held-out evals (each group's order kept)."""
    return df.sort_values("source", key=lambda s: s.map(SOURCE_ORDER), kind="stable").reset_index(drop=True)


def focus_snapshot(snapshots: pd.DataFrame, among=None) -> int | None:
    """The ``order`` of the snapshot a report shows on its own (sample episodes, the 2 x 2
    correction grid): the newest held-out eval, else the newest snapshot; only those whose order is
    in ``among`` (the snapshots a table has rows for) when given; None without any."""
    if among is not None:
        snapshots = snapshots[snapshots["order"].isin(set(among))]
    if not len(snapshots):
        return None
    evals = snapshots.loc[snapshots["source"] == EVAL, "order"]
    return int(evals.max() if len(evals) else snapshots["order"].max())


def episode_outcomes(turns: pd.DataFrame) -> pd.DataFrame:
    """Per episode: correctness and reward of the first and of the last solver attempt."""
    solver = turns[turns["role"] == "solver"].sort_values(SNAPSHOT_KEYS + ["turn_index"])
    first = solver.drop_duplicates(SNAPSHOT_KEYS, keep="first").set_index(SNAPSHOT_KEYS)
    last = solver.drop_duplicates(SNAPSHOT_KEYS, keep="last").set_index(SNAPSHOT_KEYS)
    return pd.DataFrame({"correct_t1": first["correct"], "correct_final": last["correct"],
                         "r1": first["reward"], "r_final": last["reward"]}).reset_index()


def sample_episodes(outcomes: pd.DataFrame, snapshots: pd.DataFrame) -> pd.DataFrame:
    """A few episodes worth reading: from the newest held-out eval (else the newest snapshot),
    the first episode (by id) of each correction cell, the corrections first. Rows: order,
    snapshot, episode_id, cell."""
    cols = ["order", "snapshot", "episode_id", "cell"]
    if not len(outcomes):
        return pd.DataFrame(columns=cols)
    eps = outcomes[outcomes["order"] == focus_snapshot(snapshots, outcomes["order"])].sort_values("episode_id")
    eps = eps.assign(cell=np.where(eps["correct_t1"], "right", "wrong") + " → "
                     + np.where(eps["correct_final"], "right", "wrong"))
    picked = [eps[eps["cell"] == c].head(1) for c in ("wrong → right", "right → wrong", "wrong → wrong",
                                                        "right → right")]
    return pd.concat(picked, ignore_index=True)[cols]


def accuracy_per_turn(turns: pd.DataFrame, n_boot: int = ACCURACY_BOOTSTRAP) -> pd.DataFrame:
    """Accuracy of each solver attempt per snapshot: attempt 1 is turn 1 (solve), attempt k+1
    the refine after feedback round k; ``lo``/``hi`` its 95 % bootstrap interval, resampling
    problems (the samples of one problem move together)."""
    solver = turns[turns["role"] == "solver"]
    rows = []
    attempts = solver.assign(attempt=solver["round"] + 1)
    for (order, snap, attempt), g in attempts.groupby(["order", "snapshot", "attempt"]):
        acc, lo, hi = bootstrap_mean(g["correct"].to_numpy(float), g["problem_id"].to_numpy(), n_boot=n_boot)
        rows.append((order, snap, attempt, len(g), g["problem_id"].nunique(), acc, lo, hi))
    return pd.DataFrame(rows, columns=["order", "snapshot", "attempt", "episodes", "problems", "accuracy", "lo", "hi"])


def correction_matrix(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Turn 1 vs final answer, per snapshot: the count of each of the four cells (empty ones
    included) and its rate, a fraction of all the snapshot's episodes as in ``metrics.summarize``
    (so wrong->right - right->wrong = Acc@final - Acc@t1)."""
    df = outcomes.assign(turn1=np.where(outcomes["correct_t1"], "right", "wrong"),
                         final=np.where(outcomes["correct_final"], "right", "wrong"))
    counts = df.groupby(["order", "snapshot", "turn1", "final"]).size()
    snaps = outcomes[["order", "snapshot"]].drop_duplicates().itertuples(index=False)
    full = pd.MultiIndex.from_tuples([(o, s, a, b) for o, s in snaps for a, b in CELLS],
                                     names=["order", "snapshot", "turn1", "final"])
    out = counts.reindex(full, fill_value=0).rename("count").reset_index()
    out["rate"] = out["count"] / out.groupby("order")["count"].transform("sum")
    return out


def strategy_over_time(turns: pd.DataFrame, outcomes: pd.DataFrame) -> pd.DataFrame:
    """Per snapshot and strategy: how many feedback turns used it, their share, and the mean
    final reward and mean improvement (r_final - r1) of their episodes (with K > 1 rounds an
    episode counts once per feedback turn)."""
    fb = turns[turns["kind"] == "feedback"].merge(outcomes, on=SNAPSHOT_KEYS)
    out = (fb.assign(strategy=fb["strategy_name"], improvement=fb["r_final"] - fb["r1"])
           .groupby(["order", "snapshot", "strategy"])
           .agg(count=("episode_id", "size"), mean_r_final=("r_final", "mean"),
                mean_improvement=("improvement", "mean")).reset_index())
    out.insert(4, "share", out["count"] / out.groupby("order")["count"].transform("sum"))
    return out


def strategy_by_correctness(turns: pd.DataFrame) -> pd.DataFrame:
    """Per snapshot, for the feedback that followed a right attempt and the feedback that followed a
    wrong one: how many used each strategy and their share. Feedback k answers the solver turn just
    before it (turn_index - 1), so with K > 1 rounds a later round counts after the refine it read.
    Equal shares say the writer's choice ignores correctness (the summaries' strategy_share/*)."""
    fb = turns[turns["kind"] == "feedback"]
    solver = turns.loc[turns["role"] == "solver", ["snapshot", "episode_id", "turn_index", "correct"]]
    fb = fb.merge(solver.assign(turn_index=solver["turn_index"] + 1), on=["snapshot", "episode_id", "turn_index"],
                  suffixes=("", "_answered"))
    after = np.where(fb["correct_answered"].astype(bool), "right", "wrong")
    out = (fb.assign(strategy=fb["strategy_name"], after=after)
           .groupby(["order", "snapshot", "after", "strategy"]).size().rename("count").reset_index())
    out["share"] = out["count"] / out.groupby(["order", "after"])["count"].transform("sum")
    return out


def _length_edges(max_len: int) -> list[int]:
    """Doubling buckets [0, 8), [8, 16), [16, 32), ... up past ``max_len``: feedback lengths
    spread over orders of magnitude, and fixed edges keep buckets comparable between reports."""
    edges = [0, 8]
    while edges[-1] <= max_len:
        edges.append(edges[-1] * 2)
    return edges


def feedback_length_outcome(turns: pd.DataFrame, outcomes: pd.DataFrame) -> pd.DataFrame:
    """Feedback turns per source (training batches, held-out evals: never pooled together), over
    that source's snapshots, bucketed by length in tokens (``len(response_ids)``): how many, their
    episodes' final accuracy and mean improvement."""
    fb = turns[turns["kind"] == "feedback"].merge(outcomes, on=SNAPSHOT_KEYS)
    edges = np.array(_length_edges(int(fb["response_len"].max()) if len(fb) else 0))
    i = np.searchsorted(edges, fb["response_len"].to_numpy(), side="right") - 1
    out = (fb.assign(lo=edges[i], hi=edges[i + 1] - 1, final_correct=fb["correct_final"].astype(float),
                     improvement=fb["r_final"] - fb["r1"])
           .groupby(["source", "lo", "hi"])
           .agg(feedback_turns=("episode_id", "size"), final_accuracy=("final_correct", "mean"),
                mean_improvement=("improvement", "mean")).reset_index())
    out.insert(1, "tokens", out["lo"].astype(str) + "-" + out["hi"].astype(str))
    return by_source(out.drop(columns=["lo", "hi"]))
