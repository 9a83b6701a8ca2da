"""The reference pages, generated from the code: every CLI command and option (from the Typer app),
every config knob (from the knob definitions), every logged metric (from the glossary)."""

from __future__ import annotations





def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _commands(group, prefix: str) -> list:
    """(full name, command) of every visible command, subcommands after their group (Typer's click)."""
    out = []
    for name, cmd in group.commands.items():
        if getattr(cmd, "hidden", False):
            continue
        out.append((f"{prefix} {name}", cmd))
        if hasattr(cmd, "commands"):
            out += _commands(cmd, f"{prefix} {name}")
    return out


def _type_name(p) -> str:
    tp = p.type_descriptor.annotation
    args = getattr(tp, "__args__", None)
    if args:  # Optional[int], list[str]
        tp = next(a for a in args if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def _option_row(p) -> str:
    if p.param_type_name == "argument":
        names = f"`{p.name.upper()}`"
    else:
        names = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
    default = p.default if not callable(p.default) else None
    shown = "" if default in (None, (), [], False) or p.param_type_name == "argument" else f"`{default}`"
    kind = "flag" if getattr(p, "is_flag", False) else _type_name(p)
    if p.multiple:
        kind += ", repeatable"
    return f"| {names} | {_cell(kind)} | {shown} | {_cell(getattr(p, 'help', None) or '')} |"


def cli_page() -> str:
    import typer

    from tosca_mlmt.cli.main import app

    root = typer.main.get_command(app)
    lines = ["# CLI reference", "",
             "Generated from the Typer app by `python docs/gen/build.py`; do not edit by hand.",
             "`mlmt COMMAND --help` prints the same text.", ""]
    for name, cmd in sorted(_commands(root, "mlmt")):
        lines += [f"## `{name}`", ""]
        doc = (cmd.help or "").strip()
        if doc:
            lines += [doc, ""]
        if hasattr(cmd, "commands"):
            lines += ["Subcommands: " + ", ".join(f"`{name} {c}`" for c in cmd.commands), ""]
            continue
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        if params:
            lines += ["| option | type | default | help |", "|---|---|---|---|"]
            lines += [_option_row(p) for p in params]
            lines.append("")
    return "\n".join(lines)


def config_page() -> str:
    from tosca_mlmt.config.explain import markdown_reference

    return "\n".join(["# Config reference", "",
                      "Every knob of the one typed config, generated from the knob definitions by",
                      "`python docs/gen/build.py`; do not edit by hand. `mlmt config --explain` prints the same;",
                      "`mlmt config -c PRESET` prints a preset's resolved values. Set a knob in YAML or with",
                      "`--set section.field=value`.", "", markdown_reference(), ""])


def metrics_page() -> str:
    from tosca_mlmt.analysis.glossary import GLOSSARY, PREFIXES

    lines = ["# Metrics glossary", "",
             "Every key a stage writes to `metrics.jsonl` (and to wandb / TensorBoard), generated from",
             "`tosca_mlmt/analysis/glossary.py` by `python docs/gen/build.py`; do not edit by hand. `<name>` marks a",
             "part of the key that varies (a stage, a strategy, a turn).", ""]
    lines += ["## Where a key comes from", "", "| prefix | written by |", "|---|---|"]
    lines += [f"| `{p}` | {_cell(d)} |" for p, d in PREFIXES.items()]
    group = None
    for key, meaning in GLOSSARY.items():
        head = key.split("/")[0] + "/" if "/" in key else "(no prefix)"
        if head != group:
            group = head
            lines += ["", f"## `{head}`", "", "| key | meaning |", "|---|---|"]
        lines.append(f"| `{key}` | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


