"""``mlmt snapshots list|show|verify``: find snapshots under a folder, read their episodes, check them.

``show ID --episodes N`` is the episode viewer: each episode as problem, gold answer, the first
attempt z, then per feedback round the strategy, the feedback g (flagged when it gives the gold
answer away) and the refine ŷ with its reward and the solver's context bonus (the value its
PPO update used and the raw term; "n/a" for episodes no update saw). It prints to stdout, as
the command's result, so ``| less -R`` works; texts are printed as text, never parsed as rich markup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.rule import Rule
from rich.text import Text

from tosca_mlmt.cli.common import err, user_errors

snapshots_app = typer.Typer(no_args_is_help=True, help="List, inspect and verify dataset snapshots.")

# the filters samples.FILTERS knows; repeated here because cli/ reaches the library only via pipelines/
FILTERS = ("right_to_wrong", "wrong_to_right", "right_to_right", "wrong_to_wrong", "leak")
ROOT_HELP = "Folder searched (recursively: a run folder works) for snapshots."
ID_HELP = "Snapshot id, or a prefix of exactly one id ('snap-' may be left out)."


@snapshots_app.command("list")
@user_errors
def snapshots_list(root: Path = typer.Option(Path("snapshots"), help=ROOT_HELP)):
    """One line per snapshot found under --root: id, kind, environment (honest or privileged), episodes,
    created, folder."""
    from tosca_mlmt.pipelines.support.snapshots import summary_lines

    for line in summary_lines(root):
        print(line)


@snapshots_app.command("show")
@user_errors
def snapshots_show(sid: str = typer.Argument(..., help=ID_HELP),
                   root: Path = typer.Option(Path("snapshots"), help=ROOT_HELP),
                   episodes: int = typer.Option(0, "--episodes", "-n", min=0,
                                                help="Print this many episodes, decoded (0 = the manifest as JSON)."),
                   filter_: Optional[str] = typer.Option(None, "--filter",
                                                         help=f"Only episodes that are: {', '.join(FILTERS)} "
                                                              "(leak = the feedback gave the gold answer away)."),
                   no_verify: bool = typer.Option(False, "--no-verify", help="Read episodes without re-hashing.")):
    """Print a snapshot's manifest (JSON), or with --episodes N its first N episodes, readable."""
    from tosca_mlmt.pipelines.support.snapshots import episode_records, manifest

    if filter_ is not None and filter_ not in FILTERS:
        raise typer.BadParameter(f"{filter_!r}; allowed: {', '.join(FILTERS)}", param_hint="--filter")
    if episodes == 0:
        if filter_ is not None:
            raise typer.BadParameter("needs --episodes N", param_hint="--filter")
        print(json.dumps(manifest(root, sid), indent=2, sort_keys=True))
        return
    head, records = episode_records(root, sid, episodes, filter_, verify=not no_verify)
    out = Console(highlight=False)
    which = f" ({filter_})" if filter_ else ""
    out.print(Text(f"{head['id']}  {head['kind']}  {head['environment']}  {len(records)} episode(s){which}",
                   style="bold"))
    if not records:
        err.print(f"no episodes{escape(which)} in {escape(head['id'])}", highlight=False)
    for i, r in enumerate(records, 1):
        out.print()
        out.print(render_episode(r, i, len(records)))


def _mark(correct) -> Text:
    return Text("right", style="bold green") if correct else Text("wrong", style="bold red")


def _safe(text) -> str:
    """A text from the snapshot (data, model output) with its control characters escaped, newlines kept:
    an escape code in it must not reach the terminal."""
    from tosca_mlmt.pipelines.support.snapshots import terminal_safe

    return terminal_safe("" if text is None else text, keep_newlines=True)


def _attempt(title: str, text: str, correct, reward, extracted, extras: dict) -> Panel:
    head = Text.assemble(title, "  ", _mark(correct), f"  reward {reward if reward is not None else '?'}",
                         f"  extracted {extracted!r}")
    for k, v in extras.items():
        head.append(f"  {_safe(k)} {_safe(v)}")
    return Panel(Text(_safe(text)), title=head, title_align="left", border_style="green" if correct else "red")


def render_episode(r: dict, i: int, n: int) -> Group:
    """One decoded episode (samples.episode_record) as rich renderables."""
    from tosca_mlmt.pipelines.support.snapshots import LOGGED_EXTRAS, bonus_text

    parts = [Rule(Text(_safe(f"{i}/{n}  {r['episode_id']}  {r['outcome'].replace('_to_', ' -> ')}")), align="left"),
             Text.assemble(("problem  ", "bold"), _safe(r["problem"])),
             Text.assemble(("gold     ", "bold"), _safe(r["gold"])),
             _attempt("z (attempt 1)", r["z"], r["correct1"], r["r1"], r["extracted1"], {})]
    for rd in r["rounds"]:
        leak = rd["leaked"]
        title = Text(_safe(f"g (round {rd['round']}, strategy {rd['strategy']})"))
        if leak:
            title.append("  LEAKS THE ANSWER", style="bold yellow")
        parts.append(Panel(Text(_safe(rd["g"])), title=title, title_align="left",
                           border_style="yellow" if leak else "blue"))
        extras = {k: v for k, v in rd.items() if k in LOGGED_EXTRAS}
        extras["bonus"] = bonus_text(rd.get("bonus"), rd.get("bonus_raw"))
        parts.append(_attempt(f"ŷ (attempt {rd['round'] + 1})", rd["y"], rd["correct"], rd["reward"],
                              rd["extracted"], extras))
    return Group(*parts)


@snapshots_app.command("verify")
@user_errors
def snapshots_verify(sid: str = typer.Argument(..., help=ID_HELP),
                     root: Path = typer.Option(Path("snapshots"), help=ROOT_HELP)):
    """Re-hash every file; exit 1 with the list of problems on any mismatch."""
    from tosca_mlmt.pipelines.support.snapshots import problems

    full, bad = problems(root, sid)  # an unparseable manifest raises: exit 2, not a verdict
    if bad:
        for p in bad:
            err.print(f"[bold red]corrupt:[/] {escape(full)}: {escape(p)}", highlight=False)
        raise typer.Exit(1)
    print(f"{full}: ok")
