"""Tensor helpers shared by the RL math, the models and the trainers.

Ground floor: imports nothing of ours. Shapes: B = sequences, T = padded length, V =
vocabulary, H = hidden size.
"""

from __future__ import annotations

import functools

import torch


def device_of(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: the device of its first parameter (or buffer); CPU for none."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def onto(module: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``module``'s device (no copy where they are there already).

    Device rule of the package: batches, advantages and every loss term are built on the host;
    each model or head call moves its inputs onto the module's device (``onto``) and its
    results back (``.cpu()``, which autograd differentiates across devices). On a CPU run both
    are no-ops; on a GPU run the trunk, its LM head and the heads compute on the GPU."""
    dev = device_of(module)
    return tuple(t.to(dev) for t in tensors)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1; an empty mask gives 0, not NaN."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def pad_batch(seqs: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [B, T], attention mask [B, T]), both long, T the longest length.

    Right padding for training and scoring (token t of every row sits at position t); left
    padding for generation (every prompt's last token sits at the same, final position)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        attn[i, cols] = 1
    return ids, attn


def pad_pairs(prompts: list[list[int]], responses: list[list[int]],
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + response rows, right-padded: (ids [B, T], attention mask [B, T], response mask [B, T]),
    the last float32 and 1 on exactly the response tokens (prompt, feedback and template ids sit in
    the prompt part)."""
    ids, attn = pad_batch([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, len(p): len(p) + len(r)] = 1.0
    return ids, attn, mask


def fp32_logits(hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """LM-head logits [..., V] computed in fp32 whatever the model or autocast dtype.

    bf16 logits of magnitude 16-32 are spaced 0.125 apart, so a bf16 head puts ~0.06 nats of
    rounding into every log-prob: enough to make PPO ratios of an unchanged policy differ from 1
    and to swamp a context bonus. The head is one matmul; doing it in fp32 costs little."""
    w = lm_head.weight
    b = getattr(lm_head, "bias", None)
    post = getattr(lm_head, "post", None)  # models.head.OutputHead: what the model's forward does next
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.float(), w.float(), None if b is None else b.float())
        return logits if post is None else post(logits)


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head: torch.nn.Module, input_ids: torch.Tensor,
                               chunk: int = 256, with_entropy: bool = False, keep: torch.Tensor | None = None,
                               temperature: float = 1.0):
    """log pi(x_t | x_<t) for t >= 1, computed from hidden states in chunks of positions.

    hidden [B, T, H] -> logprobs [B, T] (position 0 is 0: it has no context), and with
    ``with_entropy`` also the entropy [B, T] of pi(. | x_<t). With ``keep`` [B, T] (bool or 0/1)
    only the kept positions are computed and the others are 0: a PPO batch reads its action tokens
    alone (the loss mask), a minority of a three-turn sequence's positions, whose prompts and
    feedback then cost no LM head, log-softmax or entropy over the vocabulary (TRL keeps only
    completion logits for the same reason). At most B x ``chunk`` positions' logits exist at a time,
    so memory does not scale with T x V; under grad each chunk is checkpointed so the backward pass
    keeps the same bound. ``temperature``: of softmax(logits / temperature), the distribution a
    sampler at that temperature draws from (1 = the model's own).
    """
    B, T, _ = hidden.shape
    sel = (torch.ones(B, T - 1, dtype=torch.bool, device=hidden.device) if keep is None
           else keep[:, 1:].to(device=hidden.device, dtype=torch.bool))  # [B, T-1]
    h_all, tgt_all = hidden[:, :-1][sel], input_ids[:, 1:].to(hidden.device)[sel]  # [N, H], [N]
    rows = max(1, B * chunk)
    lps, ents = [], []
    for s in range(0, h_all.shape[0], rows):
        h, tgt = h_all[s: s + rows], tgt_all[s: s + rows]
        out: list | None = [] if with_entropy else None
        fn = functools.partial(_chunk_logprobs, entropy_out=out, temperature=temperature)
        if torch.is_grad_enabled() and h.requires_grad:
            lps.append(torch.utils.checkpoint.checkpoint(fn, h, tgt, lm_head, use_reentrant=False))
        else:
            lps.append(fn(h, tgt, lm_head))
        if with_entropy:
            ents.append(out[0])

    def place(parts: list[torch.Tensor]) -> torch.Tensor:  # [N] -> [B, T], 0 where not computed
        flat = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
        body = hidden.new_zeros(B, T - 1, dtype=torch.float32).masked_scatter(sel, flat)
        return torch.cat([hidden.new_zeros(B, 1, dtype=torch.float32), body], dim=1)

    lp = place(lps)
    return (lp, place(ents)) if with_entropy else lp


def _chunk_logprobs(h: torch.Tensor, tgt: torch.Tensor, lm_head: torch.nn.Module,
                    entropy_out: list | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [N] of the targets of N positions (with grad). With ``entropy_out``, the first call
    also appends the entropy [N] of pi, without grad: a diagnostic. A checkpointed chunk runs again in the
    backward pass, and that run skips it (two more passes over [N, V] that nothing reads)."""
    logits = fp32_logits(h, lm_head)  # [N, V]
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    if entropy_out is not None and not entropy_out:
        with torch.no_grad():
            entropy_out.append(-(logp.exp() * logp).sum(-1))
    return logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
