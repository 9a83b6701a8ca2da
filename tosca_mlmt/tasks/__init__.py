"""Verifiable tasks. :func:`make_task` builds the configured one (:mod:`tosca_mlmt.tasks.registry`)."""

from __future__ import annotations

from tosca_mlmt.tasks.registry import TASKS, load_object, make_task, task_names

__all__ = ["TASKS", "load_object", "make_task", "task_names"]
