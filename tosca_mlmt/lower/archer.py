"""ArCHer's utterance-level critic for the solver (``lower.advantage: archer``).

Hierarchy in time: a critic over whole utterances (solver turns) and a token-level actor.
For turn k of a trajectory, with s_k the context before the turn and a_k the turn itself:
    Q_i(s_k, a_k) <- r_k + gamma (1 - d_k) min_j Vbar_j(s_{k+1})        (double Q, target V)
    V_i(s_k)      <- min_j Qbar_j(s_k, a_k)                              (target Q at the taken action)
    A_k = min_j Q_j(s_k, a_k) - min_j V_j(s_k)                           (the actor's advantage)
Q and V are linear heads on the solver trunk's hidden state (detached, so critic gradients never
move the actor's adapter): V reads the position before the turn's first token, Q its last token.
Targets are Polyak copies (tau). The advantage itself is the registered ``archer`` estimator
(algos/advantages.py). Shapes: B trajectories, K turns, H hidden size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from tosca_mlmt.tensors import onto


class UtteranceCritic(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.q = nn.Linear(hidden, 2)  # two Q heads
        self.v = nn.Linear(hidden, 2)  # two V heads
        for layer in (self.q, self.v):
            nn.init.normal_(layer.weight, std=1e-3)
            nn.init.zeros_(layer.bias)

    def forward(self, h_state: torch.Tensor, h_action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, K, H] x2 -> (Q [B, K, 2], V [B, K, 2]); host in, host out (tensors.onto)."""
        h_state, h_action = onto(self, h_state.float(), h_action.float())
        return self.q(h_action).cpu(), self.v(h_state).cpu()


def turn_features(hidden: torch.Tensor, spans: list[list[tuple[int, int]]], n_turns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, H] -> (state features [B, K, H] at start - 1, action features [B, K, H] at end - 1)."""
    B, _, H = hidden.shape
    hs = hidden.new_zeros(B, n_turns, H)
    ha = hidden.new_zeros(B, n_turns, H)
    for b, turns in enumerate(spans):
        for k, (s, e) in enumerate(turns):
            hs[b, k] = hidden[b, s - 1]
            ha[b, k] = hidden[b, e - 1]
    return hs, ha


@dataclass
class CriticTargets:
    """One batch's TD targets, fixed before the update (the target critic does not move within it)."""
    spans: list[list[tuple[int, int]]]  # each row's solver-turn spans, to read its features again
    y_q: torch.Tensor  # [B, K]
    y_v: torch.Tensor  # [B, K]
    valid: torch.Tensor  # [B, K] float

    def select(self, rows: torch.Tensor) -> "CriticTargets":
        return CriticTargets([self.spans[i] for i in rows.tolist()], self.y_q[rows], self.y_v[rows], self.valid[rows])


def evaluate(critic: UtteranceCritic, target: UtteranceCritic, features: tuple[torch.Tensor, torch.Tensor],
             turn_rewards: torch.Tensor, valid: torch.Tensor, spans: list[list[tuple[int, int]]], gamma: float
             ) -> tuple[torch.Tensor, torch.Tensor, CriticTargets]:
    """(Q, V) [B, K, 2] of the online critic for the advantage, and the targets its loss fits."""
    q, v = critic(*features)
    q_bar, v_bar = target(*features)
    y_q, y_v = critic_targets(turn_rewards, valid, q_bar, v_bar, gamma)
    return q, v, CriticTargets(spans, y_q, y_v, valid)


def loss_on(critic: UtteranceCritic, hidden: torch.Tensor, targets: CriticTargets, n_turns: int) -> torch.Tensor:
    """The critic's loss on a minibatch; ``hidden`` detached so the critic never moves the actor."""
    q, v = critic(*turn_features(hidden.detach(), targets.spans, n_turns))
    return critic_loss(q, v, targets.y_q, targets.y_v, targets.valid)


def critic_targets(turn_rewards: torch.Tensor, valid: torch.Tensor, q_bar: torch.Tensor, v_bar: torch.Tensor,
                   gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """turn_rewards, valid [B, K]; q_bar, v_bar [B, K, 2] from the target critic -> (y_q, y_v) [B, K].

    The last valid turn is terminal (d = 1)."""
    v_next = torch.zeros_like(turn_rewards)
    v_min = v_bar.min(-1).values
    v_next[:, :-1] = v_min[:, 1:] * valid[:, 1:]
    y_q = turn_rewards + gamma * v_next
    y_v = q_bar.min(-1).values
    return y_q * valid, y_v * valid


def critic_loss(q: torch.Tensor, v: torch.Tensor, y_q: torch.Tensor, y_v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    m = valid.unsqueeze(-1).float()
    n = m.sum().clamp(min=1.0) * 2
    return (((q - y_q.unsqueeze(-1)) ** 2 * m).sum() + ((v - y_v.unsqueeze(-1)) ** 2 * m).sum()) / n


def make_target(critic: UtteranceCritic) -> UtteranceCritic:
    target = copy.deepcopy(critic)
    for p in target.parameters():
        p.requires_grad_(False)
    return target
