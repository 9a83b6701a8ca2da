"""Base + LoRA merged into new tensors, for weight syncs into a rollout engine (vLLM).

An engine that serves merged weights (rollout/engines/vllm/) gets them from here: the whole
HF-named state dict, the tensors of some modules only (a delta sync), the same in layer groups
merged one at a time (a sync in buckets), or straight into row blocks of fused vLLM layers (the
direct CPU sync). Each form gives the same bits for a tensor. Every function takes the
:class:`~tosca_mlmt.models.policies.PolicyPair` and a role; where a sync reads the role's
tensors is found once per role (:func:`sync_plan`, kept on the pair) and read in place after.

Nothing here uses peft's merge/unmerge: ``w -= delta`` is not exact in floating point, so every
sync would nudge the frozen base (the reference policy). ``mlmt export`` merges a saved adapter
through peft instead, once and in fp32 (models/export.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tosca_mlmt.parallel import full_parameters


def _merged_weight(w: torch.Tensor, mod, role: str, out: torch.Tensor | None = None,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``w + scaling * B @ A``, as a new tensor or written into ``out`` (same shape and dtype as
    ``w``; ``scratch``: flat float memory of at least ``w.numel()`` elements in the adapter's dtype,
    needed when it differs from ``w``'s). For plain linear LoRA one fused addmm in the
    adapter's precision, rounded to ``w``'s dtype once at the end: peft's get_delta_weight
    makes ~4 passes over the full-size delta (product, scale, cast, add; ~2x slower on the 135M
    model, bf16 base with fp32 adapters) and rounds the delta to bf16 before adding it. Both forms
    give the same bits (tests/unit/models/test_policies.py). Embeddings and fan_in_fan_out layers, whose
    delta is no plain product, use peft's."""
    from peft.tuners.lora import Linear

    if not (isinstance(mod, Linear) and not mod.fan_in_fan_out):
        merged = w + mod.get_delta_weight(role).to(w.dtype)
        return merged if out is None else out.copy_(merged)
    a, b = mod.lora_A[role].weight, mod.lora_B[role].weight
    if out is None:
        return torch.addmm(w.to(a.dtype), b, a, alpha=mod.scaling[role]).to(w.dtype)
    # in place, on preallocated memory: fresh full-size tensors cost page faults on every sync
    acc = out if a.dtype == out.dtype else scratch[: w.numel()].view(w.shape)
    acc.copy_(w).addmm_(b, a, alpha=mod.scaling[role])
    return out if acc is out else out.copy_(acc)



def _reader(root: nn.Module, key: str):
    """Reads ``root``'s state-dict entry ``key`` from its owner at call time (a Parameter object
    may be swapped, e.g. by DeepSpeed; the owning module is not)."""
    owner, _, attr = key.rpartition(".")
    module = root.get_submodule(owner)
    return lambda: getattr(module, attr)


@dataclass(frozen=True)
class SyncPlan:
    """One role's tensors as a weight sync reads them, in state-dict order.

    ``base``: (HF key, HF module name, reader, LoRA layer adapting it or None) for every base
    tensor; ``lora_tensors``: (name, reader) of the role's LoRA A/B matrices; ``lora_modules``:
    the HF names of its LoRA layers; ``aux``: the adapter also trains whole modules or tokens."""

    base: tuple[tuple[str, str, object, object], ...]
    lora_tensors: tuple[tuple[str, object], ...]
    lora_modules: frozenset[str]
    aux: bool

    @classmethod
    def of(cls, base: nn.Module, role: str) -> "SyncPlan":
        from peft.tuners.lora import LoraLayer
        from peft.utils import AuxiliaryTrainingWrapper

        lora, aux = {}, False
        for name, mod in base.named_modules():
            aux = aux or isinstance(mod, AuxiliaryTrainingWrapper)
            if isinstance(mod, LoraLayer) and role in mod.lora_A:
                lora[f"{name}.base_layer.weight"] = (name, mod)
        modules = frozenset(name for name, _ in lora.values())
        rows, tensors, seen = [], [], set()
        for k, t in base.state_dict(keep_vars=True).items():
            if "lora_" in k:
                if k.split(".")[-2] == role or k.split(".")[-1] == role:  # lora_A.<role>.weight, lora_embedding_A.<role>
                    tensors.append((k, _reader(base, k)))
                continue
            name_mod = lora.pop(k, None)
            # A tied weight (lm_head = embed_tokens) goes once, under its first name, as a checkpoint
            # holds it: vLLM ties it itself, and some of its loaders (Gemma 2) reject the second name.
            if id(t) in seen and name_mod is None:
                continue
            seen.add(id(t))
            hf = k.replace(".base_layer.", ".")
            rows.append((hf, hf.rpartition(".")[0], _reader(base, k), None if name_mod is None else name_mod[1]))
        if lora:
            raise RuntimeError(f"LoRA layers without a base weight: {sorted(lora)[:3]}")
        return cls(tuple(rows), tuple(tensors), modules, aux)



