"""tensors.token_logprobs_from_hidden: the chunked LM head (all positions, or the kept ones) against the full logits."""

import pytest
import torch

from tosca_mlmt.tensors import token_logprobs_from_hidden


@pytest.mark.parametrize("chunk,temperature", [(2, 1.0), (3, 1.0), (64, 1.0), (3, 0.7)])
def test_chunked_logprobs_entropy_and_gradient_equal_the_full_logits(chunk, temperature):
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
    full = torch.log_softmax(head(hidden) / temperature, -1)  # [B, T, V]: the distribution sampled at T
    want = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_grad, = torch.autograd.grad(want.sum(), hidden)
    lp, ent = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk, with_entropy=True, temperature=temperature)
    torch.testing.assert_close(lp[:, 1:], want)
    assert bool((lp[:, 0] == 0).all()) and bool((ent[:, 0] == 0).all())
    torch.testing.assert_close(ent[:, 1:], -(full.exp() * full).sum(-1)[:, :-1].detach())
    assert not ent.requires_grad
    grad, = torch.autograd.grad(lp.sum(), hidden)
    torch.testing.assert_close(grad, want_grad)
    plain = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk, temperature=temperature)
    torch.testing.assert_close(plain, lp)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_kept_positions_equal_the_full_logits_there_and_are_zero_elsewhere(chunk):
    """keep= (the loss mask): the head runs on the kept positions alone. Their log-probs, entropy and
    gradient equal one log_softmax over all positions; every other position is 0 with no gradient
    into its hidden state; position 0 is 0 even when kept (it has no context); a mask that keeps
    nothing gives zeros. fp32, any CPU."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, V = 3, 9, 5, 13
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen, dtype=torch.float32))
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float32, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    keep = torch.zeros(B, T)
    keep[0, 0:4] = 1.0  # position 0 kept: still 0
    keep[1, 5:9] = 1.0
    keep[2, 2:3] = 1.0
    full = torch.log_softmax(head(hidden), -1)  # [B, T, V]
    want = torch.zeros(B, T)
    want[:, 1:] = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = want * keep
    want[:, 0] = 0.0
    want_ent = torch.zeros(B, T)
    want_ent[:, 1:] = -(full.exp() * full).sum(-1)[:, :-1].detach()
    want_ent = want_ent * keep
    want_ent[:, 0] = 0.0
    want_grad, = torch.autograd.grad(want.sum(), hidden)
    lp, ent = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk, with_entropy=True, keep=keep)
    torch.testing.assert_close(lp, want)
    torch.testing.assert_close(ent, want_ent)
    dense = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk)
    torch.testing.assert_close(lp[keep > 0], dense[keep > 0])
    grad, = torch.autograd.grad(lp.sum(), hidden)
    torch.testing.assert_close(grad, want_grad)
    # the hidden state before each unkept position gets no gradient at all
    unread = torch.ones(B, T, dtype=torch.bool)
    unread[:, :-1] = keep[:, 1:] == 0
    assert bool((grad[unread] == 0).all()) and bool((grad[~unread].abs().sum(-1) > 0).all())
    none = token_logprobs_from_hidden(hidden, head, ids, chunk=chunk, keep=torch.zeros(B, T))
    assert none.shape == (B, T) and bool((none == 0).all())


def test_onto_moves_inputs_to_the_module_device_and_leaves_host_tensors_alone():
    """The device rule (tensors.onto): a call's inputs go to the module's device. A module on the
    meta device stands in for a GPU here; a CPU module gets the very same tensor objects back."""
    from tosca_mlmt.tensors import device_of, onto

    x = torch.arange(6.0).view(2, 3)
    cpu = torch.nn.Linear(3, 2)
    assert device_of(cpu).type == "cpu" and onto(cpu, x)[0] is x
    far = torch.nn.Linear(3, 2, device="meta")
    moved, ids = onto(far, x, torch.tensor([1, 2]))
    assert moved.device.type == "meta" and ids.device.type == "meta" and moved.shape == x.shape
    buffers_only = torch.nn.Module()
    buffers_only.register_buffer("b", torch.zeros(1, device="meta"))
    assert device_of(buffers_only).type == "meta"
    assert device_of(torch.nn.Module()).type == "cpu"


def test_compute_device_is_the_local_rank_gpu_where_cuda_is_visible(monkeypatch):
    from tosca_mlmt import parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.compute_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert parallel.compute_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    assert parallel.compute_device() == torch.device("cuda", 0)


def test_nccl_group_is_bound_to_the_local_rank_gpu(monkeypatch):
    """Under NCCL the group names its device (no guess from the global rank, which the first GPU
    run warned can hang); gloo gets no device."""
    import torch.distributed as dist

    from tosca_mlmt import parallel

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "5")
    parallel.init()
    assert calls[0] == ("set_device", 5)
    assert calls[1][0] == "nccl" and calls[1][1]["device_id"] == torch.device("cuda", 5)
    calls.clear()
    parallel.init("gloo")
    assert calls[0][0] == "gloo" and "device_id" not in calls[0][1]


def test_a_joined_process_group_is_left_at_exit_while_the_interpreter_is_whole(tmp_path):
    """parallel.init registers the group's destruction at exit: a handler registered before init runs after
    it (atexit is last-in, first-out) and finds no group. Without it Gloo's threads outlive the interpreter
    and the process can abort after its work is done."""
    import subprocess
    import sys

    script = tmp_path / "group.py"
    script.write_text(
        "import atexit, os\n"
        "import torch.distributed as dist\n"
        "from tosca_mlmt import parallel\n"
        "atexit.register(lambda: print('group at exit:', dist.is_initialized()))\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(parallel.free_port()), RANK='0', WORLD_SIZE='1')\n"
        "parallel.init('gloo', force=True)\n"
        "print('group joined:', dist.is_initialized())\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["group joined: True", "group at exit: False"]
