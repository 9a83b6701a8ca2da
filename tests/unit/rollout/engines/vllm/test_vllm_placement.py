"""A rank's vLLM engine starts seeing only the rank's own GPU (rollout/engines/vllm/placement.py).

No GPU here: what is checked is the CUDA_VISIBLE_DEVICES an engine started inside ``on_rank_gpu``
would inherit, and that the trainer's own variable is back as it was afterwards.
"""

from __future__ import annotations

import os

import pytest

from tosca_mlmt.rollout.engines.vllm.placement import on_rank_gpu, rank_gpu


def test_the_rank_gpu_is_named_as_the_launcher_names_it():
    assert rank_gpu(3, None) == "3"
    assert rank_gpu(1, "4,6") == "6"  # a scheduler's allocation: local rank 1 trains on physical GPU 6
    assert rank_gpu(0, "GPU-a1b2, GPU-c3d4") == "GPU-a1b2"
    with pytest.raises(ValueError, match="LOCAL_RANK=2.*names 2 GPU"):
        rank_gpu(2, "4,6")


@pytest.mark.parametrize("before", [None, "4,6"])
def test_an_engine_started_inside_sees_the_rank_gpu_and_the_variable_comes_back(monkeypatch, before):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    with on_rank_gpu(on_cpu=False):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ("1" if before is None else "6")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_nothing_changes_on_cpu_or_outside_a_launcher(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with on_rank_gpu(on_cpu=True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    monkeypatch.delenv("LOCAL_RANK")
    with on_rank_gpu(on_cpu=False):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_an_in_process_engine_off_the_first_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        with on_rank_gpu(on_cpu=False):
            pass
    monkeypatch.setenv("LOCAL_RANK", "0")
    with on_rank_gpu(on_cpu=False):  # local rank 0 trains on GPU 0, where vLLM would go anyway
        pass


def test_the_variable_comes_back_when_the_engine_fails_to_start(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with pytest.raises(OSError):
        with on_rank_gpu(on_cpu=False):
            raise OSError("engine start-up failed")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def _report_gpus(conn) -> None:
    import time

    time.sleep(0.5)  # read after the parent has put its variable back
    conn.send(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_a_process_started_inside_keeps_the_rank_gpu_after_the_variable_comes_back(monkeypatch):
    """What vLLM does with the engine: a spawned process (its EngineCore) started inside keeps the
    narrowed variable for its life; the trainer's is back as soon as the start returns."""
    import multiprocessing as mp

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with on_rank_gpu(on_cpu=False):
        proc = ctx.Process(target=_report_gpus, args=(child,))
        proc.start()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert parent.poll(120) and parent.recv() == "6"
    proc.join(60)
