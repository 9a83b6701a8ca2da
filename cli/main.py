"""The ``mlmt`` command line.

Progress bars, tables and messages go to stderr; stdout carries only machine-readable
results (for ``collect``: the snapshot id as its last line), so ``ID=$(mlmt collect ...)``
works. Library logs (vLLM, transformers, DeepSpeed, torch) go to stderr, errors only unless
``--verbose``. User errors (bad config, bad data, missing snapshot) exit with code 2.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Optional

import typer

import tosca_mlmt
from tosca_mlmt import pipelines, runtime
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.cli import common
from tosca_mlmt.cli.analyze_cmd import analyze
from tosca_mlmt.cli.chat_cmd import chat
from tosca_mlmt.cli.common import (CONFIG, DATA, NO_PROGRESS, NO_WANDB, SEED, SET, TASK, command_config,
                                  common_overrides, err, out_folder, parse_sets, print_result, print_summary,
                                  results_on_stdout, user_errors)
from tosca_mlmt.cli.eval_cmd import eval_cmd
from tosca_mlmt.cli.export_cmd import export
from tosca_mlmt.cli.joint_cmd import train_joint
from tosca_mlmt.cli.lower_cmd import train_lower
from tosca_mlmt.cli.snapshots_cmd import snapshots_app
from tosca_mlmt.cli.upper_cmd import train_upper

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0] if __doc__ else None,
                  pretty_exceptions_enable=False)
app.add_typer(snapshots_app, name="snapshots")


@app.callback()
def _process(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the logs and warnings of the libraries "
                                          "underneath (vLLM, transformers, DeepSpeed, torch) on stderr; without it, "
                                          "only their errors. stdout carries the command's result either way.")
             ) -> None:
    # Runs before any command, while torch is not loaded yet: libgomp reads OMP_WAIT_POLICY
    # once, when torch loads, and huggingface_hub reads HF_HUB_OFFLINE when it is imported.
    runtime.process_env()
    common.VERBOSE = verbose
    if common.STANDALONE:  # where a test or notebook calls the app, its logging stays the caller's
        common.third_party_logs(verbose)
    warnings.showwarning = _show_warning


# Our own warnings (a config known to collapse, a run's config overridden) are messages to the user: one
# `warning:` line each on stderr, as errors are one `error:` line, not Python's file:line and source echo.
_OURS = tuple(str(Path(m.__file__).resolve().parent) for m in (tosca_mlmt, common, pipelines))
_python_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None):
    # ours: raised in our code, or of a category of ours raised where a stacklevel points (a user's plugin)
    ours = str(Path(filename).resolve()).startswith(_OURS) or category.__module__.startswith("tosca_mlmt")
    if issubclass(category, UserWarning) and ours:
        print(f"warning: {message}", file=sys.stderr if file is None else file)
    elif ours or not common.QUIET:  # a library's FutureWarning etc. only with --verbose
        _python_showwarning(message, category, filename, lineno, file, line)


@app.command()
@user_errors
@results_on_stdout
def collect(
    task: Optional[str] = TASK,
    limit: Optional[int] = typer.Option(None, help="Number of problems (0 = whole split)."),
    split: Optional[str] = typer.Option(None, help="train or test."),
    engine: Optional[str] = typer.Option(None, help="Rollout engine: hf or vllm."),
    out: Optional[Path] = typer.Option(None, help="Snapshot root folder.", parser=out_folder),
    n_samples: Optional[int] = typer.Option(None, help="Turn-1 samples per problem."),
    rounds: Optional[int] = typer.Option(None, help="Feedback + refine rounds (K)."),
    level: Optional[int] = typer.Option(None, help="arith difficulty level 1-6 (task.level)."),
    greedy: bool = typer.Option(False, help="Greedy decoding for solver and writer (deterministic snapshots)."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Drop malformed data rows (counted in the manifest)."),
    parent: list[str] = typer.Option([], help="Parent snapshot id(s) to record in provenance."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
    no_wandb: bool = NO_WANDB,
    no_progress: bool = NO_PROGRESS,
):
    """Run episodes with the current solver and writer, verify them, and write a snapshot.

    Prints the snapshot id as the last line of stdout."""
    ov = {k: v for k, v in {
        "task.name": task, "task.limit": limit, "task.split": split, "engine.name": engine,
        "collect.out": str(out) if out else None, "episode.n_samples": n_samples,
        "episode.rounds": rounds, "task.level": level,
    }.items() if v is not None}
    if greedy:
        ov.update({"solver_sampling.temperature": 0.0, "writer_sampling.temperature": 0.0})
    if skip_bad_rows:
        ov["task.skip_bad_rows"] = True
    if parent:
        ov["collect.parents"] = list(parent)
    ov.update(common_overrides(seed, data, no_wandb, no_progress))
    ov.update(parse_sets(set_))
    cfg = command_config(config, ov)
    from tosca_mlmt.pipelines.collect import collect as run_collect

    res = run_collect(cfg, console=err)
    print_summary(f"snapshot {res.snapshot_id}" + ("" if res.created else " (identical snapshot already existed)"),
                  res.summary)
    err.print(f"written to {res.path}")
    print_result(res.snapshot_id)


@app.command()
@user_errors
@results_on_stdout
def setup(model: str = typer.Option("smollm2-135m", help="Embedded model name, local folder, or org/name hub id "
                                                         "already in the local HF cache.")):
    """Convert the embedded model once into the cache ($TOSCA_MLMT_CACHE) and print its folder;
    where DeepSpeed is installed on a CPU machine, also build its comm op (else built at the first
    distributed start)."""
    from tosca_mlmt.pipelines.support.snapshots import prepare_environment

    folder, built = prepare_environment(model)
    if built:
        print(f"DeepSpeed op built: {built}", file=sys.stderr)
    print_result(folder)


@app.command("config")
@user_errors
def config_cmd(
    pattern: Optional[str] = typer.Argument(None, metavar="[PATTERN]", show_default=False,
                                            help="With --explain: only the fields whose dotted name matches, a glob "
                                                 "('lower.kl*') or a substring ('kl_')."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config to resolve: a file, or a "
                                                                       "preset name (mlmt, demo; see --list-presets)."),
    explain: bool = typer.Option(False, help="List every field (or those PATTERN matches) with its help text and "
                                             "default; with -c or --set, the value the resolved config holds, the "
                                             "base default beside it where they differ."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List the shipped presets (usable as -c NAME) "
                                                                     "with what each is for."),
    set_: list[str] = typer.Option([], "--set", help="Overrides, as for collect."),
    diff: Optional[str] = typer.Option(None, "--diff", metavar="PRESET", help="List the fields where the resolved "
                                       "config (the base defaults without -c) differs from a preset or YAML file, "
                                       "e.g. --diff mlmt: how far a config is from the method."),
):
    """Print the fully resolved config (validated), every knob with --explain, or the presets.

    A combination known to go wrong (lower.kl_mode=reward under grpo's std division) is warned
    about on stderr."""
    from tosca_mlmt.config import explain_lines, load_config

    if list_presets:
        from tosca_mlmt.config.presets import describe, preset_files

        found = preset_files()
        if not found:
            raise ConfigError("no presets installed with this package (configs/ is missing)")
        width = max(map(len, found))
        for name, path in found.items():
            print(f"{name:{width}}  {describe(path)}".rstrip())
        return
    if pattern is not None and not explain:
        raise ConfigError(f"a field pattern ({pattern!r}) filters --explain: mlmt config --explain {pattern}")
    if diff is not None:
        from tosca_mlmt.config.origin import diff_lines, source_name

        for line in diff_lines(load_config(config, parse_sets(set_)), load_config(diff), source_name(diff)):
            print(line)
        return
    if explain:
        cfg = load_config(config, parse_sets(set_)) if config is not None or set_ else None
        for line in explain_lines(cfg, pattern):
            print(line)
        return
    import yaml

    print(yaml.safe_dump(load_config(config, parse_sets(set_)).to_dict(), sort_keys=False))


# Registered here, after the commands above, so that `mlmt --help` lists them in this order. The
# commands that load models (and so vLLM, transformers, DeepSpeed) keep stdout for their results
# (common.results_on_stdout); config, analyze and snapshots print results only.
app.command("train-lower")(user_errors(results_on_stdout(train_lower)))
app.command("eval")(user_errors(results_on_stdout(eval_cmd)))
app.command("train-joint")(user_errors(results_on_stdout(train_joint)))
app.command("analyze")(user_errors(analyze))
app.command("train-upper")(user_errors(results_on_stdout(train_upper)))
app.command("export")(user_errors(results_on_stdout(export)))
app.command("chat")(user_errors(results_on_stdout(chat)))


def main() -> None:  # pragma: no cover - console entry point
    common.STANDALONE = True
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
