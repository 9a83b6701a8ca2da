"""Reading episodes: outcome filters, sample rows, snapshots found at any depth and named by id
prefix, the `mlmt snapshots` viewer, and the samples table in an offline wandb run. No model."""

import json

import pytest
from typer.testing import CliRunner

from factories import OUTCOME_CASES, make_episodes
from tosca_mlmt.cli.main import app
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.metrics import MetricsSink
from tosca_mlmt.samples import OUTCOMES, SAMPLE_COLUMNS, episode_record, outcome, sample_rows, select, spread
from tosca_mlmt.store import environment_of, find_snapshot_dirs, resolve_snapshot, snapshot_rows, write_snapshot


@pytest.fixture()
def run(tmp_path):
    """A run folder with snapshots at two depths, plus things that must not count as snapshots."""
    run = tmp_path / "run"
    a, _ = write_snapshot(run / "snapshots", make_episodes(cases=OUTCOME_CASES), {"kind": "collect", "summary": {"environment": "honest"}})
    b, _ = write_snapshot(run / "rounds" / "000" / "lower" / "snapshots", make_episodes(cases=OUTCOME_CASES)[:2],
                          {"kind": "train-lower-batch", "config": {"episode": {"writer_sees": "verdict"}}})
    (run / "manifest.json").write_text("{}")  # a train-joint manifest: not a snapshot
    (run / "snapshots" / ".tmp-1-x").mkdir()  # a build in progress: hidden
    return run, a, b


# ------------------------------------------------------------------ samples


def test_outcomes_filters_and_spread():
    eps = make_episodes(cases=OUTCOME_CASES)
    assert [outcome(e) for e in eps] == ["wrong_to_right", "right_to_wrong", "right_to_right", "wrong_to_wrong",
                                         "wrong_to_right"]
    assert [e.problem.id[-1] for e in select(eps, 5, "wrong_to_right")] == ["0", "4"]
    assert [e.problem.id[-1] for e in select(eps, 1, "wrong_to_right")] == ["0"]
    assert [e.problem.id[-1] for e in select(eps, 5, "leak")] == ["0"]  # "The answer is 10." for gold 10
    assert len(select(eps, 9)) == 5
    with pytest.raises(ValueError, match="allowed"):
        select(eps, 1, "nope")
    # one of each outcome class before a second of any
    assert sorted(outcome(e) for e in spread(eps, 4)) == sorted(OUTCOMES)


def test_episode_record_and_sample_rows():
    r = episode_record(make_episodes(cases=OUTCOME_CASES)[0])
    assert r["problem"] == "What is 3 + 7?" and r["gold"] == "10" and r["z"] == "I think 99."
    (rd,) = r["rounds"]
    assert rd["strategy"] == "reread_question" and rd["leaked"] is True and rd["y"] == "So 10."
    assert rd["reward"] == 1.0 and rd["counterfactual_reward"] == 0.0
    rows = sample_rows(make_episodes(cases=OUTCOME_CASES), n=3)
    assert len(rows) == 3 and all(tuple(x) == SAMPLE_COLUMNS for x in rows)
    assert rows[0]["outcome"] == "right_to_wrong"  # the rare classes first (OUTCOMES order)
    first = next(x for x in rows if x["episode_id"] == "arith-L1-000000/s0")
    assert first["g"] == "The answer is 10." and first["y_hat"] == "So 10." and first["rewards"] == "0 1"
    assert first["leaked"] == "true" and first["strategy"] == "reread_question"


# ------------------------------------------------------------------ finding snapshots


def test_found_at_any_depth_and_named_by_unique_prefix(run, tmp_path):
    path, a, b = run
    found = find_snapshot_dirs(path)
    assert set(found) == {a, b} and found[b].parent.parent.name == "lower"
    assert resolve_snapshot(path, a) == found[a]
    assert resolve_snapshot(path, a[:12]) == found[a] and resolve_snapshot(path, a[5:12]) == found[a]
    with pytest.raises(SnapshotError, match=f"ambiguous.*{a}.*{b}|ambiguous.*{b}.*{a}"):
        resolve_snapshot(path, "snap-")
    with pytest.raises(SnapshotError, match="no snapshot 'snap-zzz'"):
        resolve_snapshot(path, "snap-zzz")
    with pytest.raises(SnapshotError, match="not a snapshot id"):
        resolve_snapshot(path, "../x")
    # the snapshot folder itself is a root too
    assert resolve_snapshot(found[a], a[:10]) == found[a]


