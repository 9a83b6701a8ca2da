"""``mlmt export``: merge a saved LoRA adapter into its base and write a standalone HF model.

The result loads with plain ``AutoModelForCausalLM.from_pretrained`` (no peft, no tosca-mlmt):
safetensors weights, config, generation config, the tokenizer and a model card. The merge is
done in fp32 whatever the output dtype, so a bf16 base does not lose the LoRA delta's low bits
before the final cast.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tosca_mlmt.errors import ModelError
from tosca_mlmt.fsutil import atomic_dir
from tosca_mlmt.models.artefacts import ADAPTER_CONFIG, META_FILE, check_base, read_meta, render_card, resolve_base
from tosca_mlmt.models.loading import stored_weights_sha, weights_fingerprint

ROLES = ("solver", "writer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WRITER_EXTRAS = ("strategies.json", "q_head.safetensors")  # kept beside the weights; transformers ignores them


@dataclass
class Merged:
    """What ``export_merged``'s ``card`` hook computes the card's extra facts from."""

    folder: Path  # the adapter folder
    role: str
    tokenizer: object  # the exported tokenizer (its chat template is the one training rendered)
    eos_ids: list[int]  # as PolicyPair.eos_ids gives them: the generation config's, then the tokenizer's
    fingerprints: Callable[[], dict]  # the exported weights as an eval snapshot fingerprints its models


def adapter_fingerprints(folder: Path, role: str, base_sha: Callable[[], str]) -> dict:
    """``PolicyPair.fingerprint(role)`` of an adapter folder loaded on a base whose stored weights hash to
    ``base_sha()``, less the machine path: what an eval's snapshot records of the weights it ran."""
    from safetensors.torch import load_file

    fp = {"base_sha": base_sha(), "adapter_sha": weights_fingerprint(load_file(folder / "adapter_model.safetensors"))}
    if role == "writer" and (folder / "q_head.safetensors").exists():
        fp["q_head_sha"] = weights_fingerprint(load_file(folder / "q_head.safetensors"))
    return fp


def adapter_folder(path: Path, role: str | None) -> tuple[Path, str]:
    """(adapter folder, role) for an adapter folder or a run folder holding ``<role>/``."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).exists():
        sub = path / (role or "solver")
        if not (sub / ADAPTER_CONFIG).exists():
            raise ModelError(f"{path} is not an adapter folder (no {ADAPTER_CONFIG}) nor a run folder with "
                             f"{sub.name}/{ADAPTER_CONFIG}")
        path = sub
    recorded = read_meta(path).get("role") or ("writer" if (path / "strategies.json").exists() else None)
    if role and recorded and role != recorded:
        raise ModelError(f"{path} holds a {recorded} adapter, not a {role} (drop --role or pass --role {recorded})")
    role = role or recorded or "solver"
    if role not in ROLES:
        raise ModelError(f"--role {role}: expected one of {', '.join(ROLES)}")
    return path, role


def export_merged(adapter: str | Path, out: str | Path, role: str | None = None, base: str | None = None,
                  dtype: str = "auto", card: Callable[[Merged], dict] | None = None) -> dict:
    """Merge ``adapter`` into its base (recorded in the folder, or ``base``) and write the
    model to ``out``. Returns the metadata written to ``out/tosca_mlmt.json``; ``card`` adds to it
    (held-out evals, the prompt format: pipelines/model_card.py), and the card renders it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, role = adapter_folder(Path(adapter), role)
    out = Path(out)
    if dtype not in DTYPES:
        raise ModelError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out} exists and is not an empty folder; choose another --out")
    base_path = resolve_base(folder, base)
    base_sha = functools.cache(lambda: stored_weights_sha(base_path))  # an 8B base is hashed once, if at all
    check_base(folder, base or _recorded_base(folder), base_path, base_sha)
    # what the base was saved in is the default output dtype (the loaded config says float32 now)
    stored_cfg = json.loads((base_path / "config.json").read_text())
    stored = stored_cfg.get("dtype") or stored_cfg.get("torch_dtype") or "float32"
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    try:
        merged = PeftModel.from_pretrained(model, folder).merge_and_unload()
    except (ValueError, RuntimeError, KeyError) as e:  # shapes or module names of another base
        raise ModelError(f"{folder} does not fit the base {base_path} ({str(e).splitlines()[0][:200]})") from None
    target = getattr(torch, str(stored) if dtype == "auto" else dtype, None)
    target = target if isinstance(target, torch.dtype) else torch.float32
    merged = merged.to(target)
    tok_src = folder if (folder / "tokenizer_config.json").exists() else base_path
    tok = AutoTokenizer.from_pretrained(tok_src)
    if tok.pad_token_id is not None:  # what PolicyPair sets on its bases; generate() needs it for batches
        merged.generation_config.pad_token_id = tok.pad_token_id
    meta = {**read_meta(folder), "kind": "merged", "role": role,
            "merged_sha": weights_fingerprint(merged.state_dict()), "dtype": str(target).removeprefix("torch.")}
    meta.setdefault("base", _recorded_base(folder))
    if base:  # a local --base is named by its folder name only: no machine path in the card
        meta["base_at_export"] = base if not Path(base).expanduser().is_absolute() else Path(base).name
    if card is not None:
        eos = merged.generation_config.eos_token_id
        eos = [i for i in (list(eos) if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
        eos += [tok.eos_token_id] if tok.eos_token_id is not None and tok.eos_token_id not in eos else []
        meta.update(card(Merged(folder, role, tok, eos, functools.cache(
            lambda: adapter_fingerprints(folder, role, base_sha)))))
    with atomic_dir(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if role == "writer":
            for name in WRITER_EXTRAS:
                if (folder / name).exists():
                    shutil.copy2(folder / name, tmp / name)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        (tmp / "README.md").write_text(render_card(meta, merged=True))
    return meta


def _recorded_base(folder: Path) -> str:
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "?"
    except (OSError, ValueError):
        return "?"
