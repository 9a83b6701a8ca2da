"""Atomic checkpoints with everything needed to continue exactly.

Layout: ``<run>/checkpoints/step-000120/`` holding ``state.json`` (counters, data
position, stage), ``rng.pt`` (python/numpy/torch generator states) and whatever the
trainer writes (adapters, heads, optimizer, scheduler). A checkpoint folder is built
under a temp name and renamed, then ``<run>/checkpoints/latest`` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tosca_mlmt.fsutil import atomic_dir


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, write: Callable[[Path], None], state: dict) -> Path:
        """``write(folder)`` puts the trainer's files in place; ``state`` goes to state.json."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step-{step:06d}"
        with atomic_dir(final) as tmp:
            write(tmp)
            torch.save(rng_state(), tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2, default=str))
        pointer = self.dir / ".latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.dir / "latest")
        self._prune(final)
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
            set_rng_state(torch.load(ck / "rng.pt", weights_only=False))
        return json.loads((ck / "state.json").read_text())

    def _prune(self, newest: Path) -> None:
        steps = sorted(d for d in self.dir.glob("step-*") if d.is_dir())
        for d in steps[: max(0, len(steps) - self.keep)]:
            if d != newest:
                shutil.rmtree(d, ignore_errors=True)
