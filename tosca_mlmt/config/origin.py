"""Which config a command ran and how far it is from the method: the line every model command
prints to stderr before it loads anything (``cli.common.command_config``), and ``mlmt config --diff``.

The base defaults are the knobs' own defaults, a plain single-level starting point; the method the
README describes is the ``mlmt`` preset, 20-odd fields away from them. A run on a user's own data
without ``-c mlmt`` (or ``include: mlmt``) is therefore not the method, and saying so once per
command costs a line where silence cost a researcher a week.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tosca_mlmt.config.explain import describe_fields
from tosca_mlmt.config.root import Config

METHOD = "mlmt"
# the fields that make up a method; task, model, engine and run are the user's choice, not the method's
METHOD_SECTIONS = ("episode.", "lower.", "upper.", "joint.", "collect.solve_temperature",
                   "collect.refine_temperature", "solver_sampling.", "writer_sampling.")


def flat(cfg: Config) -> dict[str, Any]:
    """Dotted field -> value of a resolved config."""
    return {name: value for name, _, value, _ in describe_fields(type(cfg), "", cfg)}


def differences(cfg: Config, other: Config, method_only: bool = False) -> list[tuple[str, Any, Any]]:
    """(field, value in cfg, value in other) where the two differ, in the reference's order."""
    a, b = flat(cfg), flat(other)
    rows = [(n, a[n], b[n]) for n in a if a[n] != b[n]]
    if method_only:
        rows = [r for r in rows if r[0].startswith(METHOD_SECTIONS)]
    return rows


def source_name(path: str | Path | None) -> str:
    """How the config was named: ``base defaults``, ``preset demo`` or the file's path."""
    if path is None:
        return "base defaults"
    from tosca_mlmt.config.presets import find_preset, preset_files

    preset = find_preset(str(path))
    if preset is not None and (not Path(path).exists() or Path(path).resolve() == preset.resolve()):
        name = next(n for n, f in preset_files().items() if f == preset)
        return f"preset {name}"
    return str(path)


def origin_line(cfg: Config, path: str | Path | None, n_overrides: int, run: str | Path | None = None) -> str:
    """``config: preset demo + 2 --set; 15 method fields differ from the mlmt preset (...)``.
    ``run``: the config came from a training run's saved config.yaml (``--run``)."""
    from tosca_mlmt.config.load import load_config

    src = f"the saved config of run {run}" if run is not None else source_name(path)
    if run is not None and path is not None:
        src += f" + {source_name(path)}"
    if n_overrides:
        src += f" + {n_overrides} --set"
    diff = differences(cfg, load_config(METHOD), method_only=True)
    if not diff:
        return f"config: {src}; its method fields are the {METHOD} preset's (the method)"
    names = ", ".join(n for n, _, _ in diff[:4]) + (", ..." if len(diff) > 4 else "")
    shown = Path(run) / "config.yaml" if run is not None else path  # the run's config with -c on top: approximately
    line = (f"config: {src}; {len(diff)} method field{'s differ' if len(diff) != 1 else ' differs'} from the {METHOD} "
            f"preset ({names}); `mlmt config{'' if shown is None else f' -c {shown}'} --diff {METHOD}` lists them")
    if path is None and run is None:
        line += (f". The base defaults are not the method the README describes: pass -c {METHOD}, or put "
                 f"`include: {METHOD}` at the top of your YAML")
    return line


def diff_lines(cfg: Config, other: Config, other_name: str) -> list[str]:
    """``mlmt config --diff NAME``: one line per field whose value differs, ``field: value (NAME: v)``."""
    rows = differences(cfg, other)
    if not rows:
        return [f"# no field differs from {other_name}"]
    return [f"# {len(rows)} field{'s differ' if len(rows) != 1 else ' differs'} from {other_name}"] + [
        f"{name}: {mine!r} ({other_name}: {theirs!r})" for name, mine, theirs in rows]
