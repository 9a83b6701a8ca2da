"""``mlmt export``: a saved solver/writer adapter merged into its base as a standalone HF model
(the work is in ``tosca_mlmt.models.export``; the CLI reaches the library through pipelines/)."""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.config import Config
from tosca_mlmt.models.export import export_merged
from tosca_mlmt.pipelines.rundir import read_run_config


def export(adapter: Path, out: Path, role: str | None = None, base: str | None = None, dtype: str = "auto") -> dict:
    """Write the merged model to ``out``; returns its metadata (role, base, fingerprints, dtype)."""
    return export_merged(adapter, out, role=role, base=base, dtype=dtype)


def role_base(model: dict, role: str) -> str:
    """The base model ``role`` runs on in a config's ``model`` section (writer '' = the solver's)."""
    return (model.get("writer") or model.get("solver") or "") if role == "writer" else model.get("solver") or ""


def export_run(run: Path, out: Path, cfg: Config, role: str | None = None, base: str | None = None,
               dtype: str = "auto") -> dict:
    """``export --run``: the run's ``<role>/`` (default solver) merged into the base of ``cfg``, the
    run's config (``evaluate.run_config``). That is the base the adapter records unless ``-c``/``--set``
    changed model.solver/model.writer from what training used (the command warned, naming it): then the
    changed one, as ``--base`` would. ``base`` (--base) wins over both."""
    role = role or "solver"
    if base is None and (Path(run) / "config.yaml").exists():
        trained = role_base(read_run_config(Path(run), "--run")[0].get("model") or {}, role)
        wanted = role_base(cfg.to_dict()["model"], role)
        base = wanted if wanted and wanted != trained else None
    return export_merged(run, out, role=role, base=base, dtype=dtype)
