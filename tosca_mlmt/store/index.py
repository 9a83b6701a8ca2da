"""Finding and listing snapshots anywhere under a folder, and naming them by a unique id prefix.

Runs keep their snapshots at several depths (``<run>/snapshots/``, ``<run>/rounds/003/lower/
snapshots/``, a collect's ``--out``), so a folder is searched recursively: a snapshot is a
folder named ``snap-*`` holding ``manifest.json`` (a run folder has a ``manifest.json`` too,
hence the name test). Hidden folders are skipped: ``.tmp-*`` are builds in progress.

The same id in two places is the same content (ids are content hashes), so it is listed and
resolved once, from its first folder in sorted order.

The listings end in one line per snapshot for a terminal, every field escaped (``terminal_safe``):
manifests and folder names are files anyone can edit.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from tosca_mlmt.errors import ConfigError, SnapshotError
from tosca_mlmt.store.manifest import read_manifest
from tosca_mlmt.store.snapshot import Snapshot, load_snapshot


def _is_snapshot(path: Path) -> bool:
    return path.name.startswith("snap-") and (path / "manifest.json").is_file()


def find_snapshot_dirs(root: str | Path) -> dict[str, Path]:
    """Snapshot id (its folder name) -> folder, for every snapshot at any depth under ``root``."""
    root = Path(root)
    if _is_snapshot(root):
        return {root.name: root}
    found: dict[str, Path] = {}
    for here, dirs, _files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for d in list(dirs):
            p = Path(here) / d
            if _is_snapshot(p):
                found.setdefault(d, p)
                dirs.remove(d)  # a snapshot holds no snapshots
    return found


def matching_ids(found, ref: str) -> list[str]:
    """The ids among ``found`` that ``ref`` names: itself when it is a full id, else those it is a
    prefix of ("snap-3f2a", or "3f2a" without the "snap-"), sorted."""
    if ref in found:
        return [ref]
    want = ref if ref.startswith("snap-") or "snap-".startswith(ref) else "snap-" + ref
    return sorted(sid for sid in found if sid.startswith(want))


def _check_ref(ref) -> None:
    if not isinstance(ref, str) or not ref or "/" in ref or ref.startswith("."):
        raise SnapshotError(f"{ref!r} is not a snapshot id")


def _unique(root, found: dict, ref: str) -> str | None:
    """The one id ``ref`` names among ``found``; None for none; several raise, listing them."""
    hits = matching_ids(found, ref)
    if len(hits) > 1:
        shown = ", ".join(hits[:10]) + (f" and {len(hits) - 10} more" if len(hits) > 10 else "")
        raise SnapshotError(f"snapshot id prefix '{ref}' is ambiguous under {root}: it matches {shown}; "
                            "give more characters")
    return hits[0] if hits else None


def resolve_snapshot(root: str | Path, ref: str) -> Path:
    """The folder of the snapshot ``ref`` names under ``root``: a full id, or a prefix of
    exactly one id ("snap-3f2a", or "3f2a" without the "snap-"). No match or several
    matches raise SnapshotError (the latter listing the candidates)."""
    _check_ref(ref)
    if _is_snapshot(Path(root) / ref):  # a full id where stages keep them: no search
        return Path(root) / ref
    found = find_snapshot_dirs(root)
    sid = _unique(root, found, ref)
    if sid is None:
        raise SnapshotError(f"no snapshot '{ref}' under {root}")
    return found[sid]


def full_ids(root: str | Path, refs) -> list[str]:
    """Each of ``refs`` (ids or unique prefixes) as its full id, in order: what stages record, so
    a run started with a prefix resumes with the full id (and the other way round). An ambiguous
    prefix raises here; one that names nothing is kept as given, for the reader to report
    missing once the stage has checked its run folder and config."""
    found = None
    out = []
    refs = list(refs)
    for given in refs:
        ref = given
        _check_ref(ref)
        if not _is_snapshot(Path(root) / ref):
            found = find_snapshot_dirs(root) if found is None else found
            ref = _unique(root, found, ref) or ref
        if ref in out:  # an id and a prefix of it, or two prefixes: its episodes would count twice
            raise ConfigError(f"snapshot {ref} is given twice (as '{refs[out.index(ref)]}' and '{given}'): its "
                              "episodes would count twice; list each snapshot once")
        out.append(ref)
    return out


def open_snapshot(root: str | Path, ref: str, verify: bool = True) -> Snapshot:
    """The snapshot ``ref`` (an id or unique prefix) names at any depth under ``root``; with
    ``verify`` checked first, as ``snapshot.load_snapshot``."""
    path = resolve_snapshot(root, ref)
    return load_snapshot(path.parent, path.name, verify=verify)


def environment_of(m: dict) -> str:
    """"honest", "honest:tool" or "privileged:<what>", as metrics.environment labels episodes (the
    writer saw the verifier's verdict or grading output, or the feedback was the verdict). From the
    manifest's summary where it records one, else from its config. A summary of "honest" on an mbpp
    config with a feedback round and no tool is corrected to "privileged:grading_tests": snapshots
    written before metrics.environment knew of ``feedback_context`` say "honest", though their
    writer read the grading tests' error."""
    env = (m.get("summary") or {}).get("environment") if isinstance(m.get("summary"), dict) else None
    from_config = _environment_of_config(m.get("config") if isinstance(m.get("config"), dict) else {})
    if isinstance(env, str) and not (env == "honest" and from_config == "privileged:grading_tests"):
        return env
    return from_config


def _environment_of_config(config: dict) -> str:
    """The label metrics.environment gives the episodes a config produces."""
    ep = config.get("episode") if isinstance(config.get("episode"), dict) else {}
    if ep.get("writer_sees") == "verdict":
        return "privileged:writer_sees_verdict"
    if ep.get("feedback") == "verdict":
        return "privileged:verdict_feedback"
    task = config.get("task")
    tool = "tool" in (ep.get("writer_sees"), ep.get("feedback"))  # the public check replaces the grading error
    if isinstance(task, dict) and task.get("name") == "mbpp" and (ep.get("rounds", 1) or 0) > 0 and not tool:
        return "privileged:grading_tests"  # the writer read the grading tests' error (feedback_context)
    if tool:
        return "honest:tool"
    return "honest"


def snapshot_rows(root: str | Path) -> list[dict]:
    """One row per snapshot under ``root``, oldest first: id, kind, environment, episodes,
    created, where (its folder relative to ``root``); ``error`` for an unreadable manifest."""
    root = Path(root)
    rows = []
    for sid, folder in find_snapshot_dirs(root).items():
        where = str(folder.relative_to(root)) if folder != root else "."
        try:
            m = read_manifest(folder)
        except SnapshotError as e:
            rows.append({"id": sid, "where": where, "error": str(e)})
            continue
        rows_ = m.get("rows") if isinstance(m.get("rows"), dict) else {}
        rows.append({"id": m["id"], "kind": str(m.get("kind") or "?"), "environment": environment_of(m),
                     "episodes": rows_.get("episodes", "?"), "created": str(m.get("created_at") or "?"),
                     "where": where})
    return sorted(rows, key=lambda r: (r.get("created", ""), r["id"]))


def row_line(r: dict) -> str:
    """A row as one line, id first (so ``awk '{print $1}'`` gives the ids), its control characters
    escaped (terminal_safe): every field comes from a file anyone can edit."""
    r = {k: terminal_safe(v) for k, v in r.items()}
    if "error" in r:
        return f"{r['id']}  ERROR {r['error']}  ({r['where']})"
    return f"{r['id']}  {r['kind']:<17} {r['environment']:<30} episodes={r['episodes']:<6} {r['created']}  {r['where']}"


def list_snapshots(root: str | Path) -> list[dict]:
    """The manifests of the snapshots directly in ``root`` (not deeper), oldest first; ``error`` for an
    unreadable one."""
    root = Path(root)
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / "manifest.json").exists():
            try:
                out.append(read_manifest(d))
            except SnapshotError as e:
                out.append({"id": d.name, "error": str(e)})
    return sorted(out, key=lambda m: str(m.get("created_at", "")))


