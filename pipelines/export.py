"""``mlmt export``: a saved solver/writer adapter merged into its base as a standalone HF model
(the work is in ``tosca_mlmt.models.export``; the CLI reaches the library through pipelines/)."""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.models.export import export_merged


def export(adapter: Path, out: Path, role: str | None = None, base: str | None = None, dtype: str = "auto") -> dict:
    """Write the merged model to ``out``; returns its metadata (role, base, fingerprints, dtype)."""
    return export_merged(adapter, out, role=role, base=base, dtype=dtype)
