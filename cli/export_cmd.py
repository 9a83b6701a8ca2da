"""``mlmt export``: merge a trained LoRA adapter into its base; registered in ``cli/main.py``.
Messages go to stderr; stdout's last line is the output folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import err, out_folder


def export(
    adapter: Path = typer.Option(..., "--adapter", help="A saved solver/writer folder (e.g. runs/mlmt/solver), "
                                                        "or a run folder holding solver/ and writer/."),
    out: Path = typer.Option(..., "--out", "-o", help="New folder for the merged model (must not exist or be empty).", parser=out_folder),
    role: Optional[str] = typer.Option(None, "--role", help="solver or writer: which folder of a run folder to "
                                                            "take; checked against what an adapter folder records."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model (embedded name, org/name hub id in the local "
                                                            "cache, or folder) instead of the one the adapter records."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights dtype: auto (the base's), float32, bfloat16, float16."),
):
    """Merge a LoRA adapter into its base and write a standalone Hugging Face model folder.

    The folder (safetensors, config, tokenizer, model card) loads with plain
    transformers AutoModelForCausalLM; nothing is downloaded. Prints the folder last on stdout."""
    from tosca_mlmt.pipelines.export import export as run

    meta = run(adapter, out, role=role, base=base, dtype=dtype)
    err.print(f"export: {meta['role']} adapter merged into {meta.get('base_at_export') or meta['base']} "
              f"({meta['dtype']}, weights {meta['merged_sha']})", highlight=False)
    print(out)
