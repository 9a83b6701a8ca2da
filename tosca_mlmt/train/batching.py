"""Turning logged turns into training tensors, and a model's log-probs of them.

Shapes: B = sequences, T = padded length (prompt + response), R = response length,
V = vocabulary, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tosca_mlmt.models.head import OutputHead
from tosca_mlmt.tensors import onto, pad_pairs, token_logprobs_from_hidden


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] right-padded prompt + response
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on tokens the policy generated (the response), else 0
    prompt_lens: list[int]
    response_lens: list[int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> TokenBatch:
    """Right-pad prompt+response; the loss mask covers exactly the response tokens.

    Only response ids are ever trained: prompt, feedback and template tokens sit in the
    prompt part and get mask 0 by construction."""
    ids, attn, mask = pad_pairs(prompts, responses, pad_id)
    return TokenBatch(ids, attn, mask, [len(p) for p in prompts], [len(r) for r in responses])


def forward_logprobs(model, batch: TokenBatch, chunk: int = 256, return_hidden: bool = False):
    """Log-probs [B, T] of ``batch``'s response tokens under ``model`` (a causal LM, possibly
    peft-wrapped); 0 on every other position (the loss mask's zeros).

    Runs the trunk once, then the LM head in chunks on the response positions only (see
    token_logprobs_from_hidden), on the model's device; takes and returns host tensors (tensors.onto)."""
    ids, attn = onto(model, batch.input_ids, batch.attention_mask)
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, T, H], final norm applied
    lp = token_logprobs_from_hidden(hidden, OutputHead(model), ids, chunk, keep=batch.loss_mask).cpu()
    return (lp, hidden.cpu()) if return_hidden else lp
