"""``mlmt chat``: solve -> feedback -> refine on problems typed in the terminal.

The transcript goes to stdout (it is what the command is for); loading messages, library logs and
the ``problem>`` prompt go to stderr, so ``echo "2+3" | mlmt chat > out.txt`` keeps out.txt clean.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tosca_mlmt.cli.common import CONFIG, DATA, SEED, SET, command_config, common_overrides, err, parse_sets, results

# the transcript's console; its file is set when the command starts, to the stream its results go to
out = Console(soft_wrap=True, highlight=False)


def chat(
    run: Optional[Path] = typer.Option(None, "--run", help="A training run folder: its solver/ and writer/, and the "
                                       "config it trained with (config.yaml; -c and --set go on top, with a warning "
                                       "naming each field they change)."),
    solver_adapter: Optional[str] = typer.Option(None, "--solver-adapter", help="Solver adapter folder."),
    writer_adapter: Optional[str] = typer.Option(None, "--writer-adapter",
                                                 help="Writer folder: adapter + Q head + strategies."),
    strategy: Optional[str] = typer.Option(None, help="Use this strategy instead of the configured selection."),
    problem: Optional[str] = typer.Option(None, help="One problem; without it, problems are read from stdin, "
                                                     "one a line, until EOF or an empty line."),
    answer: Optional[str] = typer.Option(None, help="Gold answer: show the verifier's verdict on each attempt. "
                                                    "On stdin a line QUESTION<TAB>ANSWER gives its own."),
    sample: bool = typer.Option(False, "--sample", help="Sample with the configured temperatures (default: greedy)."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
):
    """Play solve -> feedback -> refine on typed problems: prints each attempt, the writer's strategy
    table (Q-values, selection probabilities, the pick) and feedback, and verdicts given a gold answer."""
    from tosca_mlmt.pipelines.chat import ChatSession, chat_config

    out.file = results()
    ov = {k: v for k, v in {"model.solver_adapter": solver_adapter, "model.writer_adapter": writer_adapter}.items()
          if v is not None}
    ov.update(common_overrides(seed, data, no_wandb=True, no_progress=True))  # a terminal session: no logs
    ov.update(parse_sets(set_))
    cfg = command_config(config, ov, run=run)
    session = ChatSession(chat_config(cfg, greedy=not sample), strategy=strategy, console=err)
    try:
        for question, gold in _problems(problem, answer):
            _show(session.play(question, gold))
    finally:
        session.close()


def _problems(problem: str | None, answer: str | None):
    if problem is not None:
        yield problem, answer or ""
        return
    while True:
        if sys.stdin.isatty():
            err.print("problem> ", end="")
        line = sys.stdin.readline()
        if not line.strip():  # EOF or an empty line
            return
        question, _, gold = line.rstrip("\n").partition("\t")
        yield question.strip(), gold.strip() or answer or ""


def _verdict(turn, gold: str) -> str:
    if not gold:
        return ""
    mark = "[green]right[/]" if turn.correct else "[red]wrong[/]"
    read = "no answer" if turn.extracted is None else f"read {escape(str(turn.extracted))}"
    return f" {mark} ({read}, gold {escape(gold)})"


def _show(ex) -> None:
    ep, decisions = ex.episode, iter(ex.decisions)
    out.rule(f"[bold]{escape(ep.problem.question)}[/]")
    for t in ep.turns:
        if t.kind == "feedback":
            _table(next(decisions))
            out.print(f"[bold]g[/] (feedback, round {t.round}, {escape(t.strategy_name)}):")
        else:
            label = "z (solve)" if t.kind == "solve" else f"ŷ (refine, round {t.round})"
            out.print(f"[bold]{label}[/]:{_verdict(t, ex.gold)}")
        # a random or badly trained base may emit only special tokens: say so rather than print nothing
        out.print(escape(t.text.strip()) or f"[dim](no text: {len(t.response_ids)} tokens, {t.finish_reason})[/]")
        out.print()


def _table(d) -> None:
    t = Table(title=f"strategies, round {d.round}", caption=f"picked by {escape(d.how)}", title_justify="left",
              caption_justify="left")
    for col, justify in (("", "left"), ("strategy", "left"), ("Q", "right"), ("π(a|s)", "right")):
        t.add_column(col, justify=justify)
    for i, name in enumerate(d.names):
        q = "—" if d.q is None else f"{d.q[i]:+.3f}"
        t.add_row("→" if i == d.picked else "", escape(name), q, f"{d.probs[i]:.3f}",
                  style="bold" if i == d.picked else None)
    out.print(t)
