"""The documentation: the generated pages are current, the site builds with no broken link or anchor,
every command, option, knob and logged metric is documented, the README stays a front page, and the
record still holds the notebook it replaced (rendering in Chromium: tests/unit/analysis/test_report_html.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "docs" / "gen"
GENERATED = {"docs/reference/cli.md", "docs/reference/config.md", "docs/reference/metrics.md", "docs/results/index.md"}
NOTEBOOK_REV = "6ca6217"  # the last commit whose README.md was the lab notebook


def _gen(name: str):
    sys.path[:0] = [str(REPO), str(GEN)]
    try:
        spec = importlib.util.spec_from_file_location(f"docs_gen_{name}", GEN / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        del sys.path[:2]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mkdocs")
    return subprocess.run([str(exe), "build", "--strict", "-f", str(config), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_generated_pages_match_the_code_and_the_stored_results():
    """A knob, option, metric or result JSON changed without `python docs/gen/build.py` fails here."""
    stale = _gen("build").stale()
    assert stale == [], f"stale: {[str(p.relative_to(REPO)) for p in stale]}; run python docs/gen/build.py"


def test_the_site_builds_strict(tmp_path):
    p = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    # the evidence a page links to is served with the site
    assert any((tmp_path / "site" / "_repo" / "benchmarks" / "results").rglob("*.json"))


def _site_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied, the rest of the repository linked: a site to break."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    for name in ("benchmarks", "configs", "examples", "CONTRIBUTING.md", "CHANGELOG.md"):
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


@pytest.mark.parametrize("bad", ["[gone](concepts/no-such-page.md)", "[gone](concepts/episode.md#no-such-heading)",
                                 "[gone](../benchmarks/results/no-such.json)"])
def test_a_broken_link_or_anchor_fails_the_build(tmp_path, bad):
    root = _site_copy(tmp_path)
    page = root / "docs" / "index.md"
    page.write_text(page.read_text() + f"\nSee {bad}.\n")
    p = mkdocs_build(root / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0 and ("no-such" in p.stderr), p.stderr[-3000:]


def test_every_command_and_option_is_in_the_cli_reference():
    import typer

    from tosca_mlmt.cli.main import app

    page = (REPO / "docs/reference/cli.md").read_text()
    sections = dict(re.findall(r"^## `(mlmt [^`]+)`\n(.*?)(?=^## |\Z)", page, re.S | re.M))

    def walk(group, prefix):
        for name, cmd in group.commands.items():
            yield f"{prefix} {name}", cmd
            if hasattr(cmd, "commands"):
                yield from walk(cmd, f"{prefix} {name}")

    missing = []
    for name, cmd in walk(typer.main.get_command(app), "mlmt"):
        if name not in sections:
            missing.append(name)
            continue
        for p in getattr(cmd, "params", []):
            shown = [f"`{o}`" for o in p.opts] if p.param_type_name == "option" else [f"`{p.name.upper()}`"]
            missing += [f"{name} {o}" for o in shown if o not in sections[name]]
    assert missing == []


def test_every_knob_is_in_the_config_reference_with_its_default():
    from tosca_mlmt.config.explain import describe_fields

    page = (REPO / "docs/reference/config.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| (?:[^|]|\\\|)* \| `([^`]*)` \|", page, re.M)}
    missing = [name for name, *_ in describe_fields() if name not in rows]
    assert missing == [] and len(rows) == len(describe_fields())
    assert rows["lower.kl_coef"] == repr(dict((n, d) for n, _, d, _ in describe_fields())["lower.kl_coef"])


def test_the_glossary_matches_patterns_and_flags_unknown_keys():
    from tosca_mlmt.analysis.glossary import GLOSSARY, undocumented

    assert undocumented(["lower/acc_t1", "eval/acc_final", "lower/time/generate", "upper/q/start_over",
                         "collect/strategy_share/simplify/after_wrong", "lower/bonus/wrong_to_right/raw_mean"]) == []
    assert undocumented(["lower/not_a_metric", "lower/time", "acc_t1"]) == ["acc_t1", "lower/not_a_metric", "lower/time"]
    page = (REPO / "docs/reference/metrics.md").read_text()
    assert all(f"`{k}`" in page for k in GLOSSARY)


def _markdown_files() -> list[Path]:
    skip = {".venv", ".git", "site", "node_modules", "runs", "snapshots"}
    return [p for p in REPO.rglob("*.md") if not skip & set(p.relative_to(REPO).parts)]


def test_readme_is_a_front_page_and_markdown_lines_stay_short():
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 250
    first_screen = "\n".join(readme[:40])
    for target in ("docs/quickstart.md", "docs/guides/own-task.md", "docs/reference/config.md", "docs/results/index.md"):
        assert f"]({target})" in first_screen, target
    long = []
    for p in _markdown_files():
        rel = p.relative_to(REPO).as_posix()
        # generated tables (the reference and results pages) may run long; so may what a benchmark writes
        if rel.startswith("benchmarks/results/"):
            continue
        long += [f"{rel}:{i}" for i, line in enumerate(p.read_text().splitlines(), 1)
                 if len(line) > 200 and not (rel in GENERATED and line.startswith("|"))]
    assert long == []


def test_no_dated_paragraph_outside_the_record():
    """Dated measurements live in docs/results/log/; README and docs prose say what is true now."""
    dated = re.compile(r"\b(measured|rerun|run) (on )?20\d\d-\d\d-\d\d", re.I)
    hits = [f"{p.relative_to(REPO)}:{i}" for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
            if "results" not in p.relative_to(REPO).parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if dated.search(line)]
    assert hits == []


def test_the_record_holds_every_measurement_of_the_notebook():
    if subprocess.run(["git", "cat-file", "-e", f"{NOTEBOOK_REV}^{{commit}}"], cwd=REPO,
                      capture_output=True).returncode != 0:
        pytest.skip(f"no git history holding {NOTEBOOK_REV} (a shallow or exported tree)")
    check = _gen("check_moved")
    assert check.main(NOTEBOOK_REV) == 0
    # the check can fail: a measurement dropped from the record is reported
    old = "| 2026-12-03 | Intel Xeon | 78b53ad, fresh clone | 1092 passed, 1 skipped | 14:05 |"
    assert check.missing(old, "nothing of it") != []


def test_the_record_index_lists_every_entry():
    log = REPO / "docs" / "results" / "log"
    index = (log / "index.md").read_text()
    entries = [p.relative_to(log).as_posix() for p in log.rglob("*.md") if p.name != "index.md"]
    assert entries and [e for e in entries if f"]({e})" not in index] == []
    dated = re.findall(r"^\| (20\d\d-\d\d-\d\d) \|", index, re.M)
    assert dated == sorted(dated, reverse=True)  # newest first


def test_the_readmes_demo_numbers_come_from_make_demos_own_configuration(tmp_path, monkeypatch):
    """The README's demo block and the results page's demo section show the newest run of configs/demo.yaml
    as shipped: not a newer run of another preset (demo-selector, demo-text) or of the demo with a --set."""
    import json

    results = _gen("results")
    folder = tmp_path / "demo_seeds"
    folder.mkdir()
    pooled = {k: {"mean": 0.1, "lo": 0.0, "hi": 0.2, "seeds": 1, "problems": 5}
              for k in ("before_t1", "before_final", "after_t1", "after_final", "final_difference", "t1_difference")}

    def run(name: str, config: str, sets: str = "", **extra) -> None:
        cmd = f"python -m benchmarks.learning.demo_seeds --seeds 0 (make demo's commands, {config}{sets}, --seed S)"
        (folder / name).write_text(json.dumps({"command": cmd, "pooled": pooled, **extra}))

    run("2026-12-01_a.json", "configs/demo.yaml")
    run("2026-12-02_b.json", "configs/demo.yaml", ", --set lower.lr=1")
    run("2026-12-02_c.json", "configs/demo-text.yaml")
    diff = {"mean": -0.05, "lo": -0.1, "hi": 0.0}
    run("2026-12-03_d.json", "configs/demo-selector.yaml", against={"after_final_difference": diff, "after_t1_difference": diff})
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "REPO", tmp_path)
    assert [p.name for p in results.demo_runs()] == ["2026-12-01_a.json"]
    assert "2026-12-01_a.json" in results.demo_readme_block()
    section = "\n".join(results.demo_section())
    assert "2026-12-01_a.json" in section and "2026-12-03_d.json" in section
    assert "-0.050 [-0.100, +0.000]" in section
