"""What crosses into vLLM's worker processes: the worker extension and the formats both ends share.

``LLM(worker_extension_cls=EXTENSION)`` makes vLLM import this module inside each worker and mix
:class:`WeightSyncExtension` into the worker class; its methods receive a weight sync (sync.py) as
in-memory safetensors bytes, as the layout of the trainer's staging buffer (sync.SharedStage), or as
a LoRA adapter, and run vLLM's own reload or LoRA cache on it. Besides them: what the trainer's side
uses too, namely the quieting of vLLM's per-layer reload warnings, the buffer's layout read back as
views, and the buffer's handle (made by the trainer, opened here). Nothing here imports vLLM at module
level, so the trainer's side (sync.py) imports this module where vLLM is not installed too.
"""

from __future__ import annotations

import contextlib
import logging
import pickle

import torch

# worker_extension_cls for LLM(...): vLLM imports it inside each worker process.
EXTENSION = "tosca_mlmt.rollout.engines.vllm.worker.WeightSyncExtension"
RPC_METHOD = "tosca_reload_from_bytes"
SHARED_RPC_METHOD = "tosca_reload_from_shared"
LORA_RPC_METHOD = "tosca_add_lora_from_bytes"
# vLLM warns once per layer a reload leaves untouched and lists every name it did not get:
# expected for a delta, so those two loggers are quieted while one loads.
RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def tosca_reload_from_bytes(self, payload: bytes, partial: bool = False) -> int:
        from safetensors.torch import load

        sd = load(payload)
        with quiet_reload(partial):
            self.model_runner.reload_weights(weights_iterator=list(sd.items()))
        return len(sd)

    def tosca_reload_from_shared(self, layout: list, partial: bool = False, stage_id: int = 0,
                                 handle: bytes | None = None, replaces: int = 0) -> int:
        """Reload the tensors ``layout`` places in the trainer's staging buffer ``stage_id``
        (SharedStage). A buffer's ``handle`` comes with its first reload; the worker keeps the mapped
        buffer and reads it in place from then on, until one that ``replaces`` it arrives."""
        held = self.__dict__.setdefault("_tosca_stages", {})
        if handle is not None:
            held.pop(replaces, None)
            try:
                held[stage_id] = open_handle(handle)  # maps the trainer's memory, no copy
            except Exception as e:  # noqa: BLE001 -- e.g. CUDA IPC refused in a container: the trainer sends bytes
                logging.getLogger(__name__).warning("cannot map the trainer's staging buffer: %r", e)
                return -1
        if stage_id not in held:
            raise RuntimeError(f"staging buffer {stage_id} was never shared with this worker (it holds {sorted(held)})")
        buf = held[stage_id]
        with quiet_reload(partial):
            self.model_runner.reload_weights(weights_iterator=views(buf, layout))
        if buf.is_cuda:
            # The reload's copies out of the buffer are queued on this process's streams; returning
            # lets the trainer write the next bucket into it, so they must have run by then.
            for device in {buf.device.index, torch.cuda.current_device()}:
                torch.cuda.synchronize(device)
        return len(layout)

    def tosca_add_lora_from_bytes(self, payload: bytes, lora_id: int, config: dict) -> int:
        from safetensors.torch import load

        return add_lora(self.model_runner, lora_id, load(payload), config)

    def tosca_route_norms(self, on: bool) -> int:
        from tosca_mlmt.rollout.engines.vllm import norm

        return norm.install(self.model_runner.get_model(), on)


def add_lora(runner, lora_id: int, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """Put a peft adapter (``tensors``: its state dict, ``config``: its LoraConfig as a dict) into
    the worker's LoRA cache as ``lora_id``, replacing the adapter held under that id.

    vLLM's own ``_load_adapter`` does the same from a folder; this skips the folder. Its
    ``from_lora_tensors`` folds the scaling into lora_B *in place*, so ``tensors`` must be copies
    the caller does not read again. Private API (vllm 0.32; 0.26 too, by the mapper fallback)."""
    from vllm.lora.peft_helper import PEFTHelper

    wm = runner.lora_manager
    am = wm._adapter_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(wm.lora_config)
    mapper = getattr(am.model, "hf_to_vllm_mapper", None)
    if mapper is not None:  # the renames only, as vLLM's own _load_adapter takes them (0.26 names it unstacked)
        mapper = (mapper.get_rename_mapper if hasattr(mapper, "get_rename_mapper") else mapper.get_unstacked_mapper)()
    lora = wm._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu", dtype=wm.lora_config.lora_dtype,
        model_vocab_size=wm.vocab_size, weights_mapper=mapper)
    am.remove_adapter(lora_id)
    if len(am) + 1 > am.capacity:
        am.remove_oldest_adapter()
    am.add_adapter(lora)
    return len(tensors)


@contextlib.contextmanager
def quiet_reload(partial: bool):
    """Silence vLLM's per-layer "not loaded" warnings while a delta (``partial``) loads."""
    loggers = [logging.getLogger(n) for n in RELOAD_LOGGERS] if partial else []
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def views(buf: torch.Tensor, layout: list) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs ``layout`` (sync.SharedStage.layout) places in ``buf``, as views (no copy)."""
    out = []
    for name, dtype, shape, off in layout:
        dt = getattr(torch, dtype)
        n = dt.itemsize * (int(torch.Size(shape).numel()))
        out.append((name, buf[off: off + n].view(dt).view(shape)))
    return out


# a CUDA buffer's handle: (CUDA_IPC, the GPU's UUID, rebuild_cuda_tensor's arguments)
CUDA_IPC = "tosca-cuda-ipc"


def share_handle(buf: torch.Tensor) -> bytes:
    """What a worker process needs to map ``buf``. On CPU, torch's own pickling of it in shared
    memory (a file descriptor). On a GPU, the CUDA IPC arguments torch would pickle, with the GPU's
    UUID beside them: a worker may number the GPUs differently (its own CUDA_VISIBLE_DEVICES) and
    must open the handle on the same physical device (vLLM's IPC weight transfer does the same)."""
    if buf.device.type != "cuda":
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 -- registers torch's tensor reductions on ForkingPickler

        return bytes(ForkingPickler.dumps(buf.share_memory_()))
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    return pickle.dumps((CUDA_IPC, _gpu_uuid(buf.device.index), args))


def open_handle(handle: bytes) -> torch.Tensor:
    """The buffer :func:`share_handle` describes, mapped in this process (no copy)."""
    obj = pickle.loads(handle)
    if not (isinstance(obj, tuple) and obj[:1] == (CUDA_IPC,)):
        return obj
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    _, uuid, args = obj
    return rebuild_cuda_tensor(*on_local_gpu(args, uuid, [_gpu_uuid(i) for i in range(torch.cuda.device_count())]))


def on_local_gpu(args: tuple, uuid: str, local_uuids: list[str]) -> tuple:
    """``rebuild_cuda_tensor``'s ``args`` with the storage device set to the index this process
    gives the GPU ``uuid`` (``local_uuids``: its GPUs' UUIDs by index)."""
    if uuid not in local_uuids:
        raise RuntimeError(f"GPU {uuid} holds the staging buffer but is not visible here (CUDA_VISIBLE_DEVICES)")
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    at = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")
    return (*args[:at], local_uuids.index(uuid), *args[at + 1:])


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)

