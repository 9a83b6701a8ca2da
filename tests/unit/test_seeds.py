"""Named random streams (tosca_mlmt.seeds): independent per purpose, reproducible, and no
global reseeding by the library."""

import numpy as np
import torch

from tosca_mlmt.seeds import seeded, stream, torch_stream


def test_a_stream_is_reproducible_and_leaves_the_global_generators_alone():
    np.random.seed(5)
    torch.manual_seed(5)
    a = stream(3, "strategy", 7).random(4)
    t = torch.randperm(10, generator=torch_stream(3, "decisions", 0))
    assert np.array_equal(a, stream(3, "strategy", 7).random(4))
    assert torch.equal(t, torch.randperm(10, generator=torch_stream(3, "decisions", 0)))
    # the global draws are those the reseed above gives, as if no stream had been used
    np.random.seed(5)
    torch.manual_seed(5)
    ref_np, ref_t = np.random.random(), torch.rand(1)
    np.random.seed(5)
    torch.manual_seed(5)
    stream(3, "strategy", 7).random(4)
    torch.randperm(10, generator=torch_stream(3, "decisions", 0))
    assert np.random.random() == ref_np and torch.equal(torch.rand(1), ref_t)


def test_streams_differ_by_name_seed_and_position_even_where_the_integers_coincide():
    draws = {key: tuple(stream(*key).integers(0, 2**31, 4)) for key in [
        (0, "strategy", 1, 17), (0, "minibatch", 1, 17), (0, "strategy", 1), (1, "strategy", 1, 17),
        (0, "strategy", 17, 1), (0, "problems", 0), (0, "decisions", 0)]}
    assert len(set(draws.values())) == len(draws)
    perms = {n: tuple(torch.randperm(50, generator=torch_stream(0, n, 0)).tolist()) for n in ("a", "b", "c")}
    assert len(set(perms.values())) == 3


def test_seeded_restores_the_callers_torch_state():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    with seeded(99):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    with seeded(99):
        assert torch.equal(torch.rand(3), inside)
