"""Task registry: name -> constructor from the config's task section."""

from __future__ import annotations

from tosca_mlmt.config import TaskConfig
from tosca_mlmt.tasks.base import Task

TASK_NAMES = ("arith", "gsm8k", "math500", "mbpp")


def make_task(cfg: TaskConfig) -> Task:
    data = cfg.data_path or None
    if cfg.name == "arith":
        from tosca_mlmt.tasks.arith import ArithTask

        return ArithTask(cfg.level)
    if cfg.name == "gsm8k":
        from tosca_mlmt.tasks.math_tasks import GSM8KTask

        return GSM8KTask(data)
    if cfg.name == "math500":
        from tosca_mlmt.tasks.math_tasks import Math500Task

        return Math500Task(data)
    if cfg.name == "mbpp":
        from tosca_mlmt.tasks.mbpp import MBPPTask

        return MBPPTask(data)
    from tosca_mlmt.errors import ConfigError

    raise ConfigError(f"invalid value {cfg.name!r} for field 'task.name'; allowed: {', '.join(TASK_NAMES)}")
