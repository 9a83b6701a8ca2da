"""Forward passes of the solver for PPO: the training forward, and the no-grad scoring of a
batch before its update (old, reference and no-feedback log-probs), sharded over the ranks.

Each rank scores its share of the rows and every rank gets the whole batch back, so the
advantages, the bonus and the minibatch order are the same everywhere. Shapes: B rows,
T tokens, K solver turns, H hidden size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tosca_mlmt import parallel as dist
from tosca_mlmt.lower import archer
from tosca_mlmt.lower.trajectory import SolverTrajectory, TrajectoryTensors, no_feedback_sequences
from tosca_mlmt.models.head import OutputHead
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.precision import use_bf16_autocast
from tosca_mlmt.tensors import onto, token_logprobs_from_hidden
from tosca_mlmt.train.batching import build_batch

if TYPE_CHECKING:
    from tosca_mlmt.config import LowerConfig


@dataclass
class Forward:
    logprobs: torch.Tensor  # [B, T]; position 0 is 0 (no context)
    values: torch.Tensor | None  # [B, T] when asked for
    entropy: torch.Tensor | None  # [B, T] when asked for
    hidden: torch.Tensor  # [B, T, H] last hidden states on the model's device (the utterance critic reads
    # K turn positions of them: only those [B, K, H] cross to the host, never the whole [B, T, H])


@dataclass
class Scores:
    """What the update needs from the models before it starts; every rank holds all B rows."""
    old_logprobs: torch.Tensor | None  # [B, T] pi_old (the engine's own on action tokens with old_logprobs=behaviour);
    # None when the pass was skipped for every row: pi_old is pi_theta at the loss (old_logprobs=auto)
    entropy: torch.Tensor | None  # [B, T] of pi_old; None when skipped (the training forward logs it)
    old_values: torch.Tensor | None  # [B, T] value head, for estimators that need values
    ref_logprobs: torch.Tensor | None  # [B, T] adapters off; when KL, SCoRe or a reference bonus needs them
    turn_features: tuple[torch.Tensor, torch.Tensor] | None  # (state, action) [B, K, H] for the critic
    # [B, T] the trainer's own forward: old_logprobs but for old_logprobs=behaviour. The trainer-scored
    # bonus reads it, since its no-feedback term is the trainer's too: log pi_b(y|x,z,g) - log pi(y|x,z)
    # would measure how far the policy drifted since sampling, not what g changed.
    trainer_logprobs: torch.Tensor | None = None
    # [B] rows the pi_old pass skipped because the first minibatch's forward runs with the weights
    # that sampled (LowerLearner.current_rows): 0 in old_logprobs, entropy and trainer_logprobs there,
    # and the loss reads pi_theta detached instead. None: every row was scored
    old_current: torch.Tensor | None = None

    def scored_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [B, T] cut to the rows the pi_old pass scored: the pre-update diagnostics' rows."""
        return mask if self.old_current is None else mask * (~self.old_current)[:, None]


@dataclass
class RefineScores:
    """log pi(y | x, z) of every refine with its feedback g cut out of the context."""
    where: list[tuple[int, int]]  # (row, turn) of each refine
    logprobs: list[torch.Tensor]  # [len(y)] per refine


