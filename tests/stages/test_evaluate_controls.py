"""`mlmt eval --majority K --resample tool` on the random-weight debug model: eval.json's control
numbers are recomputed here from the samples the eval stored, and the eval itself is unchanged."""

import json
import zlib
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import DEBUG_MODEL, TINY_OVERRIDES, run_mlmt

pytestmark = pytest.mark.slow

ROUNDS, PROBLEMS = 2, 6


def flag(text: str) -> bool:
    """The debug model writes no arithmetic the step checker could recheck: the test's arith
    check_attempt flags by a rule on the text, so that some resamples are used and some are not."""
    return zlib.crc32(text.encode()) % 2 == 1


def verify(self, problem, response):
    """The debug model never answers: a verdict made from the text gives the vote answers to count
    (three values, so that votes tie and win) and some of them right."""
    from tosca_mlmt.tasks.base import Verdict

    answer = str(zlib.crc32(response.encode()) // 2 % 3)
    return Verdict(answer == "0", float(answer == "0"), answer)


def by_problem(snapshot) -> dict:
    out: dict = {}
    for e in sorted(snapshot.episodes(), key=lambda e: (e.problem.id, e.sample)):
        out.setdefault(e.problem.id, []).append(e)
    return out


def vote(answers: list) -> int:
    """The majority rule written out again: the most votes, then the earliest first appearance."""
    from tosca_mlmt.analysis.controls import answer_key

    keys = [answer_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0
    first = {k: keys.index(k) for k in counts}
    winner = min(counts, key=lambda k: (-counts[k], first[k]))
    return first[winner]


def test_controls_are_recomputed_from_the_stored_samples(tmp_path, monkeypatch):
    from tosca_mlmt.analysis.sources import resolve
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.evaluate import evaluate
    from tosca_mlmt.store import load_snapshot
    from tosca_mlmt.tasks.arith import ArithTask

    monkeypatch.setattr(ArithTask, "verify", verify)
    monkeypatch.setattr(ArithTask, "check_attempt", lambda self, problem, text: SimpleNamespace(flagged=flag(text)))
    cfg = load_config(overrides={**TINY_OVERRIDES, **DEBUG_MODEL, "task.name": "arith", "task.limit": PROBLEMS,
                                 "episode.rounds": ROUNDS, "task.split": "test"})
    rep = evaluate(cfg, tmp_path / "e", majority=0, resample="tool").report
    snaps = tmp_path / "e" / "snapshots"
    main, ctl = load_snapshot(snaps, rep["snapshot_id"]), load_snapshot(snaps, rep["controls"]["snapshot_id"])
    # the controls' answers: 1 + rounds samples per problem, sampled at the solver's temperature, turn 1 only
    k = 1 + ROUNDS
    assert rep["majority_k"] == k and rep["generations_per_problem"]["majority"] == k
    assert ctl.manifest["config"]["solver_sampling"]["temperature"] == cfg.solver_sampling.temperature > 0
    samples, firsts = by_problem(ctl), by_problem(main)
    assert set(samples) == set(firsts) and len(firsts) == PROBLEMS
    assert all([t.kind for e in eps for t in e.turns] == ["solve"] * k for eps in samples.values())
    rows = {r["id"]: r for r in json.loads((tmp_path / "e" / "controls.json").read_text())["rows"]}
    maj, res, used, fixed, broke = 0, 0, 0, 0, 0
    for pid, eps in samples.items():
        turns = [e.turns[0] for e in eps]
        assert [s["answer"] for s in rows[pid]["samples"]] == [t.extracted for t in turns]
        pick = vote([t.extracted for t in turns])
        assert rows[pid]["majority_pick"] == pick
        maj += bool(turns[pick].correct)
        first = firsts[pid][0].turns[0]
        chain = [first, *turns[:ROUNDS]]
        final = next((i for i, t in enumerate(chain[:-1]) if not flag(t.text)), ROUNDS)
        assert rows[pid]["resample_pick"] == final
        res += bool(chain[final].correct)
        used += final > 0
        fixed += not first.correct and bool(chain[final].correct)
        broke += bool(first.correct) and not chain[final].correct
    assert used > 0, "no resample was used: the test's flag rule no longer exercises the gate"
    assert rep["acc_majority"] == pytest.approx(maj / PROBLEMS)
    assert rep["acc_resample"] == pytest.approx(res / PROBLEMS)
    assert rep["resample_flagged"] == sum(flag(f[0].turns[0].text) for f in firsts.values())
    assert (rep["resample_used"], rep["resample_fixed"], rep["resample_broke"]) == (used, fixed, broke)
    assert rep["generations_per_problem"]["resample"] == {"max": k, "mean": pytest.approx((PROBLEMS + sum(
        r["resample_pick"] for r in rows.values())) / PROBLEMS)}
    # the eval itself is the one an eval without controls plays (the shared model and engine change nothing)
    plain = evaluate(cfg, tmp_path / "plain").report
    assert plain["snapshot_id"] == rep["snapshot_id"] and "acc_majority" not in plain
    assert plain["refine"] == rep["refine"] == "greedy"  # the eval protocol unless --refine sampled
    # mlmt analyze reads the eval folder's eval, not its controls' samples as a second held-out eval
    src = resolve([str(tmp_path / "e")], tmp_path)
    assert set(src.snapshots) == {rep["snapshot_id"]} and src.evals == [tmp_path / "e"]


def test_resample_on_a_task_without_a_checker_fails_before_the_eval(tmp_path):
    data = tmp_path / "qa.jsonl"  # a user's own task: no check_attempt, and no arithmetic to recheck
    data.write_text(json.dumps({"question": "Name a colour.", "answer": "red"}) + "\n")
    p = run_mlmt("eval", "--out", tmp_path / "o", "--task", "jsonl", "--set", f"task.path={data}", "--limit", "2",
                 "--no-wandb", "--resample", "tool", "--set", "model.solver=tiny-random")
    assert p.returncode == 2 and "'jsonl' has no checker" in p.stderr
    assert not (tmp_path / "o" / "snapshots").exists()


def test_refine_sampled_with_a_greedy_solver_config_fails_before_the_eval(tmp_path):
    p = run_mlmt("eval", "--out", tmp_path / "o", "--task", "arith", "--limit", "2", "--no-wandb", "--refine", "sampled",
                 "--set", "solver_sampling.temperature=0", "--set", "model.solver=tiny-random")
    assert p.returncode == 2 and "--refine sampled: solver_sampling.temperature is 0" in p.stderr
    assert not (tmp_path / "o" / "snapshots").exists()
