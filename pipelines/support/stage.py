"""The one shape of a stage: set up, run iterations that each return a typed record, log, save, close.

Borrowed from torchtune's recipes: every training stage has the same verbs, so a reader who
knows one knows where to look in the others, and resume, logging and checkpointing happen at
the same points everywhere. A stage is a class with these methods; ``drive`` is the loop.

- ``setup()``: the run folder, the resume point, models, engines and data. Returns the first
  iteration to run (0, or the one after the last checkpoint) and the number to stop before.
- ``iteration(i)``: one iteration (a PPO iteration, a Q step, a joint round, a collect batch);
  returns a typed record, never state left on an object for the caller to read.
- ``log(i, record)``: the metrics row, built from the record by the level's ``stats`` module.
- ``save(i, record)``: checkpoints and snapshots due after iteration ``i`` (atomic).
- ``close()``: final artefacts; returns the stage's typed result. ``release()`` frees what the
  stage started (engines, processes) and runs also when an iteration raised.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

R = TypeVar("R")  # one iteration's record
T = TypeVar("T", covariant=True)  # the stage's result


class Stage(Protocol, Generic[R, T]):
    def setup(self) -> tuple[int, int]: ...
    def iteration(self, i: int) -> R: ...
    def log(self, i: int, record: R) -> None: ...
    def save(self, i: int, record: R) -> None: ...
    def close(self) -> T: ...
    def release(self) -> None: ...


def drive(stage: Stage[R, T], stop_after: int | None = None) -> T:
    """Run ``stage`` from its resume point to its end and return its result.

    ``stop_after``: stop once that many iterations are done in all (counted from 0, not from
    the resume point), as a crash would: checkpoints are written up to then, and ``close`` sees
    an unfinished run (it writes no final artefacts). The resume tests use it."""
    try:
        start, stop = stage.setup()
        for i in range(start, stop):
            record = stage.iteration(i)
            stage.log(i, record)
            stage.save(i, record)
            if stop_after is not None and i + 1 >= stop_after:
                break
        return stage.close()
    finally:
        stage.release()
