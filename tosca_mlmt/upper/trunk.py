"""The writer LM as a feature extractor and text policy, and the adapter's target copy.

One forward over [writer prompt + logged feedback] yields both things the upper level
needs: the state features h(s) (the prompt's first ``state_len`` tokens *are* the state,
and a causal model's hidden state at position state_len - 1 only sees them) and the
log-probs of the feedback tokens. States alone go through ``writer_state_features``, the
reading collection's Q uses too.
"""

from __future__ import annotations

import contextlib

import torch

from tosca_mlmt.algos.qlearning import hard_update, polyak_update, target_due
from tosca_mlmt.models.features import writer_state_features
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.train.batching import build_batch, forward_logprobs


class WriterTrunk:
    def __init__(self, policies: PolicyPair, logprob_chunk: int = 256):
        self.policies = policies
        self.model = policies.model("writer")
        self.pad_id = policies.pad_id("writer")
        self.chunk = logprob_chunk
        # The writer adapter's LoRA tensors, in a fixed (name) order: optimizer and checkpoints rely on it.
        self.params = dict(sorted((n, p) for n, p in self.model.named_parameters() if ".writer." in n))
        base = self.model.get_base_model()
        self.hidden_size = base.config.hidden_size
        self.lm_head = base.get_output_embeddings()

    @contextlib.contextmanager
    def training(self):
        """Writer adapter active and trainable for the block; everything restored after."""
        flags = {n: p.requires_grad for n, p in self.params.items()}
        with self.policies.use("writer") as m:
            was_training = m.training
            m.train()  # only matters when LoRA dropout > 0 (global RNG, restored on resume)
            for p in self.params.values():
                p.requires_grad_(True)
            try:
                yield m
            finally:
                for n, p in self.params.items():
                    p.requires_grad_(flags[n])
                m.train(was_training)

    def full(self, prompts: list[list[int]], responses: list[list[int]], state_lens: list[int]):
        """h(s) [B, H], log pi of every token [B, T], feedback-token mask [B, T]."""
        batch = build_batch(prompts, responses, self.pad_id)
        logp, hidden = forward_logprobs(self.model, batch, chunk=self.chunk, return_hidden=True)
        h = hidden[torch.arange(len(prompts)), torch.tensor(state_lens) - 1]
        return h, logp, batch.loss_mask

    def states(self, states: list[list[int]], params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """h(s) [B, H] of state prompts in one forward; ``params`` swaps in other adapter tensors
        (the target adapter) for this call only."""
        return writer_state_features(self.model, states, self.pad_id, params=params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = set(self.params) ^ set(sd)
        if missing:
            raise ValueError(f"writer adapter tensors differ from the checkpoint: {sorted(missing)[:3]} ...")
        for n, p in self.params.items():
            p.copy_(sd[n])


class TargetAdapter:
    """A frozen copy of the writer adapter (q_source=logits: there Q lives in the adapter)."""

    def __init__(self, trunk: WriterTrunk, mode: str, tau: float, sync_every: int):
        self.trunk, self.mode, self.tau, self.sync_every = trunk, mode, tau, sync_every
        self.params = trunk.state_dict()

    def features(self, states: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return self.trunk.states(states, params=self.params)

    def update(self, step: int) -> bool:
        if not target_due(step, self.mode, self.sync_every):
            return False
        names = list(self.params)
        online = [self.trunk.params[n] for n in names]
        if self.mode == "polyak":
            polyak_update([self.params[n] for n in names], online, self.tau)
        else:
            hard_update([self.params[n] for n in names], online)
        return True
