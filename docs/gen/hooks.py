"""MkDocs hooks: the evidence a page links to (result JSON, presets) is served with the site, and the
include of CONTRIBUTING.md / CHANGELOG.md from the repository root.

Pages link to repository files the way GitHub resolves them (`../../benchmarks/results/x.json` from
`docs/results/index.md`); such a link leaves `docs/`, so the site copies the folders named in SERVED and
rewrites the link to the copy. A link out of `docs/` to anything else stays as written and fails the strict
build like any broken link."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
SERVED = ("benchmarks/results", "configs", "examples")
# Root files shown as pages: the site path -> the repository file.
DATA = {".json", ".jsonl", ".yaml", ".yml", ".tsv", ".csv", ".txt", ".sbatch"}
ROOT_PAGES = {"contributing.md": "CONTRIBUTING.md", "changelog.md": "CHANGELOG.md"}
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def on_files(files, config):
    for site_path, name in ROOT_PAGES.items():
        files.append(File.generated(config, site_path, abs_src_path=str(REPO / name)))
    for folder in SERVED:
        for path in sorted((REPO / folder).rglob("*")):
            # data files only: a Markdown file there would become a page of its own
            if path.is_file() and path.suffix in DATA and "__pycache__" not in path.parts:
                rel = path.relative_to(REPO).as_posix()
                files.append(File.generated(config, f"_repo/{rel}", abs_src_path=str(path)))
    return files


def _to_site(page_src: str, target: str) -> str | None:
    """The site path of a link that leaves docs/ for a served folder, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    where = ROOT_PAGES.get(page_src, f"docs/{page_src}")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(where), target))
    site_of_root = {name: page for page, name in ROOT_PAGES.items()}
    if resolved in site_of_root:  # CONTRIBUTING.md -> contributing.md, beside the docs' pages
        return posixpath.relpath(site_of_root[resolved], posixpath.dirname(page_src) or ".")
    if resolved.startswith("docs/"):
        # a root page (CONTRIBUTING.md) names docs pages from the root; in the site they are siblings
        return posixpath.relpath(resolved[5:], posixpath.dirname(page_src) or ".") if page_src in ROOT_PAGES else None
    if not any(resolved == f or resolved.startswith(f + "/") for f in SERVED):
        return None
    return posixpath.relpath(f"_repo/{resolved}", posixpath.dirname(page_src) or ".")


def on_page_markdown(markdown, page, config, files):
    def swap(m):
        site = _to_site(page.file.src_uri, m.group(2))
        return m.group(0) if site is None else f"{m.group(1)}{site}{m.group(3) or ''}{m.group(4)}"
    return LINK.sub(swap, markdown)
