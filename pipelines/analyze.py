"""``mlmt analyze``: an offline report from run folders and snapshots (no model is loaded).

Steps: resolve the arguments -> read every snapshot manifest (unknown format versions are
refused here, before any data is read) -> verify each snapshot (sizes, hashes, id) -> read
metrics.jsonl records and snapshot turns -> tables (pure) -> figures -> report. Output folder::

    <out>/report.md     every table, linking every figure by a relative path
    <out>/report.html   the curated figures (embedded), captions and sample episodes: one file
    <out>/*.png         the figures
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tosca_mlmt.analysis import plots
from tosca_mlmt.analysis.html import render_html
from tosca_mlmt.analysis.report import render_report
from tosca_mlmt.analysis.sources import read_episode_texts, read_metrics, read_turns, resolve
from tosca_mlmt.analysis.tables import Tables, compute_tables, sample_episodes
from tosca_mlmt.pipelines.rundir import check_writable
from tosca_mlmt.snapshot import check_snapshot


@dataclass
class AnalyzeResult:
    report: Path
    html: Path
    figures: list[Path]
    tables: Tables


def analyze(sources: list[str], out: str | Path, root: str | Path = "snapshots", console=None,
            verify: bool = True) -> AnalyzeResult:
    """``verify``: check every snapshot's sizes, hashes and id before reading it."""
    out = Path(out)
    check_writable(out)
    src = resolve(sources, Path(root))
    if verify:
        for folder, _ in src.snapshots.values():
            check_snapshot(folder)
    if console is not None:
        console.print(f"analyze: {len(src.metrics)} metrics file(s), {len(src.snapshots)} snapshot(s)",
                      highlight=False)
    tables = compute_tables(read_metrics(src.metrics), [m for _, m in src.snapshots.values()],
                            read_turns(src.snapshots))
    out.mkdir(parents=True, exist_ok=True)
    figures = plots.draw_all(tables, out)
    report = out / "report.md"
    report.write_text(render_report(tables, figures, sources))
    samples = sample_episodes(tables.outcomes, tables.snapshots)
    texts = read_episode_texts(src.snapshots, list(zip(samples["snapshot"], samples["episode_id"])))
    page = out / "report.html"
    page.write_text(render_html(tables, out, figures, sources, samples, texts), encoding="utf-8")
    return AnalyzeResult(report, page, [out / f for f in figures.values()], tables)
