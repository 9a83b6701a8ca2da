"""Checks that the lab notebook moved into this record whole: every line of the old README.md and
benchmarks/LEARNING_LOG.md that holds a digit (a measurement, a date, a commit) is found here, word for
word once whitespace, link targets and table pipes are set aside.

    python docs/gen/check_moved.py 6ca6217     # the last commit with the notebook in README.md

Exit 1 and the missing lines when one is not found."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "results" / "log"
OLD_FILES = ("README.md", "benchmarks/LEARNING_LOG.md")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")


def plain(text: str) -> str:
    """The words a reader sees: link targets dropped (they point at sections that moved), spaces collapsed."""
    return " ".join(LINK.sub(r"\1", text).split())


def pieces(line: str) -> list[str]:
    """A table row is checked cell by cell (a long row becomes a list item here); any other line whole."""
    s = line.strip()
    if s.startswith("|") and s.endswith("|"):
        return [c for c in (plain(c) for c in re.split(r"(?<!\\)\|", s[1:-1])) if c and set(c) - set("-: ")]
    return [plain(s)] if s else []


def missing(old_text: str, record: str) -> list[str]:
    return [p for line in old_text.splitlines() if re.search(r"\d", line)
            for p in pieces(line) if p not in record]


def main(rev: str) -> int:
    root = HERE.parents[2]
    record = plain("\n".join(p.read_text() for p in sorted(HERE.rglob("*.md"))).replace("\\|", "|"))
    lost = []
    for name in OLD_FILES:
        old = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, capture_output=True, text=True, check=True).stdout
        lost += [f"{name}: {p}" for p in missing(old.replace("\\|", "|"), record)]
    for line in lost:
        print(line[:300])
    print(f"{len(lost)} line(s) of the notebook at {rev} not found in {HERE.relative_to(root)}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "6ca6217"))
