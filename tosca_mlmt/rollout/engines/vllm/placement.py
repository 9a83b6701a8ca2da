"""Which GPU a rank's colocated vLLM engine runs on.

A GPU engine runs its model in an EngineCore process, whose worker takes the first GPU it can see
(tensor parallel size 1: local rank 0). Under ``torchrun`` or ``accelerate launch`` every rank
inherits the same ``CUDA_VISIBLE_DEVICES``, so without help the eight engines of an 8-GPU node would
all start on GPU 0 (the second would find too little free memory) while the trainers sit on GPUs
0-7. The engine is therefore started with ``CUDA_VISIBLE_DEVICES`` narrowed to the rank's own GPU,
the one ``parallel.compute_device`` trains on, and the variable is put back at once: the EngineCore
process keeps what it saw when it started, and this process's CUDA context was made before (CUDA
reads the variable once). An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) cannot be
placed so: vLLM would select GPU 0 in the trainer's own process, so it is refused on any rank but
local rank 0. Not yet run on several GPUs (docs/guides/scaling.md).
"""

from __future__ import annotations

import contextlib
import os


def rank_gpu(local_rank: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine of the rank with ``local_rank``: its GPU alone, named
    as the rank's own ``visible`` (its ``CUDA_VISIBLE_DEVICES``; None when unset: GPUs by index) names it."""
    if visible is None:
        return str(local_rank)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not 0 <= local_rank < len(ids):
        raise ValueError(f"LOCAL_RANK={local_rank}, but CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)} GPU(s): "
                         "start as many processes per node as it names")
    return ids[local_rank]


@contextlib.contextmanager
def on_rank_gpu(on_cpu: bool):
    """While a vLLM engine starts: its EngineCore sees only this rank's GPU (module docstring).
    Nothing changes on CPU or outside a launcher (no ``LOCAL_RANK``: GPU 0, the trainer's too)."""
    local = os.environ.get("LOCAL_RANK")
    if on_cpu or local is None:
        yield
        return
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        if int(local) != 0:
            raise RuntimeError(f"LOCAL_RANK={local}: an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) "
                               "would run on GPU 0, not on this rank's GPU; unset it")
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = rank_gpu(int(local), before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
