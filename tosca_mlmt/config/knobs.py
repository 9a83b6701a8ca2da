"""``knob``: a dataclass field with help text and its valid values, for every config section.

Each knob states what it accepts (``choices``, a numeric range, or a :class:`Rule`); the
section checks it when it validates itself, and ``mlmt config --explain`` and the docs
print the same range next to the help. Floats must always be finite and integers must fit
in a signed 32-bit int (sizes, steps and seeds reach torch, numpy and vLLM, which reject
or overflow on larger ones), whether or not a knob states a tighter range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

INT_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check a range cannot express: ``ok(value)`` must hold; ``text`` says what is allowed."""

    text: str
    ok: Callable[[Any], bool]


def knob(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, *,
         min: float | None = None, max: float | None = None, min_exclusive: bool = False,
         max_exclusive: bool = False, rule: Rule | None = None, **kw):
    """A config field with its help text and valid values (checked at load).

    ``min``/``max`` bound numbers (inclusive unless ``*_exclusive``); ``rule`` adds any other
    condition (e.g. "0 or >= 1e-3")."""
    md = {"help": help, "choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive,
          "max_exclusive": max_exclusive, "rule": rule}
    if default is dataclasses.MISSING:
        return field(metadata=md, **kw)
    return field(default=default, metadata=md, **kw)


def _num(x: float) -> str:
    return repr(x) if isinstance(x, float) and x and (abs(x) < 1e-3 or abs(x) >= 1e6) else f"{x:g}"


def range_text(md: Mapping) -> str:
    """The range of a knob's metadata in words: ``[0, 1]``, ``>= 1``, ``> 0`` (empty if none)."""
    lo, hi = md.get("min"), md.get("max")
    if lo is not None and hi is not None:
        return (f"{'(' if md.get('min_exclusive') else '['}{_num(lo)}, {_num(hi)}"
                f"{')' if md.get('max_exclusive') else ']'}")
    if lo is not None:
        return f"{'>' if md.get('min_exclusive') else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if md.get('max_exclusive') else '<='} {_num(hi)}"
    return ""


def range_error(md: Mapping, value: float) -> str | None:
    """Why ``value`` is outside the knob's range, or None when it is inside."""
    lo, hi = md.get("min"), md.get("max")
    bad_lo = lo is not None and (value <= lo if md.get("min_exclusive") else value < lo)
    bad_hi = hi is not None and (value >= hi if md.get("max_exclusive") else value > hi)
    return f"must be {'in ' if lo is not None and hi is not None else ''}{range_text(md)}" if bad_lo or bad_hi else None


def field_help(md: Mapping) -> str:
    """A knob's help text followed by its allowed values (choices, range, rule)."""
    out = md.get("help", "")
    if md.get("choices"):
        out += f" One of: {', '.join(map(str, md['choices']))}."
    valid = [t for t in (range_text(md), md["rule"].text if md.get("rule") else "") if t]
    if valid:
        out += f" Valid: {'; '.join(valid)}."
    return out


# ---------------------------------------------------------------- rules shared by sections

def path_is(kind: str, value: str) -> bool:
    """Whether ``value`` names an existing folder (``kind="dir"``) or file; a name the OS
    refuses outright (too long, a NUL) is simply not one."""
    try:
        p = Path(value).expanduser()
        return p.is_dir() if kind == "dir" else p.is_file()
    except (OSError, ValueError):
        return False


NON_EMPTY = Rule("non-empty", lambda v: bool(str(v).strip()))
EXISTING_DIR_OR_EMPTY = Rule("empty or an existing folder", lambda v: not v or path_is("dir", v))
EXISTING_FILE_OR_EMPTY = Rule("empty or an existing file", lambda v: not v or path_is("file", v))
# distinct: a snapshot listed twice would have its episodes (decisions) count twice
ID_LIST = Rule("a list of distinct non-empty strings",
               lambda v: all(isinstance(s, str) and s.strip() for s in v) and len(set(v)) == len(v))
