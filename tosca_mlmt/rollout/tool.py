"""A task's own check of an attempt in the episode: ``episode.writer_sees: tool`` and ``feedback: tool``.

The check (``Task.check_attempt``, tasks/base.py: ToolReport; the step checker of tasks/steps.py for
arith, gsm8k and math500; mbpp runs the attempt's code against the one test its instruction shows) reads
the question and the attempt only, so what it tells the writer is honest, test-time information. Under ``writer_sees: tool`` its one-line finding goes into the writer's
state after each attempt and its flag is the state's writer signal (the Q head's table row); under
``feedback: tool`` its hint is the feedback, a fixed rule that needs no writer model. Either way the
report on the last attempt is stored on the feedback turn (``info["tool_report"]``).
"""

from __future__ import annotations

import weakref

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.records import Turn
from tosca_mlmt.rollout.engines.stop import final_text
from tosca_mlmt.tasks.base import Problem, Task, ToolReport


def uses_tool(episode_cfg) -> bool:
    """Whether the episode needs the task's check (writer_sees or feedback: tool)."""
    return "tool" in (episode_cfg.writer_sees, episode_cfg.feedback)


def has_check(task: Task) -> bool:
    """Whether the task checks an attempt itself (``check_attempt``): the one rule for the episode's tool and
    for ``mlmt eval --resample tool``."""
    return callable(getattr(task, "check_attempt", None))


def require_check(episode_cfg, task: Task) -> None:
    """Refuse writer_sees/feedback: tool for a task that has no ``check_attempt``, naming the task."""
    if not uses_tool(episode_cfg) or has_check(task):
        return
    field = "writer_sees" if episode_cfg.writer_sees == "tool" else "feedback"
    raise ConfigError(f"invalid value 'tool' for field 'episode.{field}': task {task.name!r} has no check_attempt "
                      "(its own check of an attempt: arith, gsm8k and math500 run the step checker, mbpp its public test). Add "
                      "check_attempt(problem, response) to the task (docs/guides/own-task.md) or use another value")


def attempt_report(task: Task, problem: Problem, turn: Turn, tags: list[str], reads_thinking: bool) -> ToolReport:
    """The task's check of one solver turn, on the text the writer reads of it: whole (thinking
    included, where the calculations are) or, with reads_thinking false, what follows the thinking."""
    text = turn.text if reads_thinking or not tags else final_text(turn.text, tags)
    return task.check_attempt(problem, text)


class AttemptReports:
    """Each solver turn's check, run once per turn object: every feedback round's writer state reads all
    earlier attempts, and a check can be costly (mbpp's is a sandbox run), so round k must not re-run
    the k - 1 checks before it. An entry lives as long as its turn (Turn is unhashable, so keyed by
    id, and dropped when the turn is collected, before its id can be reused)."""

    def __init__(self, task: Task, tags: list[str], reads_thinking: bool):
        self.task, self.tags, self.reads_thinking = task, tags, reads_thinking
        self._by_turn: dict[int, ToolReport] = {}

    def of(self, problem: Problem, turn: Turn) -> ToolReport:
        key = id(turn)
        if key not in self._by_turn:
            self._by_turn[key] = attempt_report(self.task, problem, turn, self.tags, self.reads_thinking)
            weakref.finalize(turn, self._by_turn.pop, key, None)
        return self._by_turn[key]
