"""``mlmt analyze``: offline report (report.html, report.md, PNG figures) from runs and snapshots.

Registered in ``cli/main.py``. Messages go to stderr; stdout's last line is the report's
path. pandas and matplotlib load only when the command runs, not with every ``mlmt`` call.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tosca_mlmt.cli.common import err, out_folder


def analyze(
    sources: list[str] = typer.Argument(..., metavar="RUN_OR_SNAPSHOT",
                                        help="Run folders, eval folders (mlmt eval --out: the report opens with their "
                                             "before/after result), snapshot folders or snapshot ids / unique id "
                                             "prefixes (under --root)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder for report.html (self-contained), report.md and the PNG figures.", parser=out_folder),
    root: Path = typer.Option(Path("snapshots"), help="Folder searched (recursively) for arguments given as snapshot ids."),
    no_verify: bool = typer.Option(False, "--no-verify",
                                   help="Read snapshots without checking their sizes, hashes and id."),
):
    """The result (before vs after, from the eval folders), then learning curves, accuracy per turn, correction
    matrix, strategies, bonus and feedback length.

    Offline: reads metrics.jsonl files, eval.json files and snapshots only. Prints the report's path last on stdout."""
    from tosca_mlmt.pipelines.analyze import analyze as run

    res = run(sources, out, console=err, verify=not no_verify, root=root)
    err.print(f"analyze: {len(res.figures)} figure(s) in {out}; open {res.html} in a browser", highlight=False)
    print(res.report)
