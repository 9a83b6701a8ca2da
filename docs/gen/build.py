"""Writes the generated pages: the CLI, config and metrics references, the results page, and the README's
demo block. `--check` writes nothing and exits 1 naming each page that differs from what the code and the
stored results give (tests/properties/test_docs.py runs it).

    python docs/gen/build.py            # regenerate
    python docs/gen/build.py --check    # stale?
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]  # benchmarks/ (a package at the root), siblings

import reference  # noqa: E402
import results  # noqa: E402

README_BLOCK = re.compile(r"(<!-- demo-result:[^\n]*-->\n)(.*?)(<!-- /demo-result -->)", re.S)


def pages() -> dict[Path, str]:
    out = {REPO / "docs/reference/cli.md": reference.cli_page(),
           REPO / "docs/reference/config.md": reference.config_page(),
           REPO / "docs/reference/metrics.md": reference.metrics_page(),
           REPO / "docs/results/index.md": results.results_page()}
    readme = (REPO / "README.md").read_text()
    if not README_BLOCK.search(readme):
        raise SystemExit("README.md lacks its <!-- demo-result --> block")
    out[REPO / "README.md"] = README_BLOCK.sub(lambda m: m.group(1) + results.demo_readme_block() + m.group(3), readme)
    return out


def stale() -> list[Path]:
    return [p for p, text in pages().items() if not p.exists() or p.read_text() != text]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    args = ap.parse_args()
    if args.check:
        bad = stale()
        for p in bad:
            print(f"stale: {p.relative_to(REPO)} (run python docs/gen/build.py)")
        return 1 if bad else 0
    for p, text in pages().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists() or p.read_text() != text:
            p.write_text(text)
            print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
