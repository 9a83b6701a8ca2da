"""What a saved solver/writer folder carries besides peft's weights, so it stands on its own.

* ``adapter_config.json``'s ``base_model_name_or_path`` names the base portably: the embedded
  or debug name, the hub id (with the commit in peft's ``revision`` field), or, for a plain
  local folder, a path relative to the saved folder. Never an absolute path of the machine
  that trained it: a run folder is copied between machines and its adapters must still say
  which base they belong to.
* the tokenizer, so the folder (and what ``mlmt export`` makes of it) decodes on its own;
* ``tosca_mlmt.json``: role, base reference and fingerprint, stage, config hash, source
  snapshots and eval numbers, machine-readable (``mlmt export`` reads it);
* ``README.md``: a model card from the same facts, instead of peft's empty template (its Evaluation
  and Prompt format sections: models/card_sections.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable

from tosca_mlmt import __version__
from tosca_mlmt.errors import ModelError
from tosca_mlmt.fsutil import atomic_write_text
from tosca_mlmt.models.card_sections import evaluation_lines, prompt_lines
from tosca_mlmt.models.hub import hub_id_of, split_id
from tosca_mlmt.models.loading import DEBUG, EMBEDDED, resolve_model

META_FILE = "tosca_mlmt.json"
META_FORMAT = 1
ADAPTER_CONFIG = "adapter_config.json"
SNAPSHOTS_SHOWN = 20  # an online train-lower run writes one snapshot per iteration; the card lists the first few

ROLE_TEXT = {
    "solver": "the solver (low level): answers a problem, then refines its answer after the writer's feedback",
    "writer": "the feedback writer (high level): picks a strategy and writes a critique or hint for the solver",
}
STAGE_METHOD = {
    "train-lower": "PPO on multi-turn solve -> feedback -> refine episodes, with the KL-maximisation "
                   "context-dependency bonus (tosca-mlmt `train-lower`)",
    "train-upper": "offline strategic Q-learning with advantage-weighted regression of the feedback text "
                   "on logged episodes (tosca-mlmt `train-upper`)",
    "train-joint": "alternating rounds of collect, train-upper and train-lower (tosca-mlmt `train-joint`)",
}


def config_hash(cfg) -> str:
    """sha256 of the resolved config without ``logging.*`` (which only decides what is shown
    and where, and may change on resume), so equal hashes mean equal training."""
    d = {k: v for k, v in cfg.to_dict().items() if k != "logging"}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def base_reference(name: str, path: Path, folder: Path) -> tuple[str, str | None]:
    """(portable base reference, revision) for a base configured as ``name`` and found at
    ``path``, as written into an adapter folder that will live at ``folder``."""
    if name in EMBEDDED or name in DEBUG:
        return name, None
    hub = hub_id_of(path)  # a hub id, or a local path that points into a hub cache
    if hub is not None:
        return hub
    rel = os.path.relpath(Path(path).absolute(), Path(folder).absolute())
    return (rel if rel.startswith("..") else os.path.join(".", rel)), None  # "./a/b", never read as hub id a/b


def resolve_base(folder: Path, override: str | None = None) -> Path:
    """The base model folder an adapter folder belongs to (``override``: a model name, hub id
    or folder that replaces the recorded one)."""
    if override:
        return resolve_model(override)
    folder = Path(folder)
    meta = read_meta(folder)
    if meta.get("base"):
        ref, rev = meta["base"], meta.get("base_revision")
    else:  # an adapter folder from peft or from an older tosca-mlmt
        try:
            cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{folder}: no readable {ADAPTER_CONFIG} ({e}); is it an adapter folder?") from None
        ref, rev = cfg.get("base_model_name_or_path") or "", cfg.get("revision")
    if not ref:
        raise ModelError(f"{folder} does not record its base model; pass it with --base")
    if ref in EMBEDDED or ref in DEBUG:
        return resolve_model(ref)
    if split_id(ref) is not None and not (folder / ref).exists():
        return resolve_model(f"{ref}@{rev}" if rev else ref)
    local = (folder / ref) if not os.path.isabs(ref) else Path(ref)
    if not (local / "config.json").exists():
        raise ModelError(f"{folder}: its base model '{ref}' is not at {local.absolute()} (the run folder moved away "
                         "from a base given as a local folder?); pass the base with --base")
    return local


def check_base(folder: Path, name: str, path: Path, sha: Callable[[], str] | None = None) -> None:
    """Warn when an adapter folder records another base than the one it is loaded on: another named
    base (two bases of one architecture take each other's adapters without a shape error; local
    folders are not compared by name, their recorded paths being relative to where the run was), or,
    with ``sha`` (the base's stored_weights_sha, computed only when the folder records one), other
    weights: another revision in the same folder, a base re-saved in another dtype, another model."""
    meta = read_meta(folder)
    rec, rev = meta.get("base"), meta.get("base_revision")
    if rec and not rec.startswith("."):
        ref, cur_rev = base_reference(name, path, folder)
        if not ref.startswith(".") and (ref != rec or (rev and cur_rev and rev != cur_rev)):
            show = lambda r, v: f"'{r}'" + (f" at {v[:12]}" if v else "")  # noqa: E731
            warnings.warn(f"{folder} was trained on base {show(rec, rev)} but is loaded on {show(ref, cur_rev)}",
                          stacklevel=3)
    want = meta.get("base_sha")
    if want and sha is not None and (got := sha()) != want:
        warnings.warn(f"{folder} was trained on base weights {want}, but {path} holds weights {got}: the policy "
                      "it gives is not the one that was trained", stacklevel=3)


def read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((Path(folder) / META_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def finish_adapter_folder(tmp: Path, folder: Path, *, role: str, base_name: str, base_path: Path, tokenizer,
                          lora: dict, base_sha: str, info: dict) -> dict:
    """Complete a folder peft just saved into ``tmp`` (to be renamed to ``folder``): portable
    base reference, tokenizer, metadata and card. Returns the metadata."""
    from safetensors.torch import load_file

    from tosca_mlmt.models.loading import weights_fingerprint

    ref, rev = base_reference(base_name, base_path, folder)
    cfg_file = tmp / ADAPTER_CONFIG
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"], cfg["revision"] = ref, rev
    atomic_write_text(cfg_file, json.dumps(cfg, indent=2, sort_keys=True))
    tokenizer.save_pretrained(tmp)
    meta = {"format": META_FORMAT, "kind": "adapter", "role": role, "base": ref, "base_revision": rev,
            "base_sha": base_sha, "adapter_sha": weights_fingerprint(load_file(tmp / "adapter_model.safetensors")),
            "lora": lora, "tosca_mlmt_version": __version__, **card_fields(info)}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    (tmp / "README.md").write_text(render_card(meta))
    return meta


def repoint_base(tmp: Path, saved_at: Path, folder: Path) -> None:
    """An adapter folder saved at ``saved_at`` and copied into ``tmp`` (to be renamed to ``folder``):
    a base recorded as a path relative to ``saved_at`` is rewritten relative to ``folder``, in the
    adapter config, the metadata and the card. Names, hub ids and absolute paths stay as they are."""
    cfg_file, meta = tmp / ADAPTER_CONFIG, read_meta(tmp)
    ref = meta.get("base") or ""
    if not ref.startswith(".") or os.path.isabs(ref):
        return
    rel = os.path.relpath(os.path.normpath(Path(saved_at).absolute() / ref), Path(folder).absolute())
    meta["base"] = rel if rel.startswith("..") else os.path.join(".", rel)
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = meta["base"]
    atomic_write_text(cfg_file, json.dumps(cfg, indent=2, sort_keys=True))
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    (tmp / "README.md").write_text(render_card(meta))


def card_fields(info: dict) -> dict:
    """The provenance a stage handed to ``PolicyPair.describe``, in the metadata's shape."""
    out = {"stage": info.get("stage"), "within": info.get("within"),
           "config_sha": config_hash(info["config"]) if info.get("config") is not None else None,
           "snapshots": list(info.get("snapshots") or []), "eval": dict(info.get("eval") or {}),
           "eval_source": info.get("eval_source")}
    return {k: v for k, v in out.items() if v not in (None, [], {})}


def render_card(meta: dict, merged: bool = False) -> str:
    """README.md for a saved adapter (``merged=False``) or an exported merged model."""
    role, ref, rev = meta.get("role", "solver"), meta.get("base", "?"), meta.get("base_revision")
    hub = split_id(ref) is not None and not ref.startswith(".")
    front = ["---", "library_name: " + ("transformers" if merged else "peft"), "pipeline_tag: text-generation",
             "tags:", "- tosca-mlmt", f"- {role}", "- lora"]
    if hub:
        front.append(f"base_model: {ref}")
    front.append("---")
    kind = "model (LoRA adapter merged into its base)" if merged else "LoRA adapter"
    base = f"`{ref}`" + (f" at revision `{rev}`" if rev else "")
    if ref in EMBEDDED:
        base += " (tosca-mlmt's embedded SmolLM2-135M-Instruct, converted from its Q4_1 GGUF)"
    elif ref in DEBUG:
        base += " (tosca-mlmt's random-weight debug base: its outputs are noise)"
    elif not hub:
        base += " (a local folder, relative to this one)"
    stage = meta.get("stage")
    method = STAGE_METHOD.get(stage, "none: a fresh adapter (it equals the base until trained)")
    if meta.get("within"):
        method += f"; as a step of `{meta['within']}`"
    lines = [*front, "", f"# tosca-mlmt {role} {kind}", "", f"This is {ROLE_TEXT.get(role, role)}.", "",
             "## Provenance", "", f"- base model: {base}", f"- method: {method}",
             f"- stage: `{stage or 'untrained'}`"]
    for key, label in (("config_sha", "config hash (sha256 of the resolved config without `logging`)"),
                       ("base_sha", "base weights fingerprint"), ("adapter_sha", "adapter weights fingerprint"),
                       ("merged_sha", "merged weights fingerprint"), ("tosca_mlmt_version", "tosca-mlmt version")):
        if meta.get(key):
            lines.append(f"- {label}: `{meta[key]}`")
    if meta.get("lora"):
        lines.append("- LoRA: " + ", ".join(f"{k}={v}" for k, v in meta["lora"].items()))
    snaps = meta.get("snapshots") or []
    if snaps:
        more = f" and {len(snaps) - SNAPSHOTS_SHOWN} more (all in {META_FILE})" if len(snaps) > SNAPSHOTS_SHOWN else ""
        lines.append("- source snapshots: " + ", ".join(f"`{s}`" for s in snaps[:SNAPSHOTS_SHOWN]) + more)
    lines += ["", *evaluation_lines(meta, merged)]
    if merged and meta.get("prompt_format"):
        lines += prompt_lines(meta["prompt_format"])
    lines += ["## How to load", ""] + (_load_merged(role) if merged else _load_adapter(role, ref, rev, hub))
    return "\n".join(lines) + "\n"


def _load_adapter(role: str, ref: str, rev: str | None, hub: bool) -> list[str]:
    if hub:
        base_arg = f'"{ref}"' + (f', revision="{rev}"' if rev else "")
    elif ref in EMBEDDED or ref in DEBUG:
        base_arg = f'"<the folder `mlmt setup --model {ref}` prints>"'
    else:
        base_arg = '"<the base model folder>"'
    return [f"With tosca-mlmt (`model.{role}` names the same base as above):", "", "```bash",
            f"mlmt eval --{role} THIS_FOLDER ...      # or --set model.{role}_adapter=THIS_FOLDER",
            "mlmt export --adapter THIS_FOLDER --out merged   # a standalone transformers model", "```", "",
            "With peft:", "", "```python", "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f"base = AutoModelForCausalLM.from_pretrained({base_arg})",
            'model = PeftModel.from_pretrained(base, "THIS_FOLDER")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")', "```"]


def _load_merged(role: str) -> list[str]:
    extra = (["", "The writer's Q head (`q_head.safetensors`) and strategy list (`strategies.json`) are kept next "
              "to the weights; transformers ignores them."] if role == "writer" else [])
    return ["A plain transformers model: no peft and no tosca-mlmt needed.", "", "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")', "```", *extra]
