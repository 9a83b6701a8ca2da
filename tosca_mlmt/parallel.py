"""Process-group helpers every layer may use: who am I, collectives, sharding, ZeRO-3 gathering.

Ground floor: imports nothing of ours and changes no environment on import, so models,
engines, metrics and the pure RL code can use it without pulling in the training package
(the optimiser side, ``Trainer``, lives in ``tosca_mlmt.train.distributed``).

Ranks come from torch.distributed, not accelerate's state: under DeepSpeed on CPU
accelerate reports one process on every rank (accelerate 1.15). With no process group
every helper behaves as the single process it is.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from typing import Any

import torch
from torch import nn


def init(backend: str = "auto", timeout_minutes: int = 30, force: bool = False) -> None:
    """Join the process group when launched with WORLD_SIZE > 1 (idempotent); ``force`` also
    for one process (DeepSpeed needs a group)."""
    import torch.distributed as dist

    if dist.is_initialized() or (int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not force):
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        # Bound to its GPU, NCCL need not guess the device from the global rank (the first GPU run
        # warned that a guess can hang where ranks do not map to GPUs rank % count, e.g. uneven nodes).
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)
    # A process that exits with the group alive can abort after its work is done: Gloo's worker threads still
    # hold Python objects when the interpreter finalizes ("terminate called without an active exception",
    # SIGABRT; pytorch/pytorch#190489), and torchrun then reports the run failed. Seen once in 2026-12 on the
    # ZeRO-3 offload test's second rank, under load. Left at exit, while the interpreter is whole.
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the process group; nothing without one. Registered at exit by ``init``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def compute_device() -> torch.device:
    """Where this process's models and heads compute: its own GPU (``LOCAL_RANK``; the one ``init``
    selects under NCCL) where CUDA is visible, else the CPU. ``CUDA_VISIBLE_DEVICES=`` keeps a
    run on a GPU machine on the CPU. DDP and DeepSpeed move the trainer's modules to the same
    device themselves; batches stay on the host and cross at each model call (tensors.onto)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on this host now (a launcher's --master_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world() > 1:
        torch.distributed.barrier()


def gather(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def shard(n: int) -> list[int]:
    """This rank's contiguous share of range(n) (sizes differ by at most one)."""
    w, r = world(), rank()
    lo, hi = r * n // w, (r + 1) * n // w
    return list(range(lo, hi))


def gather_sharded(items: list, n: int) -> list:
    """Inverse of ``shard``: each rank passes its items for ``shard(n)``; all get the full list."""
    out = [x for part in gather(items) for x in part]
    if len(out) != n:
        raise RuntimeError(f"gathered {len(out)} items, expected {n}")
    return out


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Element-wise sum of a (same-keyed) dict of floats across ranks."""
    if world() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


# Live DeepSpeed ZeRO-3 engines (registered by train.distributed.Trainer): their module hooks would
# re-partition parameters in the middle of a ``full_parameters`` block.
_ZERO3_ENGINES: list = []


def track_zero3_engine(engine) -> None:
    _ZERO3_ENGINES.append(engine)


def untrack_zero3_engine(engine) -> None:
    if engine in _ZERO3_ENGINES:
        _ZERO3_ENGINES.remove(engine)


@contextlib.contextmanager
def full_parameters(*modules: nn.Module, modify: bool = False):
    """Block in which ZeRO-3-partitioned parameters of ``modules`` are whole, for generation,
    scoring, weight sync and saving; with ``modify`` what rank 0 writes into them is kept and
    re-partitioned on exit (loading). A no-op without ZeRO-3 and for parameters an
    enclosing block already gathered. Under ZeRO-3 it is a collective: every rank enters it.

    DeepSpeed's ZeRO-3 forward hooks are lifted for the block (as TRL does for generation):
    they would release the gathered weights after each sub-module and re-gather them with
    collectives, which ranks running different numbers of forwards cannot match."""
    params = [p for m in modules for p in m.parameters() if hasattr(p, "ds_id")]
    if params:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not params:
        yield
        return
    import deepspeed

    offloads = [e.optimizer.parameter_offload for e in _ZERO3_ENGINES]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        for off in offloads:
            for p in off.module.parameters():
                p.ds_active_sub_modules.clear()
            for hook in off.forward_hooks + off.backward_hooks:
                hook.remove()
            off.forward_hooks, off.backward_hooks = [], []
        try:
            yield
        finally:
            for off in offloads:
                off._register_deepspeed_module(off.module)
