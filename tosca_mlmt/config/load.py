"""``load_config``: defaults <- YAML file (may ``include:`` another) <- ``--set`` overrides.

Loading only reads: it turns YAML and command-line values into the types the fields declare
(YAML 1.1 reads ``1e-4`` as a string, ``--set`` gives strings) and refuses unknown fields.
What a value may be is the section's business: the built tree validates itself
(:meth:`~tosca_mlmt.config.section.Section.validate`) before it is returned.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from tosca_mlmt.config.presets import resolve_config, resolve_packaged_file
from tosca_mlmt.config.root import Config
from tosca_mlmt.config.section import declared_type, field_types, show, text_problem
from tosca_mlmt.config.yamlfile import deep_merge, parse_yaml, read_yaml
from tosca_mlmt.errors import ConfigError


def _plain(key: Any) -> str:
    """A mapping key for an error message: strings as they are, anything else as its repr."""
    return key if isinstance(key, str) and not text_problem(key) and key.isprintable() else show(key)


def _coerce(path: str, value: Any, tp: Any, default: Any) -> Any:
    """``value`` as the declared type where a lossless reading exists; anything else is left
    for the section's validation to name."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"field '{path}' must be a mapping, got {show(value)}")
        # A partial section merges onto that section's own defaults (which may differ from
        # the section type's defaults, e.g. writer_sampling.max_new_tokens).
        return build(tp, deep_merge(dataclasses.asdict(default), value), path + ".")
    tp = declared_type(tp, value)
    if tp is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if tp is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"field '{path}' must be an integer, got {show(value)}") from None
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):  # 10**400 overflows a float
            raise ConfigError(f"field '{path}' must be a finite number, got {show(value)}") from None
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    return value


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """An instance of the section ``cls`` from a mapping, each absent field at its default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1, cutoff=0.75)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown config field '{prefix}{_plain(unknown[0])}'{hint}; allowed fields here: {', '.join(fields)}"
        )
    types_ = field_types(cls)
    defaults = cls()
    kwargs = {}
    for name in fields:
        default = getattr(defaults, name)
        value = data.get(name, {} if dataclasses.is_dataclass(default) else default)
        kwargs[name] = _coerce(prefix + name, value, types_[name], default)
    return cls(**kwargs)


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Apply ``a.b.c=value`` onto a nested dict (CLI overrides). A mapping given for a section
    (``--set 'lower={kl_coef: 0.1}'``) is merged into it field by field: the section's other fields
    keep what the file and earlier overrides set, instead of going back to their defaults."""
    keys = dotted.split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError(f"bad field name {show(dotted)}: expected dotted names such as lower.lr")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"field '{dotted}': '{k}' is not a section")
    if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict):
        for k, v in value.items():
            set_dotted(node, f"{keys[-1]}.{k}", v)
        return
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file (may ``include:`` another preset) <- dotted overrides; validated.
    ``path``: a file, or the name of a shipped preset (``mlmt``; config/presets.py).

    Defaults go through the same checks as given values, so a default outside its own range
    (or a section default such as writer_sampling's) fails here, in every test run."""
    tree: dict = {}
    if path is not None:
        tree = read_yaml(resolve_config(path))
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    cfg = build(Config, tree)
    # a preset's `configs/deepspeed/...` still means the shipped JSON when run outside a checkout
    cfg.distributed.deepspeed = resolve_packaged_file(cfg.distributed.deepspeed)
    cfg.validate()
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``--set FIELD=VALUE`` -> (field, value), the value read as YAML (``[a, b]`` is a list)."""
    if "=" not in text:
        raise ConfigError(f"--set expects FIELD=VALUE, got {show(text)}")
    key, value = text.split("=", 1)
    key = key.strip()
    problem = text_problem(text)
    if problem:  # YAML would only say "special characters are not allowed"
        raise ConfigError(f"--set {show(text)}: {problem}")
    return key, parse_yaml(value, f"--set {_plain(key)}", lines=False) if value.strip() else ""