def test_rows_carry_kind_and_environment(run):
    path, a, b = run
    rows = {r["id"]: r for r in snapshot_rows(path)}
    assert rows[a]["kind"] == "collect" and rows[a]["environment"] == "honest" and rows[a]["episodes"] == 5
    assert rows[b]["kind"] == "train-lower-batch" and rows[b]["environment"] == "privileged:writer_sees_verdict"
    assert rows[b]["where"] == f"rounds/000/lower/snapshots/{b}"
    assert environment_of({"config": {"episode": {"feedback": "verdict"}}}) == "privileged:verdict_feedback"
    assert environment_of({"summary": {"environment": "privileged:x"}}) == "privileged:x"
    assert environment_of({}) == "honest"


# ------------------------------------------------------------------ the CLI


def test_cli_list_show_and_verify_by_prefix(run):
    path, a, b = run
    cli = CliRunner()
    res = cli.invoke(app, ["snapshots", "list", "--root", str(path)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert {ln.split()[0] for ln in lines} == {a, b}
    assert any(b in ln and "privileged:writer_sees_verdict" in ln and "train-lower-batch" in ln for ln in lines)
    res = cli.invoke(app, ["snapshots", "show", a[:10], "--root", str(path)])
    assert res.exit_code == 0 and json.loads(res.stdout)["id"] == a
    res = cli.invoke(app, ["snapshots", "verify", a[:10], "--root", str(path)])
    assert res.exit_code == 0 and res.stdout.strip() == f"{a}: ok"


def test_cli_shows_episodes_decoded_and_filtered(run):
    path, a, _ = run
    cli = CliRunner()
    res = cli.invoke(app, ["snapshots", "show", a, "--root", str(path), "--episodes", "2"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    out = res.stdout
    for needle in ("What is 3 + 7?", "I think 99.", "reread_question", "The answer is 10.", "So 10.",
                   "LEAKS THE ANSWER", "wrong -> right", "right -> wrong", "counterfactual_reward 0.0",
                   "Check [bold]your[/] sum."):  # feedback text is printed verbatim, never as markup
        assert needle in out, needle
    assert "What is 5 + 7?" not in out  # only two episodes
    assert out.count("bonus n/a") == 2  # no PPO update saw these episodes: no context bonus stored
    res = cli.invoke(app, ["snapshots", "show", a, "--root", str(path), "-n", "5", "--filter", "wrong_to_wrong"])
    assert res.exit_code == 0 and "Recompute 3 + 4." in res.stdout and "What is 3 + 7?" not in res.stdout
    res = cli.invoke(app, ["snapshots", "show", a, "--root", str(path), "-n", "5", "--filter", "leak"])
    assert res.exit_code == 0 and res.stdout.count("LEAKS THE ANSWER") == 1


def test_cli_errors(run):
    path, a, b = run
    cli = CliRunner()
    res = cli.invoke(app, ["snapshots", "show", "snap-", "--root", str(path), "--episodes", "1"])
    assert res.exit_code == 2 and "ambiguous" in res.stderr and a in res.stderr and b in res.stderr
    res = cli.invoke(app, ["snapshots", "show", a, "--root", str(path), "-n", "1", "--filter", "nope"])
    assert res.exit_code == 2 and "right_to_wrong" in res.output
    res = cli.invoke(app, ["snapshots", "verify", "snap-nope", "--root", str(path)])
    assert res.exit_code == 2 and "no snapshot 'snap-nope'" in res.stderr


# ------------------------------------------------------------------ wandb


def test_samples_table_reaches_the_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = MetricsSink(tmp_path, {}, trackers=("wandb",), wandb_mode="offline", project="t", enabled=True)
    sink.log({"collect/acc_t1": 0.5})
    sink.log_table("collect/samples", sample_rows(make_episodes(cases=OUTCOME_CASES), n=4))
    sink.close()
    (table,) = list(tmp_path.glob("wandb/offline-run-*/files/media/table/collect/samples_*.table.json"))
    t = json.loads(table.read_text())
    assert t["columns"] == list(SAMPLE_COLUMNS) and len(t["data"]) == 4
    assert "The answer is 10." in [row[t["columns"].index("g")] for row in t["data"]]
    # without wandb nothing is logged, and metrics.jsonl stays numbers only
    off = MetricsSink(tmp_path / "off", {}, trackers=(), wandb_mode="offline", project="t", enabled=True)
    off.log_table("collect/samples", sample_rows(make_episodes(cases=OUTCOME_CASES)))
    assert not (tmp_path / "off" / "wandb").exists()
    assert "samples" not in (tmp_path / "metrics.jsonl").read_text()
