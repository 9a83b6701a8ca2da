"""Turning logged turns into training tensors, and log-probs that do not blow up memory.

Shapes: B = sequences, T = padded length (prompt + response), R = response length,
V = vocabulary, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tosca_mlmt.precision import fp32_logits


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
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
        mask[i, len(p) : len(s)] = 1.0
    return TokenBatch(ids, attn, mask, [len(p) for p in prompts], [len(r) for r in responses])


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head: torch.nn.Module, input_ids: torch.Tensor,
                               chunk: int = 256, with_entropy: bool = False):
    """log pi(x_t | x_<t) for t >= 1, computed from hidden states in chunks of positions.

    hidden [B, T, H] -> logprobs [B, T] (position 0 is 0: it has no context), and with
    ``with_entropy`` also the entropy [B, T] of pi(. | x_<t). Only one [B, chunk, V] logits
    block exists at a time, so memory does not scale with T x V; under grad each chunk is
    checkpointed so the backward pass keeps the same bound.
    """
    B, T, _ = hidden.shape
    lps = [hidden.new_zeros(B, 1, dtype=torch.float32)]
    ents = [hidden.new_zeros(B, 1, dtype=torch.float32)]
    targets = input_ids[:, 1:]
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        h, tgt = hidden[:, s:e], targets[:, s:e]
        if torch.is_grad_enabled() and h.requires_grad:
            lps.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h, tgt, lm_head, use_reentrant=False))
        elif with_entropy:
            logp = torch.log_softmax(fp32_logits(h, lm_head), dim=-1)
            lps.append(logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
            ents.append(-(logp.exp() * logp).sum(-1))
        else:
            lps.append(_chunk_logprobs(h, tgt, lm_head))
    lp = torch.cat(lps, dim=1)
    if with_entropy:
        return lp, (torch.cat(ents, dim=1) if len(ents) > 1 else torch.zeros_like(lp))
    return lp


def _chunk_logprobs(h: torch.Tensor, tgt: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    logits = fp32_logits(h, lm_head)  # [B, c, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)


def forward_logprobs(model, batch: TokenBatch, chunk: int = 256, return_hidden: bool = False):
    """Per-token log-probs [B, T] of ``batch`` under ``model`` (a causal LM, possibly peft-wrapped).

    Runs the trunk once, then the LM head in chunks (see token_logprobs_from_hidden)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, T, H], final norm applied
    lp = token_logprobs_from_hidden(hidden, base.get_output_embeddings(), batch.input_ids, chunk)
    return (lp, hidden) if return_hidden else lp


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)
