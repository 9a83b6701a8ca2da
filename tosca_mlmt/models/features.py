"""The writer's state features h(s): one reading for collection and for training.

h(s) is the writer's final-layer hidden state at the last token of the state prompt. The Q that
picks a strategy at collection (``PolicyPair.q_values``) and the Q the upper learner fits
(``WriterTrunk.states``) both read it here, so they are one function of the same numbers.

Right padding: token t of every row sits at position t, as in a forward over the state alone, and
a causal model's hidden state at the last real token never sees the pads after it. (Left padding
shifts every position of a row; under RoPE that changes h(s) only by float rounding, but it is a
different rounding from the trainer's, and the two must agree exactly.)
"""

from __future__ import annotations

import torch
from torch import nn

from tosca_mlmt.tensors import onto, pad_batch


def writer_state_features(model: nn.Module, states: list[list[int]], pad_id: int,
                          params: dict[str, torch.Tensor] | None = None,
                          batch_size: int | None = None) -> torch.Tensor:
    """h(s) [B, H] of state prompts given as token ids, ``batch_size`` states per forward (all at
    once by default). ``params`` swaps in other tensors (the target adapter) for this call only.
    Runs whatever adapter is active and keeps the caller's grad mode."""
    step = batch_size or len(states)
    out = []
    for i in range(0, len(states), step):
        chunk = states[i:i + step]
        ids, attn = onto(model, *pad_batch(chunk, pad_id))
        kw = dict(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1)
        if params is None:
            hidden = model(**kw).hidden_states[-1]
        else:
            hidden = torch.func.functional_call(model, params, args=(), kwargs=kw).hidden_states[-1]
        out.append(hidden[torch.arange(len(chunk), device=hidden.device), attn.sum(1) - 1].cpu())
    return out[0] if len(out) == 1 else torch.cat(out)
