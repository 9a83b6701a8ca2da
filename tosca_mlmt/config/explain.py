"""Every knob in words: ``mlmt config --explain`` and the docs' config reference (docs/reference/config.md)."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import types
import typing
from typing import Any

from tosca_mlmt.config.knobs import field_help
from tosca_mlmt.config.root import Config
from tosca_mlmt.config.section import field_types
from tosca_mlmt.errors import ConfigError


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def describe_fields(cls: type = Config, prefix: str = "", inst: Any = None) -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, help with the valid range) for every knob. Defaults are
    read from the enclosing section's instance, so a section default
    (writer_sampling.max_new_tokens = 64) shows as the config holds it."""
    rows = []
    inst = cls() if inst is None else inst
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe_fields(type(value), prefix + f.name + ".", value)
        else:
            rows.append((prefix + f.name, _type_name(hints[f.name]), value, field_help(f.metadata)))
    return rows


def field_matches(name: str, pattern: str) -> bool:
    """Whether the dotted field ``name`` matches ``pattern``: a glob where it holds ``*``, ``?`` or
    ``[`` (``lower.kl*``; ``*`` crosses dots, so ``lower.bonus*`` takes the whole section), else a
    substring (``kl_`` or ``bonus.``); case-insensitive."""
    name, pattern = name.lower(), pattern.lower()
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def explain_lines(cfg: Config | None = None, pattern: str | None = None) -> list[str]:
    """``mlmt config --explain [PATTERN]``: one line per knob, ``name (type, default V): help``.
    With ``cfg`` (a resolved config: ``-c``, ``--set``) V is the value it holds, and where that
    differs from the base default the base default follows it. ``pattern`` keeps the fields
    :func:`field_matches` takes; one that matches none is a ConfigError with the closest names."""
    base = describe_fields()
    rows = base if cfg is None else describe_fields(type(cfg), "", cfg)
    if pattern:
        rows = [r for r in rows if field_matches(r[0], pattern)]
        if not rows:
            names = [r[0] for r in base]
            close = difflib.get_close_matches(pattern.lower(), names, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"--explain {pattern!r}: no config field matches{hint}; a pattern is a substring of "
                              "the dotted name (kl_) or a glob (lower.kl*)")
    base_default = {name: default for name, _, default, _ in base}
    lines = []
    for name, tp, value, help_ in rows:
        shown = f"default {value!r}"
        if value != base_default[name]:
            shown += f", base default {base_default[name]!r}"
        lines.append(f"{name} ({tp}, {shown}): {help_}")
    return lines


def markdown_reference() -> str:
    """The config reference (docs/reference/config.md): one table per top-level section, generated from
    the knobs."""
    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines: list[str] = []
    section = None
    for name, type_, default, help_ in describe_fields():
        top = name.split(".")[0] if "." in name else "(top level)"
        if top != section:
            section = top
            lines += ["", f"## `{top}`", "", "| field | type | default | meaning |", "|---|---|---|---|"]
        shown = "[...]" if isinstance(default, list) and default else repr(default)
        lines.append(f"| `{name}` | {cell(type_)} | `{cell(shown)}` | {cell(help_)} |")
    return "\n".join(lines).strip("\n")
