"""Every knob in words: ``mlmt config --explain`` and the docs' config reference (docs/reference/config.md)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from tosca_mlmt.config.knobs import field_help
from tosca_mlmt.config.root import Config
from tosca_mlmt.config.section import field_types


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
