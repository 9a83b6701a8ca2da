"""The context-dependency bonus (algos/bonus.py) on hand-made log-probs: golden values, gate signs."""

import pytest
import torch

from tosca_mlmt.algos.bonus import GATES, context_bonus, transition_names

# Two refines: the first 3 tokens long, the second 2 (its third slot is padding).
LP_WITH = torch.tensor([[-0.5, -1.0, -0.2], [-2.0, -0.1, -9.0]])
LP_WITHOUT = torch.tensor([[-1.5, -1.2, -3.2], [-1.0, -0.1, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# d = with - without = [[1.0, 0.2, 3.0], [-1.0, 0.0, (pad)]]


def test_token_level_clips_each_term_and_ignores_padding():
    b, st = context_bonus(LP_WITH, LP_WITHOUT, MASK, torch.ones(2), coef=0.5, clip=2.0, level="token")
    torch.testing.assert_close(b, torch.tensor([[0.5, 0.1, 1.0], [-0.5, 0.0, 0.0]]))
    torch.testing.assert_close(st["clipped"], torch.tensor([1 / 3, 0.0]))
    torch.testing.assert_close(st["total"], torch.tensor([1.6, -0.5]))


@pytest.mark.parametrize("reduce, D", [("sum", [4.2, -1.0]), ("mean", [1.4, -0.5])])
def test_sequence_level_spreads_one_clipped_term_over_the_refine(reduce, D):
    b, st = context_bonus(LP_WITH, LP_WITHOUT, MASK, torch.ones(2), coef=0.5, clip=2.0, level="sequence",
                          reduce=reduce)
    c = [min(D[0], 2.0), max(D[1], -2.0)]
    torch.testing.assert_close(b, torch.tensor([[0.5 * c[0]] * 3, [0.5 * c[1]] * 2 + [0.0]]))
    torch.testing.assert_close(st["raw"], torch.tensor(D))
    assert st["clipped"].tolist() == [float(abs(D[0]) > 2.0), 0.0]


def test_improvement_gate_signs_follow_the_correction():
    # refine 0 departs from z (d > 0) and broke a right answer; refine 1 departs and fixed a wrong one;
    # refine 2 departs but the outcome did not change
    lp_with, lp_without = torch.tensor([[0.0, 0.0]] * 3), torch.tensor([[-1.0, -1.0]] * 3)
    r_prev, r_this = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])
    gate = GATES["improvement"](r_prev, r_this, torch.zeros(3))
    b, _ = context_bonus(lp_with, lp_without, torch.ones(3, 2), gate, coef=1.0, clip=5.0)
    assert b[0].tolist() == [-1.0, -1.0] and b[1].tolist() == [1.0, 1.0] and b[2].tolist() == [0.0, 0.0]
    ungated, _ = context_bonus(lp_with, lp_without, torch.ones(3, 2), GATES["none"](r_prev, r_this, None),
                               coef=1.0, clip=5.0)
    assert (ungated > 0).all()  # the old form pays right->wrong as much as wrong->right
    assert transition_names(r_prev, r_this) == ["right_to_wrong", "wrong_to_right", "right_to_right"]


def test_advantage_sign_gate():
    assert GATES["advantage_sign"](None, None, torch.tensor([-0.3, 0.0, 2.0])).tolist() == [-1.0, 0.0, 1.0]
