"""What train-joint logs for itself: the typed records of a round and of each step it ran, and
the ``joint/*`` row built from a step's record.

Separate from the stage so that the row is a pure function of the record (records in, the row
out, nothing read from the stage, its engine or the process): docs/reference/metrics.md names
what it holds. The stages a round runs log their own rows (``upper/*``, ``lower/*``) through
the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# where a step's own numbers go on its row: collect's batch under joint/collect/ (not the PPO
# batch's acc_t1), the held-out eval's under eval/
_OWN_PREFIX = {"collect": "joint/collect/", "eval": "eval/"}


@dataclass(frozen=True)
class JointStep:
    """One step of a round (collect, upper, lower or eval) as this process ran it."""

    name: str
    seconds: float  # wall seconds of the step, its engine's weight sync included
    sync_seconds: float  # of those, the rollout engine's weight reloads (eager and lazy)
    peak_rss_gib: float  # the process's peak so far: the step where it rises set it
    peak_gpu_gib: dict[str, float] = field(default_factory=dict)  # runtime.peak_gpu_gib's, at the step's end
    metrics: dict[str, float] = field(default_factory=dict)  # collect's or eval's summary (the manifest's)


@dataclass(frozen=True)
class JointRound:
    """One train-joint iteration: the steps of round ``round`` this process ran (a resumed run
    skips those the manifest marks done)."""

    round: int
    steps: tuple[JointStep, ...] = ()
    stopped_by_budget: bool = False  # joint.max_seconds was spent before the round began: the run ends
    halted: bool = False  # stop_after named its last step: the run ends there, as a kill would


def step_row(r: int, step: JointStep) -> dict:
    """The ``joint/*`` row of round ``r``'s finished ``step`` (one record on the joint timeline)."""
    name = step.name
    row = {f"joint/time/{name}": step.seconds, "joint/round": r, f"joint/peak_rss_gib/{name}": step.peak_rss_gib,
           **{f"joint/{k}/{name}": v for k, v in step.peak_gpu_gib.items()}}
    if name in _OWN_PREFIX:
        row.update({_OWN_PREFIX[name] + k: v for k, v in step.metrics.items()})
    return row
