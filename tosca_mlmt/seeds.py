"""Reproducible random draws without reseeding the process.

Ground floor: imports nothing of ours. Only ``runtime.setup`` seeds the global generators
(once per stage, from ``seed``); library code that must draw reproducibly whatever ran
before (e.g. LoRA initialisation, which peft does with torch's global generator) does it
inside ``seeded``, so it neither depends on nor disturbs the draws around it.

Every other draw comes from a named stream: ``stream(seed, name, *ints)`` is a generator of
its own, keyed by the run's seed, the purpose's name and the position (batch, step, epoch).
Two purposes never share draws, so adding draws to one (more strategies, another epoch)
never shifts another, and no key of one purpose can collide with a key of another. Within a
purpose, keep one number of positions, each below 2**32: numpy's SeedSequence pads a key with
zeros and splits a larger int into 32-bit words, so (name) and (name, 0) are one stream, as are
(name, 2**32) and (name, 0, 1). Every caller here keeps to that.
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import torch


@contextlib.contextmanager
def seeded(seed: int):
    """Block whose torch draws come from generators seeded with ``seed``; on exit the CPU
    generator, and those of CUDA devices already in use, are as they were on entry.

    CUDA is seeded only where it is already initialised: seeding it lazily would queue a
    reseed that runs at its first use, after the block."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


def _name_key(name: str) -> int:
    # a stable 63-bit key per name: Python's hash() is salted per process
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1


def stream(seed: int, name: str, *position: int) -> np.random.Generator:
    """numpy generator for draws of purpose ``name`` at ``position`` (e.g. batch, epoch)."""
    return np.random.default_rng([seed, _name_key(name), *position])


def torch_stream(seed: int, name: str, *position: int) -> torch.Generator:
    """torch generator of the same stream (for torch.randperm and friends)."""
    key = np.random.SeedSequence([seed, _name_key(name), *position]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(key[0] >> np.uint64(1)))
