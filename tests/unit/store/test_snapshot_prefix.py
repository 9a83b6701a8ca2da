"""Snapshot id prefixes wherever an id is taken: train-upper (--snapshot, upper.snapshots),
train-lower --snapshot, mlmt analyze. A unique prefix names its snapshot at any depth under the
root and is recorded as the full id; an ambiguous one is refused before any model loads, naming
every candidate."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from conftest import DEBUG_MODEL, TINY_OVERRIDES
from factories import OUTCOME_CASES, make_episodes
from tosca_mlmt.cli.main import app
from tosca_mlmt.errors import ConfigError, SnapshotError
from tosca_mlmt.store import full_ids, open_snapshot, write_snapshot


@pytest.fixture()
def two(tmp_path):
    """A run folder with two snapshots at different depths."""
    run = tmp_path / "run"
    a, _ = write_snapshot(run / "snapshots", make_episodes(cases=OUTCOME_CASES), {"kind": "collect"})
    b, _ = write_snapshot(run / "rounds" / "000" / "lower" / "snapshots", make_episodes(cases=OUTCOME_CASES)[:2],
                          {"kind": "train-lower-batch"})
    return run, a, b


def _unique(sid: str, other: str) -> str:
    """The shortest prefix of ``sid`` (without "snap-") that ``other`` does not share."""
    n = next(i for i in range(6, len(sid) + 1) if not other.startswith(sid[:i]))
    return sid[5:n]


def test_prefixes_resolve_to_full_ids_at_any_depth(two):
    run, a, b = two
    pa, pb = _unique(a, b), _unique(b, a)
    assert full_ids(run, [pa, "snap-" + pb]) == [a, b] and full_ids(run, [a]) == [a]
    with pytest.raises(ConfigError, match=f"snapshot {a} is given twice"):  # its decisions would count twice
        full_ids(run, [pa, b, a])
    assert open_snapshot(run, pb).id == b and len(open_snapshot(run, pb).episodes()) == 2
    with pytest.raises(SnapshotError) as e:
        full_ids(run, ["snap-"])
    assert "ambiguous" in str(e.value) and a in str(e.value) and b in str(e.value)


@pytest.mark.parametrize("cmd", [["train-upper", "--snapshot", "snap-"], ["train-lower", "--snapshot", "snap-"]])
def test_an_ambiguous_prefix_is_refused_before_any_model_loads(two, tmp_path, cmd):
    run, a, b = two
    res = CliRunner().invoke(app, [*cmd, "--root", str(run), "--out", str(tmp_path / "out"),
                                   "--set", "model.solver=no/such-model"])  # loading it would fail differently
    assert res.exit_code == 2, res.output
    assert "ambiguous" in res.stderr and a in res.stderr and b in res.stderr
    assert not (tmp_path / "out").exists()


def test_analyze_takes_a_prefix_under_its_root(two, tmp_path):
    run, a, b = two
    res = CliRunner().invoke(app, ["analyze", _unique(b, a), "--root", str(run), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert b in (tmp_path / "rep" / "report.md").read_text() and a not in (tmp_path / "rep" / "report.md").read_text()
    res = CliRunner().invoke(app, ["analyze", "snap-", "--root", str(run), "--out", str(tmp_path / "rep2")])
    assert res.exit_code == 2 and "ambiguous" in res.stderr and a in res.stderr and b in res.stderr


@pytest.mark.slow
def test_train_upper_records_the_full_id_of_a_prefix_and_resumes_with_it(debug_policies, tmp_path):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.collect import collect
    from tosca_mlmt.pipelines.train_upper import train_upper

    over = {**TINY_OVERRIDES, **DEBUG_MODEL, "solver_sampling.max_new_tokens": 6, "writer_sampling.max_new_tokens": 6,
            "episode.max_feedback_tokens": 6, "task.limit": 1, "episode.n_samples": 2}
    root = tmp_path / "collect"
    sid = collect(load_config(overrides={**over, "collect.out": str(root)}), policies=debug_policies).snapshot_id
    cfg = load_config(overrides={**over, "upper.snapshots": [sid[:9]], "upper.snapshot_root": str(tmp_path),
                                 "upper.steps": 1, "upper.batch_size": 2, "upper.warmup_steps": 1})
    out = tmp_path / "upper"
    # train_upper hands its Q head to the session's shared debug pair: put the pair back afterwards
    saved = debug_policies.q_head, debug_policies.q_decisions, debug_policies.strategies
    try:
        train_upper(cfg, out, policies=debug_policies)
        assert yaml.safe_load((out / "config.yaml").read_text())["upper"]["snapshots"] == [sid]
        assert [s["id"] for s in json.loads((out / "provenance.json").read_text())["snapshots"]] == [sid]
        # resuming with the full id (or the prefix again) is the same config: no drift
        full = load_config(overrides={**over, "upper.snapshots": [sid], "upper.snapshot_root": str(tmp_path),
                                      "upper.steps": 1, "upper.batch_size": 2, "upper.warmup_steps": 1})
        for again in (full, cfg):
            assert train_upper(again, out, resume=True, policies=debug_policies).step == 1
    finally:
        debug_policies.q_head, debug_policies.q_decisions, debug_policies.strategies = saved
