"""The two policies of the hierarchy: solver (LL) and feedback writer (HL).

By default both are LoRA adapters on one shared base model (peft, adapter names
"solver" and "writer"), so the pair costs one copy of the base weights and the frozen
reference policy of either is the base with its adapter disabled. Different base
models are allowed; each then gets its own base and adapter.

The writer also owns a small Q head over the discrete strategy set (q_head.py, trained by
``train-upper``); with no trained head, collection picks strategies uniformly. Merging an
adapter into its base for an engine's weight sync is merge.py's, which takes the pair.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from tosca_mlmt.config import ModelConfig
from tosca_mlmt.models.artefacts import check_base
from tosca_mlmt.models.features import writer_state_features
from tosca_mlmt.models.head import check_output_head
from tosca_mlmt.models.loading import attention_implementation, resolve_model, stored_weights_sha, weights_fingerprint
from tosca_mlmt.models.merge import SyncPlan, sync_plan
from tosca_mlmt.models.q_head import QHead
from tosca_mlmt.parallel import compute_device, full_parameters, is_main
from tosca_mlmt.precision import model_dtype
from tosca_mlmt.prompts import use_chat_template
from tosca_mlmt.seeds import seeded

ROLES = ("solver", "writer")
Q_HEAD_FILE = "q_head.safetensors"
STRATEGIES_FILE = "strategies.json"
LORA_B = {"lora_B", "lora_embedding_B"}  # the factors that start at zero


def saved_strategies(folder: str | Path) -> list[dict] | None:
    """The strategy list a saved writer adapter carries (None: none saved, or saved without one), read
    without loading any weights: callers can check a strategy name before a model loads."""
    path = Path(folder) / STRATEGIES_FILE
    return (json.loads(path.read_text()) or None) if path.exists() else None


class PolicyPair:
    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype | None = None):
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.cfg = cfg
        self.dtype = dtype or model_dtype(cfg.dtype)
        # as configured (embedded name, hub id or folder): saved adapters record it, not the path
        self.base_names = {"solver": cfg.solver, "writer": cfg.writer or cfg.solver}
        self.base_paths = {"solver": resolve_model(cfg.solver)}
        self.base_paths["writer"] = resolve_model(cfg.writer) if cfg.writer else self.base_paths["solver"]
        self.shared_base = self.base_paths["writer"] == self.base_paths["solver"]
        self._base_fp: dict[Path, str] = {}  # base folder -> stored_weights_sha, hashed once
        self._tok = {r: AutoTokenizer.from_pretrained(self.base_paths[r]) for r in ROLES}
        for r in ROLES:  # before any weights load: a base model without a template fails in a second
            use_chat_template(self._tok[r], cfg.chat_template, f"model.{r} '{self.base_names[r]}'")
        # one LoraConfig per role: peft keeps the object and writes its base's path into it, so a shared
        # one would name the writer's base for the solver too (peft reads it to check the vocabulary)
        lora = lambda: LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,  # noqa: E731
                                  target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")
        adapters = {"solver": cfg.solver_adapter, "writer": cfg.writer_adapter}
        # LoRA A matrices are random: seed them so a fresh pair has a reproducible fingerprint,
        # without reseeding the process (what the caller draws next does not depend on us).
        self._models: dict[str, nn.Module] = {}
        with seeded(seed):
            for role in ROLES:
                if role == "writer" and self.shared_base:
                    pm = self._models["solver"]
                    if adapters[role]:
                        pm.load_adapter(adapters[role], adapter_name=role, is_trainable=True)
                    else:
                        pm.add_adapter(role, lora())
                    self._models[role] = pm
                    continue
                base = AutoModelForCausalLM.from_pretrained(self.base_paths[role], dtype=self.dtype,
                                                            attn_implementation=attention_implementation(self.base_paths[role]))
                # Sampling is the run's own (solver_sampling / writer_sampling) and nothing else: generate()
                # fills every field it finds unset from the model's generation config, so a model card's
                # defaults (Qwen2.5's repetition_penalty 1.05, ...) would make the HF engine sample another
                # distribution than the log-probs it records. The stop and pad ids are all that is kept.
                gen = base.generation_config
                base.generation_config = GenerationConfig(bos_token_id=gen.bos_token_id, eos_token_id=gen.eos_token_id,
                                                          pad_token_id=self._tok[role].pad_token_id)
                if adapters[role]:
                    pm = PeftModel.from_pretrained(base, adapters[role], adapter_name=role, is_trainable=True)
                else:
                    pm = get_peft_model(base, lora(), adapter_name=role)
                pm.eval()
                # the GPU where there is one (parallel.compute_device): the HF engine generates
                # and every scoring forward runs there; batches cross at each call (tensors.onto)
                self._models[role] = pm.to(compute_device())
        for role in ROLES:
            if adapters[role]:
                check_base(Path(adapters[role]), self.base_names[role], self.base_paths[role],
                           lambda role=role: self.base_sha(role))
            # A loaded adapter's config names its base portably ("tiny-random", "org/name"); peft
            # reads that name when saving to check the vocabulary, and for a name that is no folder
            # it asks the hub. Point it at the local folder; the saved file gets the portable name.
            self._models[role].peft_config[role].base_model_name_or_path = str(self.base_paths[role])
        for role in ROLES[: 1 if self.shared_base else 2]:  # trainer log-probs = the model's own, or stop here
            with full_parameters(self._models[role]):
                check_output_head(self._models[role], self._tok[role].encode("The answer is: 42", add_special_tokens=False),
                                  f"model.{role} '{self.base_names[role]}'")
        self.strategies: list[dict] | None = None
        self.q_head: QHead | None = None
        self.q_decisions = 0  # logged decisions the Q head was fitted on (episode.min_q_decisions gates its use)
        if cfg.writer_adapter:
            self._load_writer_extras(Path(cfg.writer_adapter))
        self.sync_plans: dict[str, SyncPlan] = {}  # where a sync reads each role's tensors (merge.sync_plan)
        # provenance a stage hands over (describe) for the model card of what save_role writes
        self.card_info: dict[str, dict] = {r: {} for r in ROLES}

    # ------------------------------------------------------------------ access
    def tokenizer(self, role: str):
        return self._tok[role]

    def model(self, role: str) -> nn.Module:
        return self._models[role]

    @contextlib.contextmanager
    def use(self, role: str):
        """Activate ``role``'s adapter on its (possibly shared) base for the block."""
        m = self._models[role]
        prev = m.active_adapter
        m.set_adapter(role)
        try:
            yield m
        finally:
            m.set_adapter(prev)

    def pad_id(self, role: str) -> int:
        pad = self._tok[role].pad_token_id
        return 0 if pad is None else pad

    def eos_ids(self, role: str) -> list[int]:
        m = self._models[role]
        ids = m.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
        tok_eos = self._tok[role].eos_token_id
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return [i for i in ids if i is not None]

    # ------------------------------------------------------------------ provenance
    def adapter_state(self, role: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        with full_parameters(self._models[role]):
            return {k: v.detach().clone() for k, v in
                    get_peft_model_state_dict(self._models[role], adapter_name=role).items()}

    def adapter_config(self, role: str) -> dict:
        """``role``'s live peft LoraConfig as plain JSON types (what vLLM's PEFTHelper reads)."""
        d = self._models[role].peft_config[role].to_dict()
        return {k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in d.items()}

    def base_sha(self, role: str) -> str:
        """Fingerprint of ``role``'s base weights as stored (computed once per base)."""
        path = self.base_paths[role]
        if path not in self._base_fp:
            self._base_fp[path] = stored_weights_sha(path)
        return self._base_fp[path]

    def fingerprint(self, role: str) -> dict[str, str]:
        path = self.base_paths[role]
        fp = {"base": str(path), "base_sha": self.base_sha(role),
              "adapter_sha": weights_fingerprint(self.adapter_state(role))}
        if role == "writer" and self.q_head is not None:
            fp["q_head_sha"] = weights_fingerprint(self.q_head.state_dict())
        return fp

    def full_weights(self):
        """Every model's weights whole for a block (ZeRO-3; else a no-op): wrap rollouts, scoring
        and syncs in it on every rank, so the forwards inside need no collectives."""
        return full_parameters(*{id(m): m for m in self._models.values()}.values())

    def has_trained_adapter(self, role: str) -> bool:
        """False while every LoRA B matrix (linear or embedding) is zero, i.e. the LoRA layers
        still leave the base as it is; read in place, no copies."""
        with full_parameters(self._models[role]):
            return any(bool(t().any()) for name, t in sync_plan(self, role).lora_tensors if LORA_B & set(name.split(".")))

    # ------------------------------------------------------------------ engine syncs (the merge: merge.py)
    def adapted_modules(self, role: str) -> set[str] | None:
        """HF names of the base modules whose weights ``role``'s adapter changes (its LoRA
        layers), or None when the adapter also trains whole modules or tokens (peft's
        modules_to_save / trainable tokens): then no subset of modules covers what it changes."""
        plan = sync_plan(self, role)
        return None if plan.aux else set(plan.lora_modules)

    def adapter_key(self, role: str) -> str:
        """A cheap identity of ``role``'s live adapter, hence of the merged weights it serves (the
        base is frozen): "base" while every LoRA B matrix is zero (solver and writer then share
        one weight set, whatever their random A matrices), else a sha256 of the LoRA tensors read
        in place (no state-dict walk: a vLLM engine asks before every call). An adapter that also
        trains whole modules or tokens is hashed from peft's state dict, which holds those too, and
        is never "base"."""
        plan = sync_plan(self, role)
        if plan.aux:
            return f"{role}:{weights_fingerprint(self.adapter_state(role))}"
        # one gather under ZeRO-3 for both reads (has_trained_adapter's own block is then a no-op)
        with full_parameters(self._models[role]):
            if not self.has_trained_adapter(role):
                return "base"
            return f"{role}:{weights_fingerprint({name: t() for name, t in plan.lora_tensors})}"

    # ------------------------------------------------------------------ saving
    def describe(self, role: str, **info) -> None:
        """Record provenance for ``role``'s model card (stage, config, snapshots, eval,
        eval_source, within); later calls add to or replace earlier keys."""
        self.card_info[role].update(info)

    def save_role(self, role: str, folder: str | Path) -> Path:
        """Write ``role``'s adapter (and, for the writer, its Q head and strategy list) so that
        ``model.solver_adapter`` / ``model.writer_adapter`` can load it, with its tokenizer,
        metadata and model card (models/artefacts.py). Atomic: built in a sibling temp folder
        and renamed. Every rank calls it."""
        folder = Path(folder)
        # Collective under ZeRO-3 (every rank gathers); rank 0 alone writes.
        with full_parameters(self._models[role]):
            if is_main():
                self._write_role(role, folder)
        return folder

    def _write_role(self, role: str, folder: Path) -> None:
        import os

        from safetensors.torch import save_file

        from tosca_mlmt.fsutil import atomic_dir
        from tosca_mlmt.models.artefacts import finish_adapter_folder

        pc = self._models[role].peft_config[role]  # the live adapter's shape: a loaded one keeps its own
        lora = {"r": pc.r, "alpha": pc.lora_alpha, "modules": len(pc.target_modules)
                if isinstance(pc.target_modules, (set, list, tuple)) else pc.target_modules}
        with atomic_dir(folder) as tmp:
            self._models[role].save_pretrained(tmp, selected_adapters=[role])
            # peft nests non-"default" adapters in a subfolder named after the adapter
            nested = tmp / role
            if nested.is_dir():
                for f in nested.iterdir():
                    os.replace(f, tmp / f.name)
                nested.rmdir()
            if role == "writer":
                (tmp / STRATEGIES_FILE).write_text(json.dumps(self.strategies, indent=2) if self.strategies else "null")
                if self.q_head is not None:
                    save_file({k: v.contiguous() for k, v in self.q_head.state_dict().items()}, tmp / Q_HEAD_FILE,
                              metadata={"decisions": str(self.q_decisions)})
            finish_adapter_folder(tmp, folder, role=role, base_name=self.base_names[role],
                                  base_path=self.base_paths[role], tokenizer=self._tok[role],
                                  lora=lora,
                                  base_sha=self.base_sha(role), info=self.card_info[role])

    def load_role(self, role: str, folder: str | Path) -> None:
        """Load weights written by :meth:`save_role` into the live adapter (and, for the writer,
        its Q head and strategies), e.g. when a run resumes."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        folder = Path(folder)
        with full_parameters(self._models[role], modify=True):
            set_peft_model_state_dict(self._models[role], load_file(folder / "adapter_model.safetensors"),
                                      adapter_name=role)
        if role == "writer":
            self._load_writer_extras(folder)

    # ------------------------------------------------------------------ writer extras
    def _load_writer_extras(self, folder: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        if (folder / STRATEGIES_FILE).exists():
            self.strategies = saved_strategies(folder)
        if (folder / Q_HEAD_FILE).exists():
            self.q_head = QHead.from_state_dict(load_file(folder / Q_HEAD_FILE))
            with safe_open(folder / Q_HEAD_FILE, "pt") as f:
                # heads saved before the count existed were fitted on an unknown amount: trust them
                self.q_decisions = int((f.metadata() or {}).get("decisions", 10**9))

    @torch.no_grad()
    def q_values(self, prompts: list[list[int]], signals: list[int] | None = None,
                 batch_size: int = 16) -> torch.Tensor | None:
        """Q(s, .) for writer states given as token ids (and, for a head with a signal table, each
        state's writer_signal); None when the writer has no Q head. The features are the
        trainer's (models/features.py), so this is the Q train-upper fitted."""
        if self.q_head is None:
            return None
        with self.use("writer") as m:
            h = writer_state_features(m, prompts, self.pad_id("writer"), batch_size=batch_size)
        return self.q_head(h, None if signals is None else torch.tensor(signals))
