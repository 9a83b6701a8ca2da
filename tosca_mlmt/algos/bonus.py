"""The context-dependency (KL-maximization) bonus of a refine, as a pure function.

For a refine y that followed feedback g after a first answer z (x: the problem):

    d_t   = log pi(y_t | x, z, g, y_<t) - log pi(y_t | x, z, y_<t)        per refine token t
    token:     b_t = lambda * gate * clip(d_t, -c, c)
    sequence:  b_t = lambda * gate * clip(D, -c, c)  on every token,  D = sum_t d_t or mean_t d_t

d measures how much y depends on g. Ungated (``gate = none``) it rewards departing from z
whatever the outcome: without g the solver mostly repeats z, so a refine that throws a right
answer away scores the largest d. The gates tie the sign to the outcome:
    improvement     gate = r(y) - r(z): + when following g fixed an error, - when it broke a
                    right answer, 0 when the outcome did not change;
    advantage_sign  gate = sign(A) of the refine turn under the advantage estimator.
The bonus is added to the refine tokens' *advantages* after the estimator has normalized the
verifier returns, so it never changes a group's normalization and never reaches turn 1.

Shapes: N refines, L = longest refine; padded positions carry mask 0.
"""

from __future__ import annotations

from typing import Callable

import torch

from tosca_mlmt.algos import registrar

GATES: dict[str, Callable] = {}
register_gate = registrar(GATES)

TRANSITIONS = {(1, 1): "right_to_right", (1, 0): "right_to_wrong", (0, 1): "wrong_to_right", (0, 0): "wrong_to_wrong"}


@register_gate("none")
def no_gate(r_prev: torch.Tensor, r_this: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """[N] -> [N] ones: today's ungated bonus, kept for the ablation."""
    return torch.ones_like(r_this)


@register_gate("improvement")
def improvement_gate(r_prev: torch.Tensor, r_this: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """[N] -> [N] r(y) - r(z)."""
    return r_this - r_prev


@register_gate("advantage_sign")
def advantage_sign_gate(r_prev: torch.Tensor, r_this: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """[N] -> [N] sign of the refine turn's advantage (0 where it is 0)."""
    return torch.sign(adv)


def context_bonus(lp_with: torch.Tensor, lp_without: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor,
                  coef: float, clip: float, level: str = "sequence", reduce: str = "mean"
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """lp_with, lp_without, mask: [N, L]; gate: [N] -> (bonus [N, L], stats).

    stats: ``raw`` [N] the unclipped term per refine (D for sequence, mean d_t for token),
    ``clipped`` [N] the share of clipped terms per refine, ``total`` [N] the bonus summed
    over the refine's tokens."""
    d = (lp_with - lp_without) * mask  # [N, L]
    n_tok = mask.sum(1).clamp(min=1.0)  # [N]
    if level == "token":
        terms = d.clamp(-clip, clip)
        bonus = coef * gate[:, None] * terms * mask
        raw = d.sum(1) / n_tok
        clipped = ((d.abs() > clip).float() * mask).sum(1) / n_tok
    elif level == "sequence":
        D = d.sum(1) if reduce == "sum" else d.sum(1) / n_tok  # [N]
        bonus = coef * gate[:, None] * D.clamp(-clip, clip)[:, None] * mask
        raw = D
        clipped = (D.abs() > clip).float()
    else:
        raise ValueError(f"level must be token or sequence, not {level!r}")
    return bonus, {"raw": raw, "clipped": clipped, "total": bonus.sum(1)}


def transition_names(r_prev: torch.Tensor, r_this: torch.Tensor) -> list[str]:
    """[N], [N] rewards -> the correction each refine made (rewards > 0.5 count as right)."""
    return [TRANSITIONS[(int(a > 0.5), int(b > 0.5))] for a, b in zip(r_prev.tolist(), r_this.tolist())]