def sync_plan(pair, role: str) -> SyncPlan:
    """Where a sync reads ``role``'s tensors, found once (kept in ``pair.sync_plans``): adapters are
    only added in ``PolicyPair.__init__``. Walking the module tree and copying peft's adapter state
    dict before every engine call made the weights-key check 0.055 s on the 135M model; reading the
    tensors in place, 0.022 s (benchmarks/speed/weight_sync.py)."""
    if role not in pair.sync_plans:
        pair.sync_plans[role] = SyncPlan.of(pair.model(role).get_base_model(), role)
    return pair.sync_plans[role]


@torch.no_grad()
def merged_state_dict(pair, role: str, modules: set[str] | None = None, lora: bool = True) -> dict[str, torch.Tensor]:
    """Base + ``role``'s LoRA deltas as an HF-named state dict (what vLLM loads): every
    tensor, or with ``modules`` only the tensors of those modules (HF module names; one
    that ``role`` does not adapt comes out as its base weight). Each tensor is the same
    whichever way it was asked for. ``lora=False``: the base alone. Computed into new tensors
    (module docstring)."""
    with full_parameters(pair.model(role)):
        return _merged(pair, role, modules, lora)


def sync_modules(pair, role: str) -> list[str]:
    """HF names of every module :func:`merged_state_dict` returns tensors of, in its order."""
    return list(dict.fromkeys(module for _, module, _, _ in sync_plan(pair, role).base))


@torch.no_grad()
def merged_parts(pair, role: str, groups: list[set[str]]) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`merged_state_dict` of each module group in turn, each merged only when the
    caller asks for it, so only one group's merged tensors need exist at a time (a vLLM sync
    in buckets). ZeRO-3 gathers once for all of them."""
    with full_parameters(pair.model(role)):
        for group in groups:
            yield _merged(pair, role, group, True)


def weight_shapes(pair, role: str) -> dict[str, tuple[int, ...]]:
    """HF module name -> the full shape of its ``weight`` (ZeRO-3 partitions included)."""
    return {module: tuple(getattr(t, "ds_shape", t.shape)) for hf, module, read, _ in sync_plan(pair, role).base
            if hf.endswith(".weight") and (t := read()) is not None}


@torch.no_grad()
def merge_into(pair, role: str, outs: dict[str, torch.Tensor]) -> None:
    """Write base + ``role``'s LoRA delta of each HF module in ``outs`` (its ``weight``) into
    the tensor given for it, e.g. a row block of a fused vLLM layer: the same bits that
    :func:`merged_state_dict` returns for it, without a new tensor per module (the direct
    vLLM sync, rollout/engines/vllm/kernels.py)."""
    rows = {module: (read, mod) for hf, module, read, mod in sync_plan(pair, role).base
            if module in outs and hf.endswith(".weight")}
    if missing := sorted(set(outs) - set(rows)):
        raise KeyError(f"no weight for modules {missing[:3]}")
    size, scratch = max(o.numel() for o in outs.values()), {}  # one accumulator per adapter dtype
    with full_parameters(pair.model(role)):
        for module, out in outs.items():
            read, mod = rows[module]
            _check_mergeable(module, mod, role)
            w = read().detach()
            if w.shape != out.shape:
                raise ValueError(f"{module}: weight {tuple(w.shape)} does not fit {tuple(out.shape)}")
            if mod is None:
                out.copy_(w)
            else:
                dtype = mod.lora_A[role].weight.dtype
                acc = scratch.setdefault(dtype, torch.empty(size, dtype=dtype)) if dtype != out.dtype else None
                _merged_weight(w, mod, role, out, acc)


def _check_mergeable(module: str, mod, role: str) -> None:
    if mod is not None and (mod.merged or role in getattr(mod, "lora_variant", {})
                            or mod.lora_bias.get(role, False)):
        raise NotImplementedError(f"{module}: merged adapters, DoRA and LoRA bias are not supported for sync")


def _merged(pair, role: str, modules: set[str] | None, lora: bool) -> dict[str, torch.Tensor]:
    sd = {}
    for hf, module, read, mod in sync_plan(pair, role).base:
        if modules is not None and module not in modules:
            continue
        _check_mergeable(module, mod, role)
        v = read().detach()
        sd[hf] = v.clone() if mod is None or not lora else _merged_weight(v, mod, role)
    return sd
