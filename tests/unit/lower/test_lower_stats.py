"""A train-lower iteration's metrics row (lower/stats.py): the refine groups' own statistics. No model."""

import pytest

from tosca_mlmt.lower.stats import LowerIteration, UpdateStats, iteration_metrics


def _iteration(turn_rewards, attempts=()):
    return LowerIteration(step=1, summary={}, update=UpdateStats({"train_tokens": 0}, False), turn_rewards=turn_rewards,
                          problem_ids=("p",) * len(turn_rewards), seconds={}, wall_seconds=1.0, gen_tokens=0,
                          attempts=attempts)


def test_refine_groups_log_the_spread_of_each_attempts_refines():
    # attempt a: refines 1, 0 (spread 0.5); attempt b: 0, 0 (tie: no refine gradient)
    turns = ((0.0, 1.0), (0.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    row = iteration_metrics(_iteration(turns, attempts=(("p", 0), ("p", 0), ("p", 4), ("p", 4))))
    assert row["lower/refine_group_frac_reward_zero_std"] == pytest.approx(0.5)
    assert row["lower/refine_group_reward_std"] == pytest.approx(0.25)
    # the problem's group is unchanged: the four returns 1, 0, 1, 1
    assert row["lower/frac_reward_zero_std"] == 0.0
    assert not any(k.startswith("lower/refine_group") for k in iteration_metrics(_iteration(turns)))
