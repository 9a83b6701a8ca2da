"""``mlmt export``: merge a trained LoRA adapter into its base; registered in ``cli/main.py``.
Messages go to stderr; stdout's last line is the output folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import CONFIG, SET, command_config, err, out_folder, parse_sets, print_result
from tosca_mlmt.errors import ConfigError


def export(
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A saved solver/writer folder (e.g. "
                                           "runs/mlmt/solver), or a run folder holding solver/ and writer/."),
    out: Path = typer.Option(..., "--out", "-o", help="New folder for the merged model (must not exist or be empty).", parser=out_folder),
    run: Optional[Path] = typer.Option(None, "--run", help="A training run folder (instead of --adapter): its "
                                       "solver/ or writer/ (--role) on the base of the config it trained with "
                                       "(config.yaml; -c and --set go on top, with a warning naming each field "
                                       "they change)."),
    role: Optional[str] = typer.Option(None, "--role", help="solver or writer: which folder of a run folder to "
                                                            "take; checked against what an adapter folder records."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model (embedded name, org/name hub id in the local "
                                                            "cache, or folder) instead of the one the adapter records."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights dtype: auto (the base's), float32, bfloat16, float16."),
    evals: list[Path] = typer.Option([], "--eval", help="An `mlmt eval --out` folder of these weights, reported in "
                                     "the model card (repeatable; checked against the weights' fingerprints). "
                                     "Default: eval folders in and beside the run that ran exactly these weights."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
):
    """Merge a LoRA adapter into its base and write a standalone Hugging Face model folder.

    The folder (safetensors, config, tokenizer, model card) loads with plain
    transformers AutoModelForCausalLM; nothing is downloaded. Prints the folder last on stdout."""
    if (adapter is None) == (run is None):
        raise ConfigError("export: give --adapter (an adapter or run folder) or --run (a run folder and its config)")
    if run is None and (config is not None or set_):
        raise ConfigError("export: -c/--set apply with --run only (an adapter folder carries no config)")
    if run is not None:
        from tosca_mlmt.pipelines.export import export_run

        cfg = command_config(config, parse_sets(set_), run=run)
        meta = export_run(run, out, cfg, role=role, base=base, dtype=dtype, evals=evals or None)
    else:
        from tosca_mlmt.pipelines.export import export as merge

        meta = merge(adapter, out, role=role, base=base, dtype=dtype, evals=evals or None)
    err.print(f"export: {meta['role']} adapter merged into {meta.get('base_at_export') or meta['base']} "
              f"({meta['dtype']}, weights {meta['merged_sha']})", highlight=False)
    print_result(out)