def terminal_safe(value, keep_newlines: bool = False) -> str:
    """``str(value)`` with control characters (ESC and the other C0/C1 codes, DEL, bidi overrides,
    line and paragraph separators) written as escapes (``\\x1b``, ``\\u202e``): a manifest, a folder
    name or a text can be edited by anyone, and printed raw its escape codes would repaint the terminal
    or hide what is listed. ``keep_newlines`` keeps ``\\n`` and ``\\t`` (multi-line texts)."""
    text = str(value)
    if text.isprintable():
        return text
    keep = "\n\t" if keep_newlines else ""
    return "".join(ch if ch.isprintable() and unicodedata.category(ch) != "Cf" or ch in keep or ch == " "
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def summary_line(m: dict) -> str:
    """One line for ``mlmt snapshots list``: id, created, task/split, episodes, accuracies.
    Any field may be missing or odd (old or hand-made manifests): shown as '?'."""
    return terminal_safe(_summary_line(m))


def _summary_line(m: dict) -> str:
    if "error" in m:
        return f"{m.get('id')}  ERROR {m['error']}"

    def get(*keys):
        v = m
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return "?" if v is None else v

    def num(*keys):
        v = get(*keys)
        return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"

    return (f"{m.get('id')}  {get('created_at')}  {get('task', 'name')}/{get('task', 'split')}  "
            f"episodes={get('rows', 'episodes')}  acc_t1={num('summary', 'acc_t1')}  "
            f"acc_final={num('summary', 'acc_final')}")
