"""The task registry: ``task.name`` -> a :class:`~tosca_mlmt.tasks.base.Task`.

Three forms, tried in this order:

* a built-in name (:data:`TASKS`, filed below);
* the name of an installed ``tosca_mlmt.tasks`` entry point (a package's pyproject declares
  ``[project.entry-points."tosca_mlmt.tasks"] mytask = "my_pkg.tasks:MyTask"``);
* ``module:Class`` or ``path/to/file.py:Class``.

The object an entry point or path names is a Task class or a factory; it is called with the
``task:`` section (:class:`~tosca_mlmt.config.TaskConfig`) when it takes an argument, else
with none. ``task.reward`` then wraps the task (:mod:`tosca_mlmt.tasks.reward`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib import metadata
from typing import Any

from tosca_mlmt.config import ENTRY_POINT_GROUP, TaskConfig
# load_object comes from the config, which resolves task.name and task.reward paths with it at load:
# one module cache (a .py file runs once per process), one wording of the errors
from tosca_mlmt.config.task import load_object
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.tasks.base import Task

TASKS: dict[str, Callable[[TaskConfig], Task]] = {}
TASK_API = ("name", "verifier_version", "load", "instruction", "verify")


def _builtin(name: str):
    def deco(factory: Callable[[TaskConfig], Task]):
        TASKS[name] = factory
        return factory
    return deco


# Built-ins import their module on use: mbpp pulls in the sandbox, jsonl may pull in datasets.
@_builtin("arith")
def _arith(cfg: TaskConfig) -> Task:
    from tosca_mlmt.tasks.arith import ArithTask

    return ArithTask(cfg.level)


@_builtin("gsm8k")
def _gsm8k(cfg: TaskConfig) -> Task:
    from tosca_mlmt.tasks.math_tasks import GSM8KTask

    return GSM8KTask(cfg.data_path or None)


@_builtin("math500")
def _math500(cfg: TaskConfig) -> Task:
    from tosca_mlmt.tasks.math_tasks import Math500Task

    return Math500Task(cfg.data_path or None)


@_builtin("mbpp")
def _mbpp(cfg: TaskConfig) -> Task:
    from tosca_mlmt.tasks.mbpp import MBPPTask

    return MBPPTask(cfg.data_path or None)


@_builtin("jsonl")
def _jsonl(cfg: TaskConfig) -> Task:
    from tosca_mlmt.tasks.generic import JsonlTask

    return JsonlTask.from_config(cfg)


def task_names() -> tuple[str, ...]:
    """What ``task.name`` accepts besides a path: the built-ins, then the installed entry points
    (a built-in keeps its name). config/ builds the same list without importing this module."""
    installed = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)} - set(TASKS))
    return (*TASKS, *installed)


def _bad(field: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"invalid value {value!r} for field '{field}': {why}")


def _entry_point(name: str) -> Any | None:
    """The object the installed entry point ``name`` names, or None when none is installed."""
    eps = {ep.value: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)}
    if not eps:
        return None
    if len(eps) > 1:
        raise _bad("task.name", name, f"several installed '{ENTRY_POINT_GROUP}' entry points have this name "
                                      f"({', '.join(sorted(eps))}); uninstall one or name the class by path")
    (ep,) = eps.values()
    try:
        return ep.load()
    except BaseException as e:  # noqa: BLE001 -- a broken plugin is a bad task.name, not a crash
        if isinstance(e, KeyboardInterrupt):
            raise
        raise _bad("task.name", name, f"entry point {ep.value} failed to load: {type(e).__name__}: {e}") from e


def _takes_config(factory: Callable) -> bool:
    try:
        inspect.signature(factory).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): give it the section
        return True
    return True


def build_task(cfg: TaskConfig) -> Task:
    """The task ``cfg.name`` names, without the reward hook."""
    if cfg.name in TASKS:
        return TASKS[cfg.name](cfg)
    factory = _entry_point(cfg.name) if ":" not in cfg.name else load_object(cfg.name, "task.name")
    if factory is None:
        raise _bad("task.name", cfg.name, f"allowed: {', '.join(task_names())}, or 'module:Class' / "
                                          "'path/to/file.py:Class'")
    if not callable(factory):
        raise _bad("task.name", cfg.name, f"names a {type(factory).__name__}, not a Task class or factory")
    task = factory(cfg) if _takes_config(factory) else factory()
    missing = [a for a in TASK_API if not hasattr(task, a)]
    if missing:
        raise _bad("task.name", cfg.name, f"built a {type(task).__name__} without {', '.join(missing)} "
                                          "(a task needs name, verifier_version, load, instruction, verify)")
    return task


def make_task(cfg: TaskConfig) -> Task:
    """The configured task, with ``task.reward`` (if set) scoring its responses."""
    task = build_task(cfg)
    if cfg.reward:
        from tosca_mlmt.tasks.reward import RewardHook

        task = RewardHook(task, load_object(cfg.reward, "task.reward"), cfg.reward)
    return task
