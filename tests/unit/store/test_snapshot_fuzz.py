"""Property-based fuzzing of snapshot reading: damaged manifests, damaged parquet files and
damaged folders, through the library and through the commands that read snapshots
(``snapshots list|show|verify``, ``analyze`` with and without ``--no-verify``).

The property: every input ends in a result (``verify`` may also answer exit 1, its verdict
"corrupt") or in the project's own error, which the CLI prints as one ``error:`` line with
exit 2; never another exception, never a traceback, never a hang (each example has a
deadline). Derandomized, so a failure reproduces. No model is loaded.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from factories import make_episodes
from tosca_mlmt.cli.main import app
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.pipelines.train_upper import _load_snapshots
from tosca_mlmt.store import load_snapshot, read_manifest, verify_snapshot, write_snapshot
from tosca_mlmt.store.index import list_snapshots, summary_line

FUZZ = settings(max_examples=100, deadline=timedelta(seconds=20), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW_FUZZ = settings(FUZZ, max_examples=25)  # analyze draws figures when a snapshot reads

_TMP = Path(tempfile.mkdtemp(prefix="tosca-snapfuzz-"))
atexit.register(shutil.rmtree, _TMP, True)
_BASE = _TMP / "base"
SID, _ = write_snapshot(_BASE, make_episodes(4), {"kind": "collect", "task": {"name": "arith", "split": "train"},
                                                 "strategies": [{"name": "verify", "instruction": "check"}],
                                                 "summary": {"acc_t1": 0.0, "acc_final": 1.0}})
MANIFEST = json.loads((_BASE / SID / "manifest.json").read_text())
FILES = ("manifest.json", "episodes.parquet", "turns.parquet")

TEXT = st.text(st.one_of(st.characters(codec=None), st.characters(categories=["Cs"])), max_size=20)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT,
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=10)


# ---------------------------------------------------------------- damage


def _paths(obj, prefix=()):
    """Every key path of a JSON tree (a manifest), for targeted edits."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))


MANIFEST_PATHS = [p for p in _paths(MANIFEST) if p]


def _edit(tree, path, value, delete):
    tree = json.loads(json.dumps(tree))
    node = tree
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return tree


manifest_damage = st.one_of(
    st.binary(max_size=200).map(lambda b: ("bytes", b)),
    JSON.map(lambda v: ("bytes", json.dumps(v).encode("utf-8", "surrogatepass"))),
    st.tuples(st.sampled_from(MANIFEST_PATHS), JSON, st.booleans()).map(
        lambda t: ("bytes", json.dumps(_edit(MANIFEST, *t), default=str).encode("utf-8", "surrogatepass"))),
)
parquet_damage = st.one_of(
    st.tuples(st.sampled_from(FILES[1:]), st.floats(0, 1)).map(lambda t: ("truncate", *t)),
    st.tuples(st.sampled_from(FILES[1:]), st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1,
                                                   max_size=8)).map(lambda t: ("flip", *t)),
    st.tuples(st.sampled_from(FILES[1:]), st.binary(max_size=300)).map(lambda t: ("replace", *t)),
    st.sampled_from(FILES[1:]).map(lambda f: ("swap", f)),  # valid parquet, the other table's schema
    st.tuples(st.sampled_from(FILES[1:]), st.dictionaries(st.sampled_from(["episode_id", "reward", "x", "r1", "round"]),
                                                          st.lists(st.integers(-5, 5) | st.none(), min_size=1,
                                                                   max_size=1), min_size=1)).map(
        lambda t: ("table", *t)),
)
folder_damage = st.one_of(
    st.sampled_from(FILES).map(lambda f: ("remove", f)),
    st.sampled_from(FILES).map(lambda f: ("as_dir", f)),
    st.just(("empty_folder",)),
    st.just(("extra_file",)),
)
DAMAGE = st.lists(st.one_of(manifest_damage.map(lambda d: ("manifest", d)), parquet_damage, folder_damage),
                  min_size=0, max_size=3)


def damaged_snapshot(damage: list, tag: str) -> Path:
    """A copy of the base snapshot with ``damage`` applied; returns its root."""
    root = _TMP / tag
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(_BASE, root)
    d = root / SID
    for op, *args in damage:
        _apply(d, op, *args)
    return root


