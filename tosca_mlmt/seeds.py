"""Reproducible random draws without reseeding the process.

Ground floor: imports nothing of ours. Only ``runtime.setup`` seeds the global generators
(once per stage, from ``seed``); library code that must draw reproducibly whatever ran
before (e.g. LoRA initialisation, which peft does with torch's global generator) does it
inside ``seeded``, so it neither depends on nor disturbs the draws around it.
"""

from __future__ import annotations

import contextlib

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
