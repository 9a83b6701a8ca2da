"""tensors.token_logprobs_from_hidden: the chunked LM head against the full logits."""

import pytest
import torch

from tosca_mlmt.tensors import token_logprobs_from_hidden


@pytest.mark.parametrize("chunk", [2, 3, 64])
def test_chunked_logprobs_entropy_and_gradient_equal_the_full_logits(chunk):
    """Log-probs, entropy and the log-probs' gradient through the checkpointed chunks equal those of
    one log_softmax over all positions; the entropy (a diagnostic) carries no graph, and asking for
    it changes neither the log-probs nor their gradient (the backward's recompute skips it). fp32 throughout,
    on any CPU (no model, no autocast)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 7, 5, 11
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen, dtype=torch.float32))
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float32, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    full = torch.log_softmax(head(hidden), -1)  # [B, T, V]
    want = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_grad, = torch.autograd.grad(want.sum(), hidden)
    lp, ent = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk, with_entropy=True)
    torch.testing.assert_close(lp[:, 1:], want)
    assert bool((lp[:, 0] == 0).all()) and bool((ent[:, 0] == 0).all())
    torch.testing.assert_close(ent[:, 1:], -(full.exp() * full).sum(-1)[:, :-1].detach())
    assert not ent.requires_grad
    grad, = torch.autograd.grad(lp.sum(), hidden)
    torch.testing.assert_close(grad, want_grad)
    plain = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk)
    torch.testing.assert_close(plain, lp)
