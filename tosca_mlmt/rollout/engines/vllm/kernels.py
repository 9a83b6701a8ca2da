"""Direct weight sync for in-process CPU engines (``engine.vllm.direct_sync``).

On CPU, vLLM does not run a linear layer from its weight parameter: after loading it packs the
weight into a kernel (oneDNN or sgl-kernel blocked layout), stores the kernel in the layer's
``cpu_linear`` closure and empties the parameter. A reload (sync.py) therefore goes through
vLLM's layerwise machinery: every tensor of a layer is buffered, the layer is rebuilt, loaded
shard by shard and packed again.

This route skips all but the packing. For each vLLM linear layer a policy's adapter touches it
merges base + LoRA of the layer's HF modules (q/k/v, gate/up, ...) straight into one fused
buffer (models/merge.merge_into: the bits a reload would get), packs it with the layer's own
``process_weights_after_loading`` and keeps the resulting closure. Serving a policy is then
setting ``cpu_linear`` on each layer: the policy's kernels where it has them, the base's
elsewhere. Each policy's kernels are kept until its adapter changes, so alternating turns
(solver, writer, solver) swap closures and merge nothing. Memory: one packed copy of the
adapted layers per policy, besides the base's.

Only where this is exactly what a reload would build: an in-process engine, one tensor-parallel
rank, eager execution (a compiled graph may hold on to the old closures), unquantized linear
layers whose packed kernel no longer reads the weight parameter. :func:`fused_layers` (and
:func:`kernel_sets` with it) returns None anywhere else and the engine takes the ``weight_sync``
route. Private vLLM API (0.32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tosca_mlmt.models import merge


@dataclass(frozen=True)
class FusedLayer:
    """One vLLM linear layer and the HF modules whose weights are its row blocks, in order."""

    module: torch.nn.Module
    parts: tuple[tuple[str, int], ...]  # (HF module name, rows)
    cols: int
    dtype: torch.dtype


def fused_layers(llm, runner, packed: dict[str, list[str]] | None,
                 shapes: dict[str, tuple[int, ...]], hf_modules: set[str]) -> dict[str, FusedLayer] | None:
    """The vLLM layers (by vLLM module name) that hold ``hf_modules`` (every HF module either
    policy may adapt), each with all of its row blocks; None where the direct route would not
    build what a reload builds (module docstring) or a block does not match the trainer's module
    (``shapes``: HF module name -> weight shape)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if runner is None or packed is None or not current_platform.is_cpu():
        return None
    cfg = llm.llm_engine.vllm_config
    if cfg.parallel_config.tensor_parallel_size != 1 or not cfg.model_config.enforce_eager:
        return None
    model = runner.get_model()
    fuse = {leaf: (fused, group) for fused, group in packed.items() for leaf in group}
    out: dict[str, FusedLayer] = {}
    for name in hf_modules:
        parent, _, leaf = name.rpartition(".")
        fused, group = fuse.get(leaf, (leaf, [leaf]))
        vname = f"{parent}.{fused}" if parent else fused
        if vname in out:
            continue
        try:
            layer = model.get_submodule(vname)
        except AttributeError:
            return None
        sizes = list(getattr(layer, "output_partition_sizes", ()))
        if len(group) == 1 and len(sizes) > 1:  # fused in the checkpoint already (Phi-3's qkv_proj, gate_up_proj)
            sizes = [sum(sizes)]
        if (not isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)
                or not hasattr(layer, "cpu_linear") or layer.weight.numel() != 0 or len(sizes) != len(group)
                or getattr(layer, "_cpu_skip_gemm_dispatch", False)):
            return None  # the kernel still reads the parameter, or the layer is not a plain packed GEMM
        parts = tuple((f"{parent}.{g}" if parent else g, rows) for g, rows in zip(group, sizes))
        if any(shapes.get(hf) != (rows, layer.input_size_per_partition) for hf, rows in parts):
            return None
        out[vname] = FusedLayer(layer, parts, layer.input_size_per_partition, cfg.model_config.dtype)
    return out


def pack(layer: torch.nn.Module, weight: torch.Tensor):
    """The ``cpu_linear`` closure vLLM builds for ``layer`` holding ``weight`` ([out, in]); the
    layer's own (empty) parameter and closure are left as they were."""
    old_param, old_linear = layer.weight, layer.cpu_linear
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    try:
        layer.quant_method.process_weights_after_loading(layer)
        kernel = layer.cpu_linear
        if layer.weight.numel() != 0:
            raise RuntimeError(f"{type(layer).__name__}: vLLM kept the weight after packing; use engine.vllm.direct_sync=false")
    finally:
        layer.weight, layer.cpu_linear = old_param, old_linear
    return kernel


class KernelSets:
    """The packed kernels of the base and of each policy; ``install`` makes vLLM serve one."""

    def __init__(self, layers: dict[str, FusedLayer]):
        self.layers = layers
        self.held: dict[str, tuple[str, dict]] = {}  # policy -> (weights key, {vLLM layer: kernel})
        self.reset()

    def reset(self) -> None:
        """Take the kernels vLLM serves now as the base's (at start-up: what it built from disk) and
        drop every policy's."""
        self.base = {name: fl.module.cpu_linear for name, fl in self.layers.items()}
        self.held.clear()

    def build(self, merge_into, hf_modules: set[str]) -> dict:
        """Kernels of every layer holding one of ``hf_modules``; ``merge_into(outs)`` writes each
        HF module's merged weight into its row block, in one call (it gathers ZeRO-3 parameters
        once). A fresh buffer per layer: a packing kernel that keeps a view of its input
        (zentorch without prepacking) then keeps its own."""
        bufs, outs = {}, {}
        for name, fl in self.layers.items():
            if not any(hf in hf_modules for hf, _ in fl.parts):
                continue
            bufs[name] = buf = torch.empty(sum(rows for _, rows in fl.parts), fl.cols, dtype=fl.dtype)
            row = 0
            for hf, rows in fl.parts:
                outs[hf] = buf[row: row + rows]
                row += rows
        merge_into(outs)
        return {name: pack(self.layers[name].module, bufs.pop(name)) for name in list(bufs)}

    def install(self, kernels: dict) -> None:
        for name, fl in self.layers.items():
            fl.module.cpu_linear = kernels.get(name, self.base[name])


def kernel_sets(llm, runner, packed: dict[str, list[str]] | None, policies, roles: tuple[str, ...]) -> KernelSets | None:
    """direct_sync's kernels for an engine serving ``roles`` of ``policies``, or None where the direct
    route does not apply (:func:`fused_layers`; ``runner``: the engine's in-process model runner)."""
    adapted = [policies.adapted_modules(role) for role in roles]
    if any(a is None for a in adapted):  # modules_to_save: embeddings or norms change too
        return None
    layers = fused_layers(llm, runner, packed, merge.weight_shapes(policies, roles[0]), set().union(*adapted))
    return None if not layers else KernelSets(layers)
