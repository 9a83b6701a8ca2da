"""``mlmt analyze``: an offline report from run folders and snapshots (no model is loaded).

Steps: resolve the arguments -> read every snapshot manifest (unknown format versions are
refused here, before any data is read) -> verify each snapshot (sizes, hashes, id) -> read
metrics.jsonl records and snapshot turns -> tables (pure) -> the result (before vs after, from the
eval folders) -> figures -> report. Output folder::

    <out>/report.md     the result first, then every table, linking every figure by a relative path
    <out>/report.html   the curated figures (embedded), captions and sample episodes: one file
    <out>/*.png         the figures
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tosca_mlmt.analysis import plots
from tosca_mlmt.analysis.headline import EvalInput, Headline, oldest_first
from tosca_mlmt.analysis.html import render_html
from tosca_mlmt.analysis.report import render_report
from tosca_mlmt.analysis.sources import read_episode_texts, read_evals, read_metrics, read_turns, resolve
from tosca_mlmt.analysis.tables import Tables, compute_tables, sample_episodes
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.store import check_snapshot


@dataclass
class AnalyzeResult:
    report: Path
    html: Path
    figures: list[Path]
    tables: Tables
    headline: Headline


def before_after(evals: list[EvalInput]) -> Headline:
    """The result of the eval folders among the inputs. "After" is the newest eval: its eval.json's
    ``compared_to`` when it was run with ``--compare-to``; else it is compared, with the same function
    (``compare_outcomes``), to the oldest eval on the same problems."""
    from tosca_mlmt.pipelines.evaluate import compare_outcomes, eval_outcomes

    if not evals:
        return Headline(note="no eval folder (one holding an eval.json) among the inputs")
    *older, after = oldest_first(evals)
    stored = after.report.get("compared_to")
    if isinstance(stored, dict):
        return Headline(stored, str(stored.get("eval", "the earlier eval")), after.folder, stored=True)
    if not older:
        return Headline(note=f"one eval folder ({after.folder}), run without --compare-to; pass the eval from "
                             "before training too")
    b = eval_outcomes(after.folder)
    for before in older:
        a = eval_outcomes(before.folder)
        if a["ids"] == b["ids"]:
            return Headline({"eval": before.folder, **compare_outcomes(a, b, before.folder)}, before.folder,
                            after.folder)
    return Headline(note=f"no earlier eval covers the problems of the newest, {after.folder} (run both with the "
                         "same task, split and --limit)")


def analyze(sources: list[str], out: str | Path, *, console=None, verify: bool = True,
            root: str | Path = "snapshots") -> AnalyzeResult:
    """Like every stage but with run folders and snapshots in place of a config (nothing is
    trained or sampled). ``verify``: check every snapshot's sizes, hashes and id before reading it."""
    rd = RunDir(out, "analyze", console)
    src = resolve(sources, Path(root))
    if verify:
        for folder, _ in src.snapshots.values():
            check_snapshot(folder)
    rd.say(f"analyze: {len(src.metrics)} metrics file(s), {len(src.snapshots)} snapshot(s)")
    tables = compute_tables(read_metrics(src.metrics), [m for _, m in src.snapshots.values()],
                            read_turns(src.snapshots))
    result = before_after(read_evals(src))
    rd.path.mkdir(parents=True, exist_ok=True)
    figures = plots.draw_all(tables, rd.path)
    report = rd.write_text("report.md", render_report(tables, figures, sources, result))
    samples = sample_episodes(tables.outcomes, tables.snapshots)
    texts = read_episode_texts(src.snapshots, list(zip(samples["snapshot"], samples["episode_id"])))
    page = rd.write_text("report.html", render_html(tables, rd.path, figures, sources, samples, texts, result))
    return AnalyzeResult(report, page, [rd.path / f for f in figures.values()], tables, result)
