"""The summary's strategy shares after right and after wrong attempts (tosca_mlmt/metrics.py)."""

import math

from tosca_mlmt.metrics import strategy_shares, summarize
from tosca_mlmt.records import Episode, Turn
from tosca_mlmt.tasks.base import Problem


def _episode(i: int, attempts: list[bool], strategies: list[str]) -> Episode:
    """Solve, then one feedback + refine per strategy; ``attempts[k]`` is whether solver turn k was right."""
    p = Problem("arith", f"p{i}", "What is 7 + 8?", "15", "train", {})
    ep = Episode(f"p{i}/s0", p, 0)

    def solver(k):
        ok = attempts[k]
        return Turn(2 * k, k, "solver", "solve" if k == 0 else "refine", [1], [2], [-0.1], "stop",
                    "15" if ok else "14", reward=float(ok), correct=ok, extracted="15" if ok else "14")

    ep.turns = [solver(0)]
    for k, name in enumerate(strategies, start=1):
        ep.turns += [Turn(2 * k - 1, k, "writer", "feedback", [1], [2], [-0.1], "stop", "g", strategy=0,
                          strategy_name=name), solver(k)]
    return ep


def test_each_feedback_is_counted_after_the_attempt_it_answered():
    eps = [_episode(0, [True, True], ["say_right"]),
           _episode(1, [True, False], ["say_wrong"]),
           _episode(2, [False, False], ["say_wrong"]),
           # two rounds: round 2's feedback answers the refine of round 1 (right), not the first attempt
           _episode(3, [False, True, True], ["say_wrong", "say_right"])]
    s = strategy_shares(eps)
    # after right: say_right (ep 0), say_wrong (ep 1), say_right (ep 3, round 2) -> 2/3 and 1/3
    assert math.isclose(s["strategy_share/say_right/after_right"], 2 / 3)
    assert math.isclose(s["strategy_share/say_wrong/after_right"], 1 / 3)
    # after wrong: say_wrong (ep 2), say_wrong (ep 3, round 1)
    assert s["strategy_share/say_wrong/after_wrong"] == 1.0 and s["strategy_share/say_right/after_wrong"] == 0.0
    assert summarize(eps)["strategy_share/say_right/after_right"] == s["strategy_share/say_right/after_right"]


def test_no_attempt_of_a_kind_gives_nan_and_no_feedback_gives_nothing():
    s = strategy_shares([_episode(0, [False, True], ["a"])])
    assert s["strategy_share/a/after_wrong"] == 1.0 and math.isnan(s["strategy_share/a/after_right"])
    assert strategy_shares([_episode(1, [True], [])]) == {}
