"""The honest/privileged environment label is part of what a snapshot id stands for (format 4, issue 68
point 7), older formats keep their ids and rules, and what `mlmt snapshots` prints carries no raw control
characters from a manifest or folder anyone can edit (point 10). No model."""

import hashlib
import json

import pytest
from typer.testing import CliRunner

from factories import make_episodes, rewrite_manifest
from tosca_mlmt.cli.main import app
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.store import environment_of, load_snapshot, snapshot_rows, verify_snapshot, write_snapshot
from tosca_mlmt.store.manifest import FORMAT_VERSION, INFORMATIONAL, _canonical, snapshot_id

PRIVILEGED = {"kind": "collect", "task": {"name": "arith", "split": "train"}, "config": {"seed": 0},
              "summary": {"environment": "privileged:writer_sees_verdict", "acc_t1": 0.5}}


@pytest.mark.parametrize("edit", [
    lambda m: m["summary"].update(environment="honest"),
    lambda m: m["summary"].pop("environment"),
    lambda m: m.pop("summary"),
])
def test_relabelling_a_privileged_snapshot_breaks_its_id(tmp_path, edit):
    """Edit the label and recompute manifest_sha256: verify used to pass while `list` and `analyze` showed
    the privileged control as honest."""
    sid, _ = write_snapshot(tmp_path, make_episodes(), PRIVILEGED)
    assert json.loads((tmp_path / sid / "manifest.json").read_text())["format_version"] == FORMAT_VERSION == 4
    assert environment_of(load_snapshot(tmp_path, sid).manifest) == "privileged:writer_sees_verdict"
    rewrite_manifest(tmp_path / sid, edit)
    assert verify_snapshot(tmp_path / sid) == [f"manifest.json: id {sid} does not match its content (manifest edited)"]
    with pytest.raises(SnapshotError, match="does not match its content"):
        load_snapshot(tmp_path, sid)


def test_the_rest_of_the_summary_stays_informational(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), PRIVILEGED)
    rewrite_manifest(tmp_path / sid, lambda m: m["summary"].update(acc_t1=0.9, timings_note="x"))
    assert verify_snapshot(tmp_path / sid) == []
    m = json.loads((tmp_path / sid / "manifest.json").read_text())
    assert m["format_version"] == 4 and m["summary"]["acc_t1"] == 0.9


def test_the_same_episodes_labelled_otherwise_get_another_id(tmp_path):
    a, _ = write_snapshot(tmp_path / "a", make_episodes(), PRIVILEGED)
    b, _ = write_snapshot(tmp_path / "b", make_episodes(), {**PRIVILEGED, "summary": {"environment": "honest",
                                                                                      "acc_t1": 0.5}})
    assert a != b


def test_format_3_snapshots_keep_their_ids_and_old_rules(tmp_path, monkeypatch):
    """A format-3 id is a hash of its covered content without the label: written before this change, it
    still verifies (an edit of its label cannot be caught: that format never covered it)."""
    import tosca_mlmt.store.manifest as manifest

    monkeypatch.setattr(manifest, "FORMAT_VERSION", 3)
    sid, _ = write_snapshot(tmp_path, make_episodes(), PRIVILEGED)
    monkeypatch.undo()
    m = json.loads((tmp_path / sid / "manifest.json").read_text())
    assert m["format_version"] == 3 and manifest.FORMAT_VERSION == 4
    old_rules = {k: v for k, v in m.items() if k not in INFORMATIONAL}
    assert sid == snapshot_id(m) == "snap-" + hashlib.sha256(_canonical(old_rules)).hexdigest()[:16]
    assert verify_snapshot(tmp_path / sid) == [] and len(load_snapshot(tmp_path, sid).episodes()) == 3
    rewrite_manifest(tmp_path / sid, lambda m: m["summary"].update(environment="honest"))
    assert verify_snapshot(tmp_path / sid) == []
    # the same dict read as format 4 would stand for another id: the version decides the rules
    assert snapshot_id({**m, "format_version": 4}) != snapshot_id({**m, "format_version": 4, "summary": {}})


# ------------------------------------------------------------------ terminal output


ESC = "\x1b[2J\x1b[31m"


def test_snapshots_list_escapes_control_characters(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {"kind": f"{ESC}collect\u202e",
                                                        "summary": {"environment": f"honest{ESC}\x07"}})
    bad = tmp_path / f"snap-bad{ESC}"
    bad.mkdir()
    (bad / "manifest.json").write_text("{\"format_version\": 4, \"id\": \"x\x1b]0;pwned\x07\"}")
    res = CliRunner().invoke(app, ["snapshots", "list", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.output and "\x07" not in res.output and "\u202e" not in res.output
    assert "\\x1b[2J\\x1b[31mcollect\\u202e" in res.output and "honest\\x1b[2J\\x1b[31m\\x07" in res.output
    assert "snap-bad\\x1b[2J\\x1b[31m" in res.output and sid in res.output
    assert len(snapshot_rows(tmp_path)) == 2  # the rows themselves keep the values; only printing escapes


def test_snapshots_show_escapes_control_characters(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {"kind": f"{ESC}collect"})
    res = CliRunner().invoke(app, ["snapshots", "show", sid, "--root", str(tmp_path), "-n", "1"])
    assert res.exit_code == 0, res.output
    assert "\x1b[2J" not in res.output and "\\x1b[2J" in res.output
