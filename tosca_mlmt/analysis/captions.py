"""What a figure's data is, in words, for captions (Markdown and HTML) and panel titles.

A training batch and a held-out eval answer different questions: the first is sampled attempts on
a new draw of training problems, the second greedy attempts on the test split. A reader shown two
curves needs to know which is which, how many episodes stand behind a point and how they were
decoded, so every per-snapshot figure says it, from ``tables.source_summary``.
"""

from __future__ import annotations

import html
import re

import pandas as pd

from tosca_mlmt.analysis.tables import EVAL, PLURAL, TRAIN

MISSING = "–"  # a table cell without a value, in report.md and report.html alike
SPLIT = {TRAIN: "training problems", EVAL: "the held-out test split"}
TRAIN_VS_EVAL = ("A training batch is a new draw of training problems at every iteration, decoded by sampling, "
                 "with few episodes per point: its accuracy moves with which problems were drawn and is not "
                 "comparable with a held-out eval's greedy accuracy on the test split. Learning is measured by "
                 "the held-out evals (the result at the top of the report).")


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}–{hi}"


def decoding(temperatures: tuple, short: bool = False) -> str:
    """How the solver's first answers were decoded: greedy, or sampled at the temperatures recorded."""
    if not temperatures:
        return "T not recorded" if short else "temperature not recorded"
    if all(t == 0 for t in temperatures):
        return "greedy"
    ts = ", ".join(f"{t:g}" for t in temperatures)
    return f"T = {ts}" if short else f"sampled at T = {ts}"


def describe(row) -> str:
    """One source in a sentence: '<source> (n snapshots): turn 1 <decoding>, on <split>;
    <episodes> episodes of <problems> problems per point'."""
    n = int(row.snapshots)
    return (f"{PLURAL[row.source]} ({n} snapshot{'s' * (n != 1)}): turn 1 {decoding(row.temperatures)}, on "
            f"{SPLIT[row.source]}; {_span(row.episodes_min, row.episodes_max)} episodes of "
            f"{_span(row.problems_min, row.problems_max)} problems per point")


def panel_title(row) -> str:
    """The short form of ``describe`` for a figure panel's title."""
    return (f"{PLURAL[row.source]}: {decoding(row.temperatures, short=True)}, "
            f"n = {_span(row.episodes_min, row.episodes_max)} episodes/point")


def data_sentence(sources: pd.DataFrame, only: tuple[str, ...] = (TRAIN, EVAL), explain: bool = False) -> str:
    """Every source of the report (training batches first) described, joined into one sentence;
    ``explain``: with the training-vs-eval warning when both sources are among them."""
    rows = [r for r in sources.itertuples(index=False) if r.source in only]
    if not rows:
        return ""
    text = "Data: " + "; ".join(describe(r) for r in rows) + "."
    return text + (" " + TRAIN_VS_EVAL if explain and any(r.source == TRAIN for r in rows) else "")


def titles(sources: pd.DataFrame) -> dict[str, str]:
    """Panel title per source, for the plots."""
    return {r.source: panel_title(r) for r in sources.itertuples(index=False)}


def md_inline(md: str) -> str:
    """The few Markdown marks captions and notes use (**bold**, `code`) as HTML, after escaping."""
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(md))
    return re.sub(r"`(.+?)`", r"<code>\1</code>", s)


def display(df: pd.DataFrame) -> pd.DataFrame:
    """The table as text cells: floats to 4 significant digits, every missing value (NaN, None,
    pandas' <NA>) as ``MISSING``; the same cells in report.md and report.html."""
    def cell(v) -> str:
        if v is None or (not isinstance(v, (str, tuple, list)) and pd.isna(v)):
            return MISSING
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    return pd.DataFrame({c: [cell(v) for v in df[c]] for c in df.columns}, columns=df.columns)


def _cell(v: str) -> str:
    return str(v).replace("|", "\\|")


def md_table(df: pd.DataFrame) -> str:
    """GitHub-flavoured Markdown; numeric columns right-aligned, a missing value as "–"."""
    align = ["---:" if pd.api.types.is_numeric_dtype(df[c]) else "---" for c in df.columns]
    cells = [[_cell(v) for v in r] for r in display(df).itertuples(index=False)]
    rows = [[_cell(c) for c in df.columns], align, *cells]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)
