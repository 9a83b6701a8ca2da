"""`mlmt eval`: greedy, held-out only, no oracle stop."""

import json

import pytest

from conftest import TINY, run_mlmt

pytestmark = pytest.mark.slow


def test_eval_uses_only_held_out_problems_and_runs_every_round(tmp_path):
    from tosca_mlmt.store import load_snapshot
    from tosca_mlmt.tasks.arith import ArithTask

    # the writer sees the verifier's verdict here: a privileged environment, labelled in eval.json and manifest.
    # On the debug base: nothing here reads what the model answers (at 24 tokens the embedded model gets
    # none of these 3 right either, so neither base makes the every-round check below see a right first try)
    p = run_mlmt("eval", "--out", tmp_path, "--task", "arith", "--limit", "3", "--no-wandb", "--set", "task.level=1",
                 "--set", "episode.writer_sees=verdict", "--set", "model.solver=tiny-random", *TINY, check=True)
    rep = json.loads((tmp_path / "eval.json").read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1])["snapshot_id"] == rep["snapshot_id"]
    snap = load_snapshot(tmp_path / "snapshots", rep["snapshot_id"])
    ids = set(snap.manifest["task"]["problem_ids"])
    train = {q.id for q in ArithTask(1).load("train", 0).problems}
    test = {q.id for q in ArithTask(1).load("test", 0).problems}
    assert ids and ids <= test and ids.isdisjoint(train)
    assert snap.manifest["config"]["solver_sampling"]["temperature"] == 0.0
    # no oracle stop: episodes whose first attempt was right still got feedback and a refine
    for ep in snap.episodes():
        assert [t.kind for t in ep.turns] == ["solve", "feedback", "refine"]
    for k in ("acc_t1", "acc_final", "delta", "wrong_to_right", "right_to_wrong"):
        assert k in rep
    assert rep["environment"] == snap.manifest["summary"]["environment"] == "privileged:writer_sees_verdict"


def test_eval_runs_arith_unseen_phrasings_split(tmp_path):
    """--split test-unseen: the test facts in phrasings training never uses, recorded as that split."""
    from tosca_mlmt.store import load_snapshot
    from tosca_mlmt.tasks.arith import ArithTask

    run_mlmt("eval", "--out", tmp_path, "--task", "arith", "--split", "test-unseen", "--limit", "2", "--no-wandb",
             "--set", "task.level=2", "--set", "model.solver=tiny-random", *TINY, check=True)
    rep = json.loads((tmp_path / "eval.json").read_text())
    snap = load_snapshot(tmp_path / "snapshots", rep["snapshot_id"])
    unseen = [q.id for q in ArithTask(2).load("test-unseen", 2).problems]
    assert rep["split"] == "test-unseen" and sorted(snap.manifest["task"]["problem_ids"]) == sorted(unseen)
    p = run_mlmt("eval", "--out", tmp_path / "gsm8k", "--task", "gsm8k", "--split", "test-unseen", "--no-wandb")
    assert p.returncode == 2 and "task.split" in p.stderr


def test_eval_refuses_the_training_split(tmp_path):
    p = run_mlmt("eval", "--out", tmp_path, "--task", "arith", "--split", "train", "--no-wandb")
    assert p.returncode == 2 and "held-out" in p.stderr


def test_compare_to_a_folder_that_is_no_eval_fails_before_the_eval_runs(tmp_path):
    p = run_mlmt("eval", "--out", tmp_path / "o", "--task", "arith", "--limit", "3", "--no-wandb",
                 "--compare-to", tmp_path / "missing")
    assert p.returncode == 2 and "not an eval folder" in p.stderr
    assert not (tmp_path / "o" / "snapshots").exists()
