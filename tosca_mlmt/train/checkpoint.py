"""Atomic checkpoints with everything needed to continue exactly.

Layout: ``<run>/checkpoints/step-000120/`` holding ``state.json`` (counters, data
position, stage), ``rng.pt`` (python/numpy/torch generator states) and whatever the
trainer writes (adapters, heads, optimizer, scheduler). A checkpoint folder is built
under a temp name (``.step-000120.partial``) and renamed, then ``<run>/checkpoints/latest`` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tosca_mlmt.train import distributed as dist


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, write: Callable[[Path], None], state: dict) -> Path:
        """``write(folder)`` puts the trainer's files in place; ``state`` goes to state.json.
        Collective under several processes: every rank calls it with the same step and writes
        its own RNG state (and DeepSpeed its own partitions); rank 0 publishes the folder."""
        final = self.dir / f"step-{step:06d}"
        tmp = self.dir / f".{final.name}.partial"
        main = dist.is_main()
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
            tmp.mkdir()
        dist.barrier()
        try:
            write(tmp)
            torch.save(rng_state(), tmp / _rng_file(dist.rank()))
            dist.barrier()
            if main:
                (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2, default=str))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                pointer = self.dir / ".latest.tmp"
                pointer.write_text(final.name)
                os.replace(pointer, self.dir / "latest")
                self._prune(final)
        finally:
            if main and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        return final

    def latest(self) -> Path | None:
        p = self.dir / "latest"
        if not p.exists():
            return None
        ck = self.dir / p.read_text().strip()
        return ck if (ck / "state.json").exists() else None

    @staticmethod
    def load_state(ck: Path, restore_rng: bool = True) -> dict:
        if restore_rng:
            own = ck / _rng_file(dist.rank())
            # A rank the saving run did not have (larger world size) takes rank 0's state.
            set_rng_state(torch.load(own if own.exists() else ck / _rng_file(0), weights_only=False))
        return json.loads((ck / "state.json").read_text())

    def _prune(self, newest: Path) -> None:
        steps = sorted(d for d in self.dir.glob("step-*") if d.is_dir())
        for d in steps[: max(0, len(steps) - self.keep)]:
            if d != newest:
                shutil.rmtree(d, ignore_errors=True)
