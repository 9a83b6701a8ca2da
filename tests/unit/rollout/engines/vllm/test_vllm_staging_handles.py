"""The staging buffer's handle (vllm/worker.share_handle / open_handle) as a GPU worker opens it.

No GPU runs here, so the CUDA branch is driven through torch's own rebuild function replaced by a
recorder: what is checked is which device the worker would open the trainer's buffer on when it
numbers the GPUs differently (CUDA_VISIBLE_DEVICES), the case a colocated multi-GPU run meets. The
CPU branch (shared memory) runs for real in tests/unit/rollout/engines/vllm/test_vllm_multiprocess.py.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from tosca_mlmt.rollout.engines.vllm import worker


def _args(device: int) -> tuple:
    """rebuild_cuda_tensor's arguments by name, every one a marker except the device."""
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    return tuple(device if n == "storage_device" else f"<{n}>" for n in names)


def test_the_buffer_is_opened_on_the_gpu_with_its_uuid_whatever_this_process_numbers_it(monkeypatch):
    # the trainer's GPU 0 is this worker's GPU 1 (another CUDA_VISIBLE_DEVICES order)
    uuids = ["GPU-other", "GPU-trainers"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    opened = []

    @functools.wraps(reductions.rebuild_cuda_tensor)  # keeps torch's signature, which names the device argument
    def rebuild(*args):
        opened.append(args)
        return "mapped"

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)

    handle = pickle.dumps((worker.CUDA_IPC, "GPU-trainers", _args(device=0)))
    assert worker.open_handle(handle) == "mapped"
    (args,) = opened
    assert args == _args(device=1)  # only the device moved, to the index this process gives that GPU

    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):  # the worker answers -1: syncs go as bytes
        worker.open_handle(pickle.dumps((worker.CUDA_IPC, "GPU-elsewhere", _args(device=0))))
    assert len(opened) == 1


def test_a_cpu_handle_opens_as_torch_pickled_it():
    buf = torch.arange(16, dtype=torch.uint8)
    handle = worker.share_handle(buf)
    assert buf.is_shared()
    mapped = worker.open_handle(handle)
    mapped[3] = 200  # the same memory, not a copy
    assert buf[3] == 200 and torch.equal(mapped, buf)