class SolverScorer:
    def __init__(self, lo: "LowerConfig", policies: PolicyPair, value_head: nn.Module, temperature: float = 1.0):
        """``temperature``: every log-prob is of softmax(logits / temperature) (lower.logprob_temperature)."""
        self.lo, self.policies, self.value_head = lo, policies, value_head
        self.temperature = temperature
        self.model = policies.model("solver")
        self.use_bf16 = use_bf16_autocast(lo.autocast)
        self.pad_id = policies.tokenizer("solver").pad_token_id or 0

    def _autocast(self):
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, values: bool = False, reference: bool = False,
                entropy: bool = False, keep: torch.Tensor | None = None) -> Forward:
        """Under the solver, or with ``reference`` the same base with every adapter disabled; with
        ``keep`` [B, T] log-probs and entropy only where it is nonzero (0 elsewhere): the action
        tokens, all that the loss, the KL and the bonus read. Takes and returns host tensors, except
        ``hidden``; the forwards run on the model's device (tensors.onto)."""
        ctx = self.model.disable_adapter() if reference else self.policies.use("solver")
        ids, attn = onto(self.model, ids, attn)
        with ctx, self._autocast():
            # logits_to_keep=1: the LM head runs in chunks below, never over [B, T, V] at once
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1]
            head = OutputHead(self.model)
            res = token_logprobs_from_hidden(hidden, head, ids, self.lo.logprob_chunk, with_entropy=entropy,
                                              keep=keep, temperature=self.temperature)
        lp, ent = res if entropy else (res, None)
        v = None
        if values:
            # V for action token t is read from the state before it, i.e. hidden position t - 1
            v = self.value_head(*onto(self.value_head, hidden[:, :-1].float())).squeeze(-1).cpu()
            v = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
        return Forward(lp.cpu(), v, None if ent is None else ent.cpu(), hidden)

    def _chunks(self, rows: list[int]) -> list[list[int]]:
        n = self.lo.score_batch or len(rows)
        return [rows[i: i + n] for i in range(0, len(rows), n)]

    @torch.no_grad()
    def _sharded(self, tt: TrajectoryTensors, trajs: list[SolverTrajectory], rows: list[int], values=False,
                 reference=False, entropy=False, features=False) -> list[torch.Tensor | None]:
        """[logprobs, values, entropy, h_state, h_action] of ``rows`` (all B rows back, 0 in the
        others), each rank scoring its shard of them."""
        chunks = []
        for c in self._chunks([rows[i] for i in dist.shard(len(rows))]):
            f = self.forward(tt.input_ids[c], tt.attention_mask[c], values=values, reference=reference,
                             entropy=entropy, keep=tt.mask[c])
            # the hidden states are dropped chunk by chunk: only the K turn positions are kept
            hs, ha = (tuple(x.cpu() for x in archer.turn_features(f.hidden, [trajs[i].turn_spans for i in c],
                                                                    tt.n_turns))
                      if features else (None, None))
            chunks.append((f.logprobs, f.values, f.entropy, hs, ha))
        part = tuple(_cat(chunks, i) for i in range(5)) if chunks else None
        parts = [q for q in dist.gather(part) if q is not None]
        return [_spread(_cat(parts, i), rows, tt.input_ids.shape[0]) for i in range(5)]

    def needs_reference(self) -> bool:
        lo = self.lo
        return lo.kl_coef > 0 or lo.score.enabled or lo.bonus.model == "reference"

    @torch.no_grad()
    def score(self, tt: TrajectoryTensors, trajs: list[SolverTrajectory], values: bool, features: bool,
              current: list[int] = ()) -> Scores:
        """``current``: rows whose pi_old is pi_theta when the loss runs and that nothing else reads
        the pass of, so their pi_old forward is skipped (the caller decides; see
        LowerLearner.current_rows); all B rows: no forward at all. The reference scores every row."""
        lo, n = self.lo, tt.input_ids.shape[0]
        skip = set(current)
        if len(skip) == n:
            return Scores(None, None, None, None, None)
        rows = [i for i in range(n) if i not in skip]
        own, v, ent, hs, ha = self._sharded(tt, trajs, rows, values=values, entropy=True, features=features)
        lp = torch.where(tt.mask > 0, tt.behaviour_logprobs, own) if lo.old_logprobs == "behaviour" else own
        ref = self._sharded(tt, trajs, list(range(n)), reference=True)[0] if self.needs_reference() else None
        on_current = torch.tensor([i in skip for i in range(n)]) if skip else None
        return Scores(lp, ent, v, ref, (hs, ha) if features else None, own, on_current)

    @torch.no_grad()
    def without_feedback(self, trajs: list[SolverTrajectory], reference: bool, engine=None) -> RefineScores:
        """By the trainer's forwards, or with ``engine`` (lower.bonus.scorer=engine) by the rollout
        engine's teacher-forced scoring; each rank scores its share either way."""
        prompts, responses, where = no_feedback_sequences(trajs)
        if not where:  # every rank sees the same trajectories, so all skip the collective alike
            return RefineScores([], [])
        if engine is not None:
            mine = dist.shard(len(where))
            scored = engine.score([prompts[i] for i in mine], [responses[i] for i in mine], "solver") if mine else []
            return RefineScores(where, dist.gather_sharded([torch.tensor(x) for x in scored], len(where)))
        local = []
        for c in self._chunks(dist.shard(len(where))):
            batch = build_batch([prompts[i] for i in c], [responses[i] for i in c], self.pad_id)
            lp = self.forward(batch.input_ids, batch.attention_mask, reference=reference,
                              keep=batch.loss_mask).logprobs
            local += [lp[j, p: p + len(responses[i])] for j, (i, p) in enumerate(zip(c, batch.prompt_lens))]
        return RefineScores(where, dist.gather_sharded(local, len(where)))


def _cat(parts: list[tuple], i: int) -> torch.Tensor | None:
    return None if parts[0][i] is None else torch.cat([q[i] for q in parts])


def _spread(x: torch.Tensor | None, rows: list[int], n: int) -> torch.Tensor | None:
    """``x`` [len(rows), ...] placed at ``rows`` of an [n, ...] tensor of zeros."""
    if x is None or len(rows) == n:
        return x
    out = x.new_zeros((n, *x.shape[1:]))
    out[torch.as_tensor(rows, dtype=torch.long)] = x
    return out