def _reset(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _apply(d: Path, op: str, *args) -> None:
    if op == "manifest":
        _reset(d / "manifest.json")
        (d / "manifest.json").write_bytes(args[0][1])
    elif op in ("truncate", "flip") and (d / args[0]).is_file():
        f = d / args[0]
        data = bytearray(f.read_bytes())
        if op == "truncate":
            del data[int(args[1] * len(data)):]
        else:
            for where, mask in args[1]:
                if data:
                    data[min(int(where * len(data)), len(data) - 1)] ^= mask
        f.write_bytes(bytes(data))
    elif op == "replace":
        _reset(d / args[0])
        (d / args[0]).write_bytes(args[1])
    elif op == "swap":
        other = _BASE / SID / ("turns.parquet" if args[0] == "episodes.parquet" else "episodes.parquet")
        _reset(d / args[0])
        shutil.copy(other, d / args[0])
    elif op == "table":
        _reset(d / args[0])
        pq.write_table(pa.table(args[1]), d / args[0])
    elif op == "remove":
        _reset(d / args[0])
    elif op == "as_dir":
        _reset(d / args[0])
        (d / args[0]).mkdir()
    elif op == "empty_folder":
        for p in d.iterdir():
            _reset(p)
    elif op == "extra_file":
        (d / "notes.txt").write_text("hello")


# ---------------------------------------------------------------- the property


def _library_reads(root: Path) -> None:
    """Each reader ends in a value or a SnapshotError."""
    for m in list_snapshots(root):
        assert isinstance(summary_line(m), str)
    problems = verify_snapshot(root / SID)
    assert all(isinstance(p, str) for p in problems)
    for verify in (True, False):
        try:
            eps = load_snapshot(root, SID, verify=verify).episodes()
        except SnapshotError:
            continue
        assert isinstance(eps, list)
        if verify:
            assert not problems  # what verified is what was written
            assert [e.episode_id for e in eps] == [e.episode_id for e in make_episodes(4)]
    try:
        read_manifest(root / SID)
    except SnapshotError:
        pass


def _cli(argv: list[str], verdict_ok: bool = False) -> None:
    res = CliRunner().invoke(app, argv)
    assert res.exception is None or isinstance(res.exception, SystemExit), (argv, repr(res.exception))
    assert "Traceback" not in res.output, res.output
    assert res.exit_code in ((0, 1, 2) if verdict_ok else (0, 2)), (argv, res.exit_code, res.output)
    if res.exit_code == 2:  # progress lines may come first; the error is one line, the last
        errors = [line for line in res.stderr.strip().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0], res.stderr
    if res.exit_code == 1:
        assert all(line.startswith("corrupt: ") for line in res.stderr.strip().splitlines()), res.stderr


@FUZZ
@given(DAMAGE)
def test_damaged_snapshots_end_in_a_result_or_a_snapshot_error(damage):
    _library_reads(damaged_snapshot(damage, "lib"))


@FUZZ
@given(DAMAGE)
def test_snapshot_commands_end_in_a_result_or_one_error_line(damage):
    root = str(damaged_snapshot(damage, "cli"))
    _cli(["snapshots", "list", "--root", root])
    _cli(["snapshots", "show", SID, "--root", root])
    _cli(["snapshots", "verify", SID, "--root", root], verdict_ok=True)


@SLOW_FUZZ
@given(DAMAGE, st.booleans())
def test_analyze_ends_in_a_report_or_one_error_line(damage, no_verify):
    root = damaged_snapshot(damage, "analyze")
    _cli(["analyze", SID, "--root", str(root), "--out", str(_TMP / "report"), *(["--no-verify"] if no_verify else [])])


@FUZZ
@given(DAMAGE)
def test_train_upper_snapshot_loading_ends_in_snapshots_or_a_snapshot_error(damage):
    from tosca_mlmt.config import load_config

    root = damaged_snapshot(damage, "upper")
    cfg = load_config(overrides={"upper.snapshots": [SID], "upper.snapshot_root": str(root)})
    try:
        (snap,) = _load_snapshots(cfg)
    except SnapshotError:
        return
    assert verify_snapshot(snap.path) == [] and len(snap.episodes()) == 4


def test_the_undamaged_snapshot_reads_everywhere():
    """The fuzz's control: with no damage every reader succeeds (so errors above are caused by
    the damage, not by the harness)."""
    root = damaged_snapshot([], "control")
    assert verify_snapshot(root / SID) == [] and len(load_snapshot(root, SID).episodes()) == 4
    res = CliRunner().invoke(app, ["analyze", SID, "--root", str(root), "--out", str(_TMP / "control-report")])
    assert res.exit_code == 0, res.output
