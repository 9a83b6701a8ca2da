"""``knob``: a dataclass field with help text and allowed values, for every config section."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def knob(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, **kw):
    """A config field with its help text (and allowed values, checked at load)."""
    md = {"help": help, "choices": choices}
    if default is dataclasses.MISSING:
        return field(metadata=md, **kw)
    return field(default=default, metadata=md, **kw)
