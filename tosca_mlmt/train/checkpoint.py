"""Atomic, self-verifying checkpoints with everything needed to continue exactly.

Layout: ``<run>/checkpoints/step-000120/`` holding ``state.json`` (counters, data
position, stage, the metrics file's length at that point), ``rng.pt`` (python/numpy/torch
generator states; on a GPU also the process's CUDA generator), whatever the trainer writes
(adapters, heads, optimizer, scheduler) and, written last, ``complete.json``: the size and
sha256 of every other file. A checkpoint folder is built under a temp name
(``.step-000120.partial``) and renamed, then ``<run>/checkpoints/latest`` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact.

Resuming does not trust the ``latest`` pointer: it takes the newest checkpoint whose files
all match ``complete.json``, and warns about each newer one it skips (a file missing,
truncated or changed), so a damaged checkpoint costs the steps since the one before it,
never the run. Checkpoints written before ``complete.json`` existed are used unverified.

A full disk: a save first checks that the disk has room for a checkpoint the size of the last
one (at least ``fsutil.MIN_FREE_BYTES``), and a write that runs out of space (an ENOSPC, or
torch's "unexpected pos" from a truncated archive on a disk left with no room) is reported as
``fsutil.NoSpaceError`` naming the disk; the partial folder is removed either way.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tosca_mlmt import parallel as dist
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.fsutil import (MIN_FREE_BYTES, NoSpaceError, atomic_write_text, ensure_space, free_bytes,
                               fsync_tree, is_no_space, no_space_message, sha256_file)

COMPLETE = "complete.json"
CHECKPOINT_FORMAT = 1


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or used without verification (old format)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    # on a GPU run LoRA dropout (and any other on-device draw) takes from the process's CUDA
    # generator, not the CPU one: without it a resumed run would drop other units
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(dist.compute_device())
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    # a GPU checkpoint resumed on a CPU has no CUDA generator to restore; a CPU one resumed on
    # a GPU leaves it as runtime.setup seeded it
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], dist.compute_device())


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def file_table(folder: Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != COMPLETE}


def checkpoint_problem(ck: Path) -> str | None:
    """Why ``ck`` cannot be resumed from, or None. Sizes are compared before any hashing."""
    marker = ck / COMPLETE
    if not marker.is_file():
        if not (ck / "state.json").is_file():
            return f"{COMPLETE} and state.json missing (incomplete)"
        try:
            json.loads((ck / "state.json").read_text())
        except (OSError, ValueError) as e:
            return f"state.json unreadable ({e})"
        return None  # an old-format checkpoint: usable, not verifiable (the caller warns)
    try:
        files = json.loads(marker.read_text())["files"]
        entries = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{COMPLETE} unreadable ({type(e).__name__}: {e})"
    if "state.json" not in files:
        return f"{COMPLETE} lists no state.json"
    for name, size, _ in entries:
        f = ck / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} were written (truncated or replaced)"
    for name, _, sha in entries:
        if sha256_file(ck / name) != sha:
            return f"{name} changed since it was written (sha256 mismatch)"
    return None


def _step_of(d: Path) -> int:
    try:
        return int(d.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self._resume: tuple[str | None, str | None] | None = None  # latest()'s answer, warned about once

    def save(self, step: int, write: Callable[[Path], None], state: dict) -> Path:
        """``write(folder)`` puts the trainer's files in place; ``state`` goes to state.json.
        Collective under several processes: every rank calls it with the same step and writes
        its own RNG state (and DeepSpeed its own partitions); rank 0 publishes the folder."""
        final = self.dir / f"step-{step:06d}"
        tmp = self.dir / f".{final.name}.partial"
        self._resume = None  # a new checkpoint changes the answer of latest()
        main = dist.is_main()
        needed = self._room(main)
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
            tmp.mkdir()
        dist.barrier()
        try:
            self._write(tmp, step, state, write, main, needed, final)
        finally:
            if main and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        return final

    def _room(self, main: bool) -> int:
        """Refuse a save the disk has no room for, on every rank, before anything is written:
        room for a checkpoint the size of the newest one, at least MIN_FREE_BYTES."""
        needed, problem = MIN_FREE_BYTES, None
        if main:
            last = self.checkpoints()[:1]
            if last:
                needed = max(needed, sum(p.stat().st_size for p in last[0].rglob("*") if p.is_file()))
            try:
                ensure_space(self.dir, needed)
            except NoSpaceError as e:
                problem = str(e)
        needed, problem = dist.broadcast((needed, problem))
        if problem:
            raise NoSpaceError(problem, self.dir)
        return needed

    def _write(self, tmp: Path, step: int, state: dict, write, main: bool, needed: int, final: Path) -> None:
        try:
            write(tmp)
            torch.save(rng_state(), tmp / _rng_file(dist.rank()))
            dist.barrier()
            if main:
                (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2, default=str))
                # Last file in: its presence and table say every other file is whole.
                (tmp / COMPLETE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step,
                                                        "files": file_table(tmp)}, indent=1))
                fsync_tree(tmp)  # on disk before the prune below may remove the last checkpoint
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                atomic_write_text(self.dir / "latest", final.name)
                self._prune(final)
        except NoSpaceError:
            raise
        except (OSError, RuntimeError) as e:
            # torch.save on a full disk raises RuntimeError("[enforce fail at inline_container.cc] unexpected
            # pos"), not an OSError: what tells is the disk being (almost) full now, with the partial folder on it
            free = free_bytes(self.dir)
            if is_no_space(e) or (isinstance(e, RuntimeError) and free is not None and free < MIN_FREE_BYTES):
                cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise NoSpaceError(no_space_message(self.dir, needed, f"writing checkpoint {final.name}: {cause}"),
                                   self.dir) from e
            raise

    def checkpoints(self) -> list[Path]:
        """Published checkpoint folders, newest first (temp folders are not among them)."""
        found = [d for d in self.dir.glob("step-*") if d.is_dir() and _step_of(d) >= 0] if self.dir.is_dir() else []
        return sorted(found, key=_step_of, reverse=True)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (None when there is none at all). Warns once
        about each newer one skipped; raises MlmtError when checkpoints exist but none is
        usable, rather than silently starting over. Rank 0 decides for every rank."""
        if self._resume is None:
            outcome = self._choose() if dist.is_main() else None
            self._resume = dist.broadcast(outcome)
        name, error = self._resume
        if error:
            raise MlmtError(error)
        return None if name is None else self.dir / name

    def _choose(self) -> tuple[str | None, str | None]:
        skipped = []
        for ck in self.checkpoints():
            why = checkpoint_problem(ck)
            if why is None:
                for s in skipped:
                    warnings.warn(f"resume: skipping checkpoint {s}; using {ck.name}", CheckpointWarning,
                                  stacklevel=4)
                if not (ck / COMPLETE).exists():
                    warnings.warn(f"resume: {ck} predates verified checkpoints ({COMPLETE}); using it unverified",
                                  CheckpointWarning, stacklevel=4)
                return ck.name, None
            skipped.append(f"{ck.name} ({why})")
        if skipped:
            return None, (f"{self.dir}: no usable checkpoint to resume from: {'; '.join(skipped)}; "
                          f"delete the damaged folder(s) to start the run over")
        return None, None

    @staticmethod
    def load_state(ck: Path, restore_rng: bool = True) -> dict:
        if restore_rng:
            own = ck / _rng_file(dist.rank())
            # A rank the saving run did not have (larger world size) takes rank 0's state.
            set_rng_state(torch.load(own if own.exists() else ck / _rng_file(0), weights_only=False))
        return json.loads((ck / "state.json").read_text())

    def _prune(self, newest: Path) -> None:
        # by step number, not name: past step 999999 the names outgrow the zero padding
        steps = sorted((d for d in self.dir.glob("step-*") if d.is_dir()), key=_step_of)
        for d in steps[: max(0, len(steps) - self.keep)]:
            if d != newest:
                shutil.rmtree(d, ignore_errors=True)
