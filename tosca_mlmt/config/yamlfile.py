"""Reading config YAML: a strict loader (no aliases, no duplicate keys), size and encoding
guards, and ``include:`` of another preset. Every failure is one ConfigError line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tosca_mlmt.config.section import show
from tosca_mlmt.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without aliases and without duplicate keys.

    Aliases: a few hundred bytes of nested ``*refs`` expand into billions of nodes (the
    "billion laughs"), and no preset needs them. Duplicate keys: YAML keeps the last one
    silently, which hides a typo'd or pasted-twice section."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not supported in "
                                                          "configs; write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:
                    raise yaml.constructor.ConstructorError(None, None, f"unhashable key {show(key)}",
                                                            key_node.start_mark) from None
                if seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {show(key)} (first at line {first[key]})", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads "1:30" as the base-60 integer 90 (and "1:30.5" as 5430.5), so a config value meant as
# text ("1:30", a time, a ratio) would silently become another number. YAML 1.2 dropped base 60: here such
# a scalar is the string it reads as; a field that wants a number then refuses it by name.
_SEXAGESIMAL_RE = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_StrictLoader.yaml_implicit_resolvers = {
    first: ([("tag:yaml.org,2002:str", _SEXAGESIMAL_RE)] if first and first in "-+0123456789" else []) + list(rs)
    for first, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def parse_yaml(text: str, where: str, lines: bool = True) -> Any:
    """``text`` parsed by the strict loader; any failure is a one-line ConfigError naming
    ``where`` (and ``where:line`` when ``lines``)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if lines and mark is not None else where
        raise ConfigError(f"{at}: not valid YAML: {_one_line(getattr(e, 'problem', None) or e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError, TypeError) as e:
        # PyYAML's scalar constructors raise plain errors: a 2020-13-45 timestamp, an
        # integer past Python's 4300-digit conversion limit.
        raise ConfigError(f"{where}: not valid YAML: {_one_line(e)}") from None


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` laid onto ``base``, mapping by mapping (neither is modified)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_bytes(path: Path) -> bytes:
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: is a folder, not a config file")
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        # A FIFO or /dev/zero would block or never end; no real config is near the cap.
        if not path.is_file():
            raise ConfigError(f"{path}: not a regular file")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes is too large for a config "
                              f"(at most {MAX_CONFIG_BYTES})")
        return path.read_bytes()
    except ValueError:  # a NUL in the path
        raise ConfigError(f"invalid config path {show(str(path))}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def read_yaml(path: Path, depth: int = 0) -> dict:
    """The mapping in a config file, with its ``include:`` (a path relative to it, else a preset
    name) merged below."""
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    data = parse_yaml(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    inc = data.pop("include", None)
    if inc is not None:
        if not isinstance(inc, str) or not inc.strip():
            raise ConfigError(f"{path}: 'include' must name one YAML file (a path relative to this file, or a preset name), "
                              f"got {show(inc)}")
        if depth >= 4:
            raise ConfigError(f"{path}: include chain too deep (more than 4 levels, or a cycle)")
        target = path.parent / inc
        if not target.exists():
            # a file of one's own outside the checkout may build on a shipped preset by name
            from tosca_mlmt.config.presets import find_preset

            target = find_preset(inc) or target
        data = deep_merge(read_yaml(target, depth + 1), data)
    return data
