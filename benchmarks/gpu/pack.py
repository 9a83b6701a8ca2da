"""Ship files to the lent GPU machine in parts that each fit one device call, and put them back there.

A device call carries at most 64 MiB with the working tree (13 MiB on 2026-12-03, growing with
benchmarks/results), and the machine keeps what a call left outside the checkout while it stays warm
(30 s between calls). So stage.sh packs the files the machine lacks into ``.gpu/part1 .. partN`` of
at most ``--part-mib`` each (``auto``: what the tree leaves of 64 MiB, less a margin): a file larger
than that is cut into pieces (``NAME.piece-KK``), and every part holds a manifest of what it carries
(whole file name, sha256, piece count) and the pack's id. On the machine, check.sh copies each
carried part into one staging folder; ``unpack`` then joins the pieces, checks every file against its
sha256, names the parts that were never staged, and extracts ``*.tar.xz`` trees into the install
target; ``wheels`` lists the pack's wheels for pip. The pack is the one whose part was staged last,
so leftovers of another pack on a warm machine are ignored.

    python benchmarks/gpu/pack.py pack FILE... --out .gpu [--part-mib auto|50]
    python benchmarks/gpu/pack.py unpack STAGE [--site /tmp/site]
    python benchmarks/gpu/pack.py wheels STAGE
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tosca_mlmt.fsutil import sha256_file as sha256  # noqa: E402 -- stdlib only: runs before anything is installed

MANIFEST = "manifest-part{}.json"
CALL_BYTES = 64 << 20  # what one device call carries, the working tree included
MARGIN_BYTES = 2 << 20  # manifests, and what the session adds to the tree before its device calls


def tree_bytes(repo: Path) -> int:
    """The working tree as a device call ships it: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                         check=True, timeout=120).stdout
    files = (repo / n for n in out.decode().split("\0") if n)
    return sum(f.lstat().st_size for f in files if f.is_file() or f.is_symlink())


def auto_part_bytes(repo: Path) -> int:
    """The largest part that still rides in one call beside ``repo``'s working tree."""
    room = CALL_BYTES - MARGIN_BYTES - tree_bytes(repo)
    if room < (8 << 20):
        raise SystemExit(f"the working tree leaves {room >> 20} MiB of a device call's 64 MiB: too little to ship parts")
    return room


def pack(files: list[Path], out: Path, part_bytes: int) -> list[Path]:
    """Write ``files`` into ``out/part1..N`` (first fit, in order), each part at most ``part_bytes``."""
    pieces: list[tuple[str, int, int, int]] = []  # (file name, piece index, offset, size)
    entries = {}
    for f in files:
        size = f.stat().st_size
        n = max(1, -(-size // part_bytes))
        entries[f.name] = {"sha256": sha256(f), "pieces": n, "size": size}
        pieces += [(f.name, k, k * part_bytes, min(part_bytes, size - k * part_bytes)) for k in range(n)]
    if len(entries) != len(files):
        raise SystemExit("two files share a name: " + ", ".join(sorted(f.name for f in files)))
    pack_id = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:12]
    src = {f.name: f for f in files}
    parts: list[list[tuple[str, int, int, int]]] = []
    for p in pieces:
        room = [i for i, part in enumerate(parts) if sum(x[3] for x in part) + p[3] <= part_bytes]
        if room:
            parts[room[0]].append(p)
        else:
            parts.append([p])
    dirs = []
    for i, part in enumerate(parts, 1):
        d = out / f"part{i}"
        d.mkdir(parents=True)
        for name, k, off, size in part:
            dest = d / (name if entries[name]["pieces"] == 1 else f"{name}.piece-{k:02d}")
            with src[name].open("rb") as fi, dest.open("wb") as fo:
                fi.seek(off)
                fo.write(fi.read(size))
        (d / MANIFEST.format(i)).write_text(json.dumps(
            {"id": pack_id, "part": i, "parts": len(parts), "files": {n: entries[n] for n in sorted({x[0] for x in part})},
             "pieces": [f"{n}#{k}" for n, k, _, _ in part]}, indent=1))
        dirs.append(d)
    return dirs


def current(stage: Path) -> list[dict]:
    """The manifests of the pack whose part was staged last (check.sh copies without keeping times)."""
    paths = sorted(stage.glob("manifest-part*.json"), key=lambda m: m.stat().st_mtime_ns)
    if not paths:
        raise SystemExit(f"{stage}: no manifest; no part was staged on this machine")
    manifests = [json.loads(m.read_text()) for m in paths]
    return [m for m in manifests if m["id"] == manifests[-1]["id"]]


def unpack(stage: Path, site: Path | None) -> list[Path]:
    """Join and check what the staged parts hold; raise SystemExit naming any part not staged."""
    manifests = current(stage)
    total = manifests[0]["parts"]
    missing = sorted(set(range(1, total + 1)) - {m["part"] for m in manifests})
    if missing:
        raise SystemExit(f"parts {missing} of {total} were not staged on this machine (a fresh machine, or a call "
                         "that carried none): stage them, then run again")
    files = {}
    for m in manifests:
        files.update(m["files"])
    done = []
    for name, e in sorted(files.items()):
        whole = stage / name
        if e["pieces"] > 1:
            with whole.open("wb") as fo:
                for k in range(e["pieces"]):
                    fo.write((stage / f"{name}.piece-{k:02d}").read_bytes())
        if sha256(whole) != e["sha256"]:
            raise SystemExit(f"{name}: sha256 does not match the manifest (a part from another stage.sh run?)")
        done.append(whole)
        if site is not None and name.endswith(".tar.xz"):
            site.mkdir(parents=True, exist_ok=True)
            with tarfile.open(whole, "r:xz") as t:
                t.extractall(site, filter="data")
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", default="auto", help="MiB per part, or auto: what the working tree leaves of a call")
    u = sub.add_parser("unpack")
    u.add_argument("stage", type=Path)
    u.add_argument("--site", type=Path)
    sub.add_parser("wheels").add_argument("stage", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        size = auto_part_bytes(Path.cwd()) if a.part_mib == "auto" else int(float(a.part_mib) * (1 << 20))
        for d in pack(a.files, a.out, size):
            print(d, sum(f.stat().st_size for f in d.iterdir()) >> 20, "MiB")
    elif a.cmd == "unpack":
        for f in unpack(a.stage, a.site):
            print(f.name, file=sys.stderr)
    else:
        names = sorted({n for m in current(a.stage) for n in m["files"]})  # a cut file is in several manifests
        print(" ".join(str(a.stage / n) for n in names if n.endswith(".whl")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
