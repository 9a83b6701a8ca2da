"""`mlmt eval --compare-to`: before/after on the same problems, from hand-made eval folders. No model."""

import json

import pytest
from factories import patterned_episode

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.pipelines.evaluate import compare_outcomes, eval_outcomes
from tosca_mlmt.store import write_snapshot

R, W = True, False


def compare_evals(a, b):
    return compare_outcomes(eval_outcomes(a), eval_outcomes(b), a)


def make_eval(folder, patterns, env="honest", prefix="t"):
    eps = [patterned_episode(i, p, ["verify"], [4], prefix) for i, p in enumerate(patterns)]
    sid, _ = write_snapshot(folder / "snapshots", list(reversed(eps)), {"kind": "eval"})  # order must not matter
    (folder / "eval.json").write_text(json.dumps({"snapshot_id": sid, "environment": env}))
    return folder


def test_before_after_counts_and_intervals(tmp_path):
    before = [(R, R), (R, W), (W, W), (W, W), (W, R), (R, R)]  # final: 1 0 0 0 1 1
    after = [(R, R), (R, R), (W, R), (W, R), (W, W), (R, R)]   # final: 1 1 1 1 0 1
    a, b = make_eval(tmp_path / "a", before), make_eval(tmp_path / "b", after)
    assert eval_outcomes(a)["final"] == [1, 0, 0, 0, 1, 1]  # sorted by problem id, not file order
    c = compare_evals(a, b)
    assert c["problems"] == 6
    assert c["before_acc_final"]["mean"] == pytest.approx(3 / 6) and c["after_acc_final"]["mean"] == pytest.approx(5 / 6)
    assert c["before_acc_t1"]["mean"] == pytest.approx(3 / 6)
    assert c["final_difference"]["mean"] == pytest.approx(2 / 6)
    assert c["final_difference"]["lo"] <= 2 / 6 <= c["final_difference"]["hi"]
    # discordant pairs: problems 1, 2, 3 fixed; problem 4 lost -> exact p = 2 * P(Bin(4, .5) <= 1) = 0.625
    assert (c["final_mcnemar"]["a_only"], c["final_mcnemar"]["b_only"]) == (3, 1)
    assert c["final_mcnemar"]["p"] == pytest.approx(0.625)
    lo, hi = c["after_acc_final"]["lo"], c["after_acc_final"]["hi"]
    assert 0 < lo < 5 / 6 < hi < 1


def test_evals_on_different_problems_are_refused(tmp_path):
    a = make_eval(tmp_path / "a", [(R, R), (W, W)])
    b = make_eval(tmp_path / "b", [(R, R), (W, W), (W, R)])
    with pytest.raises(ConfigError, match="problems differ"):
        compare_evals(a, b)
    with pytest.raises(ConfigError, match="not an eval folder"):
        compare_evals(tmp_path / "missing", b)
