"""``mlmt export``: a saved solver/writer adapter merged into its base as a standalone HF model
(the work is in ``tosca_mlmt.models.export``; the CLI reaches the library through pipelines/). The
card gets the held-out evals of the exported weights and the prompt format (pipelines/model_card.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.models.export import Merged, adapter_folder, export_merged
from tosca_mlmt.pipelines.model_card import eval_facts, find_evals, prompt_format, read_eval
from tosca_mlmt.pipelines.support.drift import read_run_config


def export(adapter: Path, out: Path, role: str | None = None, base: str | None = None, dtype: str = "auto",
           evals: list[Path] | None = None) -> dict:
    """Write the merged model to ``out``; returns its metadata (role, base, fingerprints, dtype).
    ``evals``: ``mlmt eval`` folders to report (default: those beside the run that ran these weights)."""
    folder, _ = adapter_folder(Path(adapter), role)
    cfg, known = config_beside(folder)
    return export_merged(adapter, out, role=role, base=base, dtype=dtype, card=card_facts(cfg, known, evals))


def config_beside(folder: Path) -> tuple[Config, bool]:
    """The config of the run an adapter folder sits in (its prompts, task), and whether it is that:
    without a readable ``config.yaml`` beside it, the default config stands in (the card says so)."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.evaluate import run_config

    run = Path(folder).parent
    if (run / "config.yaml").exists():
        try:
            return run_config(run, flag="--adapter")[0], True
        except ConfigError as e:
            warnings.warn(f"{run}/config.yaml: {e}; the card's prompts are shown for the default config", stacklevel=2)
    return load_config(None, {}), False


def card_facts(cfg: Config, config_known: bool, evals: list[Path] | None):
    """``export_merged``'s card hook. Given ``evals`` are read now, so a bad one fails before the merge;
    without, eval folders in and beside the run are searched for those that ran the exported weights."""
    given = [read_eval(p) for p in evals] if evals else None

    def facts(m: Merged) -> dict:
        records = given
        if records is None:
            records = []
            run = m.folder.parent
            for path in find_evals([run, run.parent], m.role, m.fingerprints):
                try:
                    records.append(read_eval(path))
                except ConfigError as e:  # found, not asked for: the export goes on without it
                    warnings.warn(f"{e}; left out of the card", stacklevel=2)
        out = {}
        try:
            out["prompt_format"] = prompt_format(cfg, m, config_known)
        except Exception as e:  # noqa: BLE001 (a task's own code renders the message: the merge must not be lost)
            warnings.warn(f"the card's prompt format could not be rendered ({type(e).__name__}: {e}); it is left out",
                          stacklevel=2)
        if records:
            out["held_out_evals"] = eval_facts(records, m.role, m.fingerprints(), m.folder, explicit=given is not None)
            out["evals_given"] = given is not None
        return out

    return facts


def role_base(model: dict, role: str) -> str:
    """The base model ``role`` runs on in a config's ``model`` section (writer '' = the solver's)."""
    return (model.get("writer") or model.get("solver") or "") if role == "writer" else model.get("solver") or ""


def export_run(run: Path, out: Path, cfg: Config, role: str | None = None, base: str | None = None,
               dtype: str = "auto", evals: list[Path] | None = None) -> dict:
    """``export --run``: the run's ``<role>/`` (default solver) merged into the base of ``cfg``, the
    run's config (``evaluate.run_config``). That is the base the adapter records unless ``-c``/``--set``
    changed model.solver/model.writer from what training used (the command warned, naming it): then the
    changed one, as ``--base`` would. ``base`` (--base) wins over both. ``evals`` as in ``export``."""
    role = role or "solver"
    if base is None and (Path(run) / "config.yaml").exists():
        trained = role_base(read_run_config(Path(run), "--run")[0].get("model") or {}, role)
        wanted = role_base(cfg.to_dict()["model"], role)
        base = wanted if wanted and wanted != trained else None
    known = (Path(run) / "config.yaml").exists()  # else cfg is -c's or the default (run_config warned)
    return export_merged(run, out, role=role, base=base, dtype=dtype, card=card_facts(cfg, known, evals))
