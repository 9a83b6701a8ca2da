"""``Section``: the base of every config section, a dataclass of knobs that validates itself.

:meth:`Section.validate` checks every knob against what its field declares (type, choices,
range, rule), recurses into nested sections and then runs the section's own
:meth:`Section.check` for rules that tie several fields together. The loader calls it once
on the whole tree; a config built or ``replace``-d in code can call it too. Every failure
is a one-line :class:`ConfigError` that names the dotted field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any

from tosca_mlmt.config.knobs import INT_MAX, Rule, range_error
from tosca_mlmt.errors import ConfigError


def show(value: Any) -> str:
    """``repr`` short enough for a one-line error (a 5000-digit number stays readable)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def text_problem(value: Any) -> str | None:
    """Why a string somewhere in ``value`` cannot be used (NUL, lone surrogate), or None.

    A NUL breaks every path and subprocess call; a lone surrogate (from ``\\udXXX`` escapes
    or undecodable argv bytes) cannot be encoded, so the tokenizer or a file write would
    crash long after load."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "contains a NUL character"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"contains a lone surrogate ({v[e.start]!r}), which is not valid Unicode"
        elif isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            stack += v
    return None


def declared_type(tp: Any, value: Any) -> Any:
    """The type ``value`` must have: a union (``str | list``) takes the list alternative for
    lists and the first one otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        alts = typing.get_args(tp)
        return list if isinstance(value, list) and list in alts else alts[0]
    return tp


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A section's resolved field annotations (cached: the fuzz tests load thousands of configs)."""
    return typing.get_type_hints(cls)


def need(cond: bool, field_: str, msg: str) -> None:
    """A cross-field rule: ``msg`` says what ``field_`` (dotted) must be when ``cond`` fails."""
    if not cond:
        raise ConfigError(f"invalid value for field '{field_}': {msg}")


class ConfigWarning(UserWarning):
    """A config that loads but is known to go wrong (a combination a benchmark saw collapse): said
    when the config loads, before any model does. Kept a warning, not an error, where a shipped
    preset reproduces a published method with it (configs/score.yaml)."""


# runtime.use_allocator sets it for the process it re-executes (runtime._MARK; config/ cannot
# import runtime): that process loads the same config again, and its parent has said the warnings.
_REEXECUTED = "MLMT_ALLOCATOR_EXEC"


def advise(section: Any, message: str) -> None:
    """Warn (:class:`ConfigWarning`, on stderr) that ``section`` holds a known-bad combination.

    Once per section object: the loader says it while validating, and a stage that calls the
    same rule again (LowerLearner, for configs built in code) stays quiet about a section the
    loader already warned about. A section built or ``replace``-d in code is a new object and is
    warned about again. The process runtime.use_allocator re-executes marks it said and stays quiet."""
    said = section.__dict__.setdefault("_config_warnings_said", set())
    if message in said:
        return
    said.add(message)
    if os.environ.get(_REEXECUTED):
        return
    warnings.warn(message, ConfigWarning, stacklevel=1)


def _type_problem(tp: Any, value: Any) -> str | None:
    # bool is an int subclass, but `true` for a count or a rate is a mistake, not 1.
    if tp is bool:
        return None if isinstance(value, bool) else "true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if tp is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    if tp is list:
        return None if isinstance(value, list) else "a list"
    if tp is dict:
        return None if isinstance(value, dict) else "a mapping"
    return None


def check_value(path: str, value: Any, tp: Any, md: Mapping) -> None:
    """One knob's checks: its declared type, then finiteness / 32 bits, text, choices, range, rule."""
    tp = declared_type(tp, value)
    kind = _type_problem(tp, value)
    if kind:
        raise ConfigError(f"field '{path}' must be {kind}, got {show(value)}")
    if tp is int and not -INT_MAX - 1 <= value <= INT_MAX:
        raise ConfigError(f"invalid value {show(value)} for field '{path}': must fit in 32 bits (at most {INT_MAX})")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"invalid value {show(value)} for field '{path}': must be a finite number")
    problem = text_problem(value)
    if problem:
        raise ConfigError(f"invalid value {show(value)} for field '{path}': {problem}")
    choices = md.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"invalid value {show(value)} for field '{path}'; allowed: {', '.join(map(str, choices))}")
    if tp in (int, float):
        reason = range_error(md, value)
        if reason:
            raise ConfigError(f"invalid value {show(value)} for field '{path}': {reason}")
    rule: Rule | None = md.get("rule")
    if rule is not None and not rule.ok(value):
        raise ConfigError(f"invalid value {show(value)} for field '{path}': must be {rule.text}")


@dataclasses.dataclass
class Section:
    """A config section. Subclasses are dataclasses of :func:`~tosca_mlmt.config.knobs.knob`
    fields and nested sections; those with rules between fields override :meth:`check`."""

    def validate(self, prefix: str = "") -> None:
        """Every knob of this section and of the sections inside it, then the cross-field
        rules; ``prefix`` is the section's dotted place in the config (``"lower."``)."""
        types_ = field_types(type(self))
        for f in dataclasses.fields(self):
            value, tp = getattr(self, f.name), types_[f.name]
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, tp):
                    raise ConfigError(f"field '{prefix}{f.name}' must be a mapping, got {show(value)}")
                value.validate(f"{prefix}{f.name}.")
            else:
                check_value(prefix + f.name, value, tp, f.metadata)
        self.check(prefix)

    def check(self, prefix: str) -> None:
        """Rules between this section's fields (none by default); runs after every knob passed."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
