"""`mlmt analyze` on hand-made snapshots and metrics whose tables are known exactly. No model."""

import contextlib
import datetime
import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from factories import patterned_episode
from tosca_mlmt.analysis.sources import TURN_READERS, read_metrics, read_turns, resolve
from tosca_mlmt.analysis.tables import compute_tables, snapshot_index
from tosca_mlmt.cli.main import app
from tosca_mlmt.store import write_snapshot
from tosca_mlmt.store.manifest import SUPPORTED_VERSIONS

R, W = True, False
# Snapshot A, one feedback round: (correct at turn 1, correct at the end), strategy, feedback length.
# 3 right->right, 1 right->wrong, 4 wrong->right, 2 wrong->wrong.
SPEC_A = [((R, R), "verify", 4), ((R, R), "verify", 4), ((R, R), "hint", 20), ((R, W), "hint", 20),
          ((W, R), "verify", 10), ((W, R), "verify", 10), ((W, R), "hint", 40), ((W, R), "explain", 40),
          ((W, W), "explain", 70), ((W, W), "hint", 70)]
# Snapshot B, two feedback rounds, always "verify" with 4-token feedback.
PATTERNS_B = [(W, W, R), (W, R, R), (R, R, R), (R, W, W)]
METRICS = [
    {"time": 1.0, "step": 1, "lower/acc_t1": 0.25, "lower/acc_final": 0.5, "lower/bonus/mean": 0.1,
     "lower/bonus/corr_correct": float("nan"), "lower/kl": 0.0, "lower/time/generate": 3.0, "lower/iteration": 1,
     "lower/iteration_seconds": 9.0, "lower/gen_tokens_per_s": 50.0, "lower/snapshot": "snap-x"},
    {"time": 2.0, "step": 2, "lower/acc_t1": 0.5, "lower/acc_final": 0.75, "lower/bonus/mean": 0.2,
     "lower/bonus/corr_correct": 0.5, "lower/kl": 0.01, "lower/snapshot": None},
    {"time": 3.0, "step": 10, "upper/td_loss": 0.9, "upper/q/verify": 0.3},
    {"time": 4.0, "joint/acc_final": 0.6, "collect/acc_t1": 0.1},  # no step: its line number (4) stands in
    {"time": 5.0, "step": 2, "lower/acc_t1": 0.55},  # logged again after a resume: the later value wins
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder: metrics.jsonl (torn last line, as after a kill) and snapshots B (iteration 0)
    then A (iteration 1)."""
    run = tmp_path_factory.mktemp("runs") / "run"
    snaps = run / "snapshots"
    eps_b = [patterned_episode(i, p, ["verify"] * 2, [4, 4], "b") for i, p in enumerate(PATTERNS_B)]
    sid_b, _ = write_snapshot(snaps, eps_b, {"kind": "train-lower-batch", "iteration": 0})
    eps_a = [patterned_episode(i, p, [s], [n], "a") for i, (p, s, n) in enumerate(SPEC_A)]
    sid_a, _ = write_snapshot(snaps, eps_a, {"kind": "train-lower-batch", "iteration": 1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS) + '{"step": 3, "lower/acc')
    return run, sid_a, sid_b


def tables_for(*args, root=Path("snapshots")):
    src = resolve([str(a) for a in args], root)
    return compute_tables(read_metrics(src.metrics), [m for _, m in src.snapshots.values()], read_turns(src.snapshots))


def rows(df: pd.DataFrame, *cols) -> list[tuple]:
    return [tuple(round(v, 9) if isinstance(v, float) else v for v in r)
            for r in df[list(cols)].itertuples(index=False)]


def test_every_supported_snapshot_format_version_has_a_reader():
    assert set(SUPPORTED_VERSIONS) <= set(TURN_READERS)


def test_snapshots_are_ordered_by_creation_then_iteration():
    ms = [{"id": "snap-c", "created_at": "2026-01-01T00:00:02+00:00", "iteration": 0, "format_version": 1},
          {"id": "snap-b", "created_at": "2026-01-01T00:00:01+00:00", "iteration": 5, "format_version": 1},
          {"id": "snap-a", "created_at": "2026-01-01T00:00:01+00:00", "iteration": 4, "format_version": 1}]
    assert snapshot_index(ms)["snapshot"].tolist() == ["snap-a", "snap-b", "snap-c"]


def test_correction_matrix_matches_the_hand_made_episodes(run):
    path, sid_a, sid_b = run
    t = tables_for(path / "snapshots" / sid_a)
    assert rows(t.correction, "snapshot", "turn1", "final", "count", "rate") == [
        (sid_a, "right", "right", 3, 0.3), (sid_a, "right", "wrong", 1, 0.1),
        (sid_a, "wrong", "right", 4, 0.4), (sid_a, "wrong", "wrong", 2, 0.2)]
    both = tables_for(path).correction  # A and B side by side, never added up; B has no wrong->wrong
    assert rows(both[both["snapshot"] == sid_b], "turn1", "final", "count") == [
        ("right", "right", 1), ("right", "wrong", 1), ("wrong", "right", 2), ("wrong", "wrong", 0)]


def test_accuracy_per_turn_follows_snapshot_order(run):
    path, sid_a, sid_b = run
    t = tables_for(path)
    assert rows(t.snapshots, "order", "snapshot", "iteration", "episodes") == [(0, sid_b, 0, 4), (1, sid_a, 1, 10)]
    assert rows(t.accuracy, "order", "attempt", "episodes", "accuracy") == [
        (0, 1, 4, 0.5), (0, 2, 4, 0.5), (0, 3, 4, 0.75), (1, 1, 10, 0.4), (1, 2, 10, 0.7)]


def test_strategy_distribution_and_value(run):
    path, sid_a, sid_b = run
    t = tables_for(path)
    assert rows(t.strategies, "order", "strategy", "count", "share", "mean_r_final", "mean_improvement") == [
        (0, "verify", 8, 1.0, 0.75, 0.25),
        (1, "explain", 2, 0.2, 0.5, 0.5), (1, "hint", 4, 0.4, 0.5, 0.0), (1, "verify", 4, 0.4, 1.0, 0.5)]


def test_strategy_share_after_right_and_after_wrong_attempts(run):
    """B: two rounds of "verify"; round 2's feedback answers the refine before it, so the 8 feedback turns
    follow right and wrong attempts 4 and 4. A: after the 4 right first attempts verify x2, hint x2; after
    the 6 wrong ones verify x2, hint x2, explain x2."""
    path, sid_a, sid_b = run
    t = tables_for(path)
    assert rows(t.strategy_correctness, "order", "after", "strategy", "count", "share") == [
        (0, "right", "verify", 4, 1.0), (0, "wrong", "verify", 4, 1.0),
        (1, "right", "hint", 2, 0.5), (1, "right", "verify", 2, 0.5),
        (1, "wrong", "explain", 2, round(1 / 3, 9)), (1, "wrong", "hint", 2, round(1 / 3, 9)),
        (1, "wrong", "verify", 2, round(1 / 3, 9))]
    # a second round's feedback counts after the refine it read, not after the first attempt
    from tosca_mlmt.analysis.tables import strategy_by_correctness

    ep = patterned_episode(0, (W, R, R), ["hint", "verify"], [4, 4], "c")
    turns = pd.DataFrame([{"order": 0, "snapshot": "s", "episode_id": ep.episode_id, "turn_index": t.index,
                           "role": t.role, "kind": t.kind, "correct": t.correct, "strategy_name": t.strategy_name}
                          for t in ep.turns])
    assert rows(strategy_by_correctness(turns), "after", "strategy", "count") == [("right", "verify", 1),
                                                                                ("wrong", "hint", 1)]


def test_feedback_length_vs_outcome(run):
    path, sid_a, _ = run
    t = tables_for(sid_a, root=path / "snapshots")  # a snapshot id resolved under --root
    assert rows(t.feedback_length, "tokens", "feedback_turns", "final_accuracy", "mean_improvement") == [
        ("0-7", 2, 1.0, 0.0), ("8-15", 2, 1.0, 1.0), ("16-31", 2, 0.5, -0.5), ("32-63", 2, 1.0, 1.0),
        ("64-127", 2, 0.0, 0.0)]


def test_learning_curves_and_bonus_from_metrics_jsonl(run):
    path, _, _ = run
    t = tables_for(path)
    assert rows(t.runs, "run", "records") == [("run", 5)]  # the torn last line is skipped
    assert rows(t.curves, "run", "level", "metric", "step", "value") == [
        ("run", "joint", "acc_final", 4, 0.6),
        ("run", "lower", "acc_final", 1, 0.5), ("run", "lower", "acc_final", 2, 0.75),
        ("run", "lower", "acc_t1", 1, 0.25), ("run", "lower", "acc_t1", 2, 0.55),
        ("run", "lower", "bonus/corr_correct", 2, 0.5),
        ("run", "lower", "bonus/mean", 1, 0.1), ("run", "lower", "bonus/mean", 2, 0.2),
        ("run", "lower", "kl", 1, 0.0), ("run", "lower", "kl", 2, 0.01),
        ("run", "upper", "q/verify", 10, 0.3), ("run", "upper", "td_loss", 10, 0.9)]
    expected = pd.DataFrame({"run": ["run", "run"], "step": [1, 2], "bonus/mean": [0.1, 0.2],
                             "bonus/corr_correct": [np.nan, 0.5], "acc_t1": [0.25, 0.55], "acc_final": [0.5, 0.75]})
    pd.testing.assert_frame_equal(t.bonus, expected)


def test_cli_writes_figures_and_a_report_linking_them(run, tmp_path):
    path, sid_a, _ = run
    res = CliRunner().invoke(app, ["analyze", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    report = tmp_path / "out" / "report.md"
    assert res.stdout.strip().splitlines()[-1] == str(report)
    text = report.read_text()
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    # joint and upper logged one step each: a single dot is no curve (report.md has the values)
    assert pngs == sorted(["curves-01-lower.png",
                           "accuracy_per_turn.png", "correction_matrix.png", "strategies.png",
                           "strategy_by_correctness.png", "q_per_strategy.png", "bonus_vs_correctness.png", "feedback_length.png"])
    assert (tmp_path / "out" / "report.html").stat().st_size > 1000  # tests/unit/analysis/test_report_html.py reads it
    assert all((tmp_path / "out" / p).stat().st_size > 1000 for p in pngs)
    assert sorted(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)) == pngs
    for heading in ("Learning curves per level", "Accuracy per turn over snapshots", "Correction matrix",
                    "Strategy distribution and value over time", "Context-dependency bonus vs correctness",
                    "Feedback length vs outcome"):
        assert f"## {heading}" in text
    # no held-out eval: the grid is the newest snapshot's (A), not a pool of A and B
    assert f"The newest snapshot (no held-out eval among the inputs), #1 `{sid_a}` (10 episodes):" in text
    assert "| turn 1 right | 3 (30.0%) | 1 (10.0%) |" in text and "| turn 1 wrong | 4 (40.0%) | 2 (20.0%) |" in text


def test_cli_refuses_an_unknown_snapshot_format_version(run, tmp_path):
    path, sid_a, _ = run
    bad = tmp_path / "run2" / "snapshots" / sid_a
    shutil.copytree(path / "snapshots" / sid_a, bad)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    for arg in (bad, tmp_path / "run2"):  # as a snapshot folder, and found inside a run folder
        res = CliRunner().invoke(app, ["analyze", str(arg), "--out", str(tmp_path / "out")])
        assert res.exit_code == 2
        assert sid_a in res.stderr and "format version 99 is not supported" in res.stderr
    assert not (tmp_path / "out").exists()


def test_cli_rejects_an_argument_that_is_nothing_it_knows(tmp_path):
    res = CliRunner().invoke(app, ["analyze", "snap-nope", "--root", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "'snap-nope' is not a run folder" in res.stderr


def test_privileged_snapshots_are_labelled_above_everything_in_the_report():
    from tosca_mlmt.analysis.report import environment_lines

    base = {"created_at": "2026-01-01T00:00:01+00:00", "format_version": 2}
    honest = {**base, "id": "h", "summary": {"environment": "honest"}}
    priv = {**base, "id": "p", "summary": {"environment": "privileged:writer_sees=verdict"}}
    old = {**base, "id": "o"}  # written before the label existed: honest
    idx = snapshot_index([honest, priv, old])
    assert dict(zip(idx["snapshot"], idx["environment"])) == {
        "h": "honest", "p": "privileged:writer_sees=verdict", "o": "honest"}

    def banner(ms):
        return "\n".join(environment_lines(snapshot_index(ms)))

    assert "honest" in banner([honest, old]) and "Privileged" not in banner([honest, old])
    assert "Privileged environment" in banner([priv]) and "mixed" not in banner([priv])
    assert "`privileged:writer_sees=verdict`" in banner([honest, priv]) and "mixed" in banner([honest, priv])


def test_the_snapshot_index_environment_is_the_one_mlmt_snapshots_shows():
    """An mbpp collect whose summary predates the grading-tests label: both views call it privileged."""
    from tosca_mlmt.store import environment_of

    m = {"id": "m", "created_at": "2026-01-01T00:00:01+00:00", "format_version": 2,
         "config": {"task": {"name": "mbpp"}, "episode": {"rounds": 1}}, "summary": {"environment": "honest"}}
    assert snapshot_index([m])["environment"].tolist() == [environment_of(m)] == ["privileged:grading_tests"]


# ---------------------------------------------------------------------- the result: before vs after

# Ten held-out problems, (correct at turn 1, correct at the end). Final answers: before 3 right, after 7;
# problems 3-7 fixed, problem 2 lost: McNemar's exact p = 2 * P(Bin(6, 1/2) <= 1) = 2 * 7/64.
BEFORE = [(R, R), (W, R), (R, R), (W, W), (W, W), (W, W), (R, W), (W, W), (W, W), (W, W)]
AFTER = [(R, R), (R, R), (R, W), (W, R), (R, R), (W, R), (W, R), (R, R), (W, W), (R, W)]


@contextlib.contextmanager
def written_on(day: int):
    """Snapshots written inside get this creation day: before and after an eval must be told apart by time."""
    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 1, day, 12, tzinfo=datetime.timezone.utc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tosca_mlmt.store.manifest._dt", types.SimpleNamespace(datetime=Clock, timezone=datetime.timezone))
        yield


def make_eval(folder: Path, patterns, day: int, prefix: str = "e", **report) -> Path:
    """An eval folder as mlmt eval writes it: a greedy test-split snapshot and eval.json naming it."""
    eps = [patterned_episode(i, p, ["hint"], [5], prefix) for i, p in enumerate(patterns)]
    with written_on(day):
        sid, _ = write_snapshot(folder / "snapshots", eps, {
            "kind": "collect", "task": {"split": "test"}, "sampling": {"solver": {"temperature": 0.0}},
            "summary": {"environment": "honest"}})
    (folder / "eval.json").write_text(json.dumps({"snapshot_id": sid, "split": "test", **report}))
    return folder


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """A training run (one sampled batch at T = 0.7, day 2), the eval before it (day 1) and after it (day 3)."""
    base = tmp_path_factory.mktemp("evals")
    run = base / "run"
    with written_on(2):
        write_snapshot(run / "snapshots", [patterned_episode(i, p, ["verify"], [4], "b") for i, p in enumerate(AFTER)],
                       {"kind": "train-lower-batch", "iteration": 0, "task": {"split": "train"},
                        "sampling": {"solver": {"temperature": 0.7}}})
    return run, make_eval(base / "before", BEFORE, 1), make_eval(base / "after", AFTER, 3)


def compare_to(before: Path, after: Path) -> dict:
    """What `mlmt eval --compare-to BEFORE` stores in the later eval's eval.json (pipelines/evaluate.py)."""
    from tosca_mlmt.pipelines.evaluate import compare_outcomes, eval_outcomes

    return {"eval": str(before), **compare_outcomes(eval_outcomes(before), eval_outcomes(after), before)}


def _result_section(text: str) -> str:
    return text.split("## Result", 1)[1].split("\n## ", 1)[0]


def test_the_report_opens_with_before_vs_after_as_eval_compare_to_computes_it(evals, tmp_path):
    from tosca_mlmt.analysis.stats import wilson
    from tosca_mlmt.pipelines.analyze import analyze

    run, before, after = evals
    res = analyze([str(run), str(after), str(before)], tmp_path / "out")  # the order of arguments does not matter
    h = res.headline
    assert (h.before, h.after, h.stored) == (str(before), str(after), False)
    assert h.comparison == compare_to(before, after)
    c = h.comparison  # and by hand
    assert c["problems"] == 10 and c["final_mcnemar"] == {"a_only": 5, "b_only": 1, "p": pytest.approx(14 / 64)}
    assert c["final_difference"]["mean"] == pytest.approx(0.4) and c["after_acc_t1"]["mean"] == pytest.approx(0.6)
    assert (c["before_acc_final"]["lo"], c["before_acc_final"]["hi"]) == wilson(3, 10)
    d = c["final_difference"]
    lead = (f"Acc@final 0.300 → 0.700 on the same 10 held-out problems: after − before +0.400, 95 % interval "
            f"[{d['lo']:+.3f}, {d['hi']:+.3f}]; McNemar p = 0.219 (5 fixed, 1 lost).")
    md, page = res.report.read_text(), res.html.read_text()
    assert md.index("## Result") < md.index("\n## ", md.index("## Result") + 1)  # the first section
    assert [ln for ln in md.splitlines() if ln.startswith("## ")][0] == "## Result"
    result = _result_section(md)
    assert f"**{lead}**" in result
    lo, hi = wilson(7, 10)
    assert f"| Acc@final | 0.300 [{wilson(3, 10)[0]:.3f}, {wilson(3, 10)[1]:.3f}] | 0.700 [{lo:.3f}, {hi:.3f}] |" in result
    assert "Computed by `mlmt analyze`" in result
    assert page.index('<section id="result">') < page.index('id="accuracy"')
    assert f'<p class="lead"><strong>{lead}</strong></p>' in page


def test_a_stored_compare_to_is_the_result_even_without_the_earlier_eval(evals, tmp_path):
    """The later eval alone, run with --compare-to: its eval.json holds the numbers, nothing is recomputed."""
    from tosca_mlmt.pipelines.analyze import analyze

    _, before, after = evals
    stored = compare_to(before, after)
    later = tmp_path / "later"
    shutil.copytree(after, later)
    rep = json.loads((later / "eval.json").read_text())
    (later / "eval.json").write_text(json.dumps({**rep, "compared_to": stored}))
    res = analyze([str(later)], tmp_path / "out")
    assert res.headline.stored and res.headline.comparison == stored and res.headline.before == str(before)
    result = _result_section(res.report.read_text())
    assert "McNemar p = 0.219 (5 fixed, 1 lost)" in result
    assert f"From `{later}/eval.json` (`compared_to`, written by `mlmt eval --compare-to`)." in result


def test_without_a_pair_the_result_section_says_why(evals, run, tmp_path):
    from tosca_mlmt.pipelines.analyze import analyze

    run_dir, before, after = evals
    training_only = _result_section(analyze([str(run[0])], tmp_path / "a").report.read_text())
    assert "no eval folder (one holding an eval.json) among the inputs" in training_only
    assert "No held-out eval among the inputs: the training-batch accuracies below" in training_only
    alone = _result_section(analyze([str(after)], tmp_path / "b").report.read_text())
    assert f"one eval folder ({after}), run without --compare-to" in alone
    assert "Newest held-out eval (snapshot #0, " in alone and "Acc@final 0.700 [" in alone
    other = make_eval(tmp_path / "other", AFTER[:6], 4)  # six problems: not the same test set
    mixed = analyze([str(before), str(other)], tmp_path / "c").headline
    assert mixed.comparison is None and f"no earlier eval covers the problems of the newest, {other}" in mixed.note


def test_every_figure_says_what_its_points_are_and_nothing_pools_training_with_evals(evals, tmp_path):
    from tosca_mlmt.analysis.captions import titles
    from tosca_mlmt.pipelines.analyze import analyze

    run, before, after = evals
    res = analyze([str(run), str(before), str(after)], tmp_path / "out")
    t, md, page = res.tables, res.report.read_text(), res.html.read_text()
    data = ("Data: training batches (1 snapshot): turn 1 sampled at T = 0.7, on training problems; 10 episodes of 10 "
            "problems per point; held-out evals (2 snapshots): turn 1 greedy, on the held-out test split; 10 "
            "episodes of 10 problems per point.")
    # under the accuracy, correction, strategy, strategy-by-correctness and feedback-length figures
    assert md.count(f"_{data}") == 5
    assert data in page and "Learning is measured by the held-out evals" in page
    assert titles(t.sources) == {"training batch": "training batches: T = 0.7, n = 10 episodes/point",
                                 "held-out eval": "held-out evals: greedy, n = 10 episodes/point"}
    # no pooled matrix: the 2 x 2 grid is the newest eval's (AFTER: right->right 4, ->wrong 2; wrong->right 3, ->wrong 1)
    assert not hasattr(t, "correction_all") and "All snapshots" not in md and "pooled (n =" not in page
    eval_after = t.snapshots.loc[t.snapshots["source"] == "held-out eval", ["order", "snapshot"]].iloc[-1]
    assert (f"The newest held-out eval, #{eval_after['order']} `{eval_after['snapshot']}` (10 episodes):") in md
    assert "| turn 1 right | 4 (40.0%) | 2 (20.0%) |" in md and "| turn 1 wrong | 3 (30.0%) | 1 (10.0%) |" in md
    # feedback length: one row group per source, each summing that source's feedback turns only
    fl = t.feedback_length.groupby("source")["feedback_turns"].sum().to_dict()
    assert fl == {"training batch": 10, "held-out eval": 20}


def test_missing_values_are_a_dash_never_na(evals, tmp_path):
    """An eval snapshot has no PPO iteration: its cell is "–" in both reports."""
    from tosca_mlmt.pipelines.analyze import analyze

    run, before, after = evals
    res = analyze([str(run), str(before), str(after)], tmp_path / "out")
    md, page = res.report.read_text(), res.html.read_text()
    assert "<NA>" not in md and "&lt;NA&gt;" not in page and "<NA>" not in page
    assert not re.search(r"\|\s*(nan|NaN|None)\s*\|", md) and not re.search(r"<td>(nan|NaN|None)</td>", page)
    sid = json.loads((before / "eval.json").read_text())["snapshot_id"]
    row = next(ln for ln in md.splitlines() if ln.startswith("| ") and f"| {sid} |" in ln and "collect" in ln)
    assert row.split(" | ")[3] == "–"  # #, snapshot, created_at, iteration
    assert re.search(rf"<td>{sid}</td>\s*<td>[^<]+</td>\s*<td>–</td>", page)
