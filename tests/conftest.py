"""Shared fixtures. Model-backed fixtures are session-scoped: the embedded model loads once."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tosca_mlmt import runtime

# Tests call the stages directly, not through the CLI: give them its process environment
# (offline hub, passive OpenMP) before anything loads torch or transformers.
runtime.process_env()
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parent.parent
MLMT = [sys.executable, "-m", "tosca_mlmt.cli.main"]
# Small, fast episodes for tests. Precision is stated, never left to `auto` (which picks bf16 on
# CPUs with avx512_bf16/amx_bf16 and fp32 elsewhere): fp32 weights and no autocast, so numbers
# compare exactly across engines and machines. bf16 is covered by tests that force it.
FP32 = {"model.dtype": "float32", "lower.autocast": "none"}


def set_args(overrides: dict) -> list[str]:
    """``--set KEY=VALUE`` for each item: ``overrides`` as a command line's arguments."""
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


TINY = ["--set", "solver_sampling.max_new_tokens=24", "--set", "writer_sampling.max_new_tokens=16",
        "--set", "episode.max_feedback_tokens=16", *set_args(FP32)]


# The random-weight debug base (tosca_mlmt.models.loading.DEBUG): same tokenizer and chat
# template, 2 layers, ~4x faster end to end. For mechanics (resume, faults, world sizes) that do
# not depend on what the model knows; it is never right, so such tests train with GAE, whose
# value baseline gives non-zero advantages when every reward is 0.
DEBUG_MODEL = {"model.solver": "tiny-random", "lower.advantage": "gae"}


def run_mlmt(*args, check=False, timeout=600, env=None, **kw) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([*MLMT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=e, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"mlmt {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


# The in-process fixtures' episodes: short turns, no trackers, no bars.
TINY_OVERRIDES = {**FP32, "solver_sampling.max_new_tokens": 24, "writer_sampling.max_new_tokens": 16,
                  "episode.max_feedback_tokens": 16, "logging.wandb": False, "logging.progress": False}


@pytest.fixture(scope="session")
def tiny_cfg():
    from tosca_mlmt.config import load_config

    return load_config(overrides=TINY_OVERRIDES)


@pytest.fixture(scope="session")
def policies(tiny_cfg):
    from tosca_mlmt.models.policies import PolicyPair

    return PolicyPair(tiny_cfg.model, seed=0)


@pytest.fixture(scope="session")
def debug_cfg():
    from tosca_mlmt.config import load_config

    return load_config(overrides={**TINY_OVERRIDES, **DEBUG_MODEL})


@pytest.fixture(scope="session")
def debug_policies(debug_cfg):
    from tosca_mlmt.models.policies import PolicyPair

    return PolicyPair(debug_cfg.model, seed=0)


def pytest_collection_modifyitems(items):
    """Files with a slow test first, each file's tests kept together and in order. pytest-xdist's loadfile
    hands files out in this order, so the two workers end on small files and finish together, not one
    idle while the other runs a file of minutes (the vLLM files sort last by name)."""
    first = {}
    for i, item in enumerate(items):
        rank = first.setdefault(item.nodeid.split("::")[0], [1, i])
        if item.get_closest_marker("slow") is not None:
            rank[0] = 0
    items.sort(key=lambda item: first[item.nodeid.split("::")[0]])


# Marks of every module that starts a vLLM engine.
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    # a spec with no origin is a bare folder named vllm (tests/unit/rollout/engines/vllm/ itself)
    pytest.mark.skipif(getattr(importlib.util.find_spec("vllm"), "origin", None) is None,
                       reason="vllm is not installed (pip install 'tosca-mlmt[vllm]')"),
]


@contextlib.contextmanager
def vllm_session(overrides: dict):
    """(cfg, PolicyPair, engine) on one thread for a test module, the engine built as the stages build it
    (rollout.engines.make_engine: a VLLMEngine, or a VLLMPair for two bases); skips when vLLM cannot be
    imported or the embedded model is unavailable. One thread: 2-thread runs collapse 3-5x on
    a shared 2-core box. vLLM's in-process CPU worker replaces torch.set_num_threads with a
    no-op, so the real one is kept and restored."""
    import torch

    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- a broken install (e.g. CUDA-built torchvision) must skip, not error
        pytest.skip(f"import vllm failed: {type(e).__name__}: {e}")
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ModelError
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.rollout.engines import make_engine

    cfg = load_config(overrides=overrides)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    set_threads(1)
    try:
        policies = PolicyPair(cfg.model, seed=cfg.seed)
    except ModelError as e:
        set_threads(threads)
        pytest.skip(f"embedded model unavailable: {e}")
    # vLLM runs gc.collect() several times while it starts (model load, memory profiling); a test process's
    # heap of torch, transformers and vLLM objects makes each a quarter second, about a sixth of a small
    # engine's start. Frozen objects are never scanned, so cycles among them are not freed until the session ends
    # and unfreezes them (an in-process engine's shutdown already does).
    gc.freeze()
    engine = make_engine(cfg, policies)
    try:
        yield cfg, policies, engine
    finally:
        engine.close()
        gc.unfreeze()
        torch.set_num_threads = set_threads
        set_threads(threads)


def argmax_chain(policies, policy: str, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens greedy decoding must give: the argmax of the live model's own logits, token after
    token (one full forward per token, no cache, no generation config)."""
    import torch

    ids = list(prompt)
    with torch.no_grad(), policies.use(policy) as m:
        for _ in range(n):
            ids.append(int(m(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def teacher_forced(policies, policy: str, prompt: list[int], response) -> list[float]:
    """log_softmax of the raw (temperature-1) logits at every response position, unpadded: the
    live peft model's log pi(response | prompt), what a vLLM engine must reproduce."""
    import torch

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad(), policies.use(policy) as m:
        logits = m(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def max_diff(a, b) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def check_salted_swaps(policies, engine, fmt, perturbed, tol: float) -> tuple[tuple, tuple]:
    """Solver -> writer -> solver -> writer greedy generations of one ~200-token prompt inside
    ``perturbed`` (a context manager under which the solver's weights differ from the writer's).
    Asserts what the salted prefix cache (VLLMEngine.requests) promises on whatever route the engine
    syncs by: each policy hits its own cached prompt and none of the other's, tokens and log-probs
    decoded from a warm cache are a cold one's, and both policies' equal the trainer's within ``tol``.
    Returns the (weight syncs, sync route) of each call, for the caller's route checks."""
    from tosca_mlmt.rollout.engines.base import SamplingParams

    prompt = fmt.first_prompt(" ".join(["Add the numbers 12 and 30 and explain each step."] * 12))
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    whole = (len(prompt) - 1) // block * block
    assert whole > 0
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    calls = []
    with perturbed:
        engine.llm.reset_prefix_cache()
        for policy in ("solver", "writer", "solver", "writer"):
            c0, s0 = engine.cached_prompt_tokens, engine.syncs
            g = engine.generate([prompt], params, policy)[0][0]
            calls.append((engine.cached_prompt_tokens - c0, engine.syncs - s0, engine.sync_route, g))
        ref_s = teacher_forced(policies, "solver", prompt, calls[2][3].token_ids)
    hits, syncs, routes, (cold_s, cold_w, warm_s, warm_w) = zip(*calls)
    assert hits == (0, 0, whole, whole), "each policy must hit its own cached prompt, never the other's"
    assert max_diff(cold_s.logprobs, cold_w.logprobs) > 1e-2, "solver and writer serve the same weights: vacuous"
    for cold, warm in ((cold_s, warm_s), (cold_w, warm_w)):
        assert warm.token_ids == cold.token_ids and max_diff(warm.logprobs, cold.logprobs) < tol
    assert max_diff(warm_s.logprobs, ref_s) < tol
    assert max_diff(warm_w.logprobs, teacher_forced(policies, "writer", prompt, warm_w.token_ids)) < tol
    return syncs, routes


@contextlib.contextmanager
def restored(params: dict):
    """``params`` (name -> parameter) put back to their values on entry when the block ends, however
    it ends; yields those saved values. Tests that change a session-shared model in place use it, so
    no later test (on the same xdist worker) finds the change."""
    import torch

    saved = {n: p.detach().clone() for n, p in params.items()}
    try:
        yield saved
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def random_lora_b(pair, role: str, seed: int, scale: float = 0.2) -> None:
    """A trained-looking adapter for good: ``role``'s LoRA B set to ``scale`` N(0, 1) (fresh ones are zero,
    so merging would give the base back). For pairs a test owns; a shared one takes perturbed_lora_b."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pair.model(role).named_parameters():
            if f"lora_B.{role}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@contextlib.contextmanager
def perturbed_lora_b(policies, role: str, seed: int, scale: float = 0.02):
    """``role``'s LoRA B matrices moved by ``scale`` N(0, 1) for the block (a trained-looking
    adapter), yielded as (parameters by name, their saved values); restored afterwards."""
    import torch

    lora_b = {n: p for n, p in policies.model(role).named_parameters() if f"lora_B.{role}." in n}
    gen = torch.Generator().manual_seed(seed)
    with restored(lora_b) as saved:
        with torch.no_grad():
            for p in lora_b.values():
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        yield lora_b, saved


@pytest.fixture(scope="module")
def lower_setup(tiny_cfg, policies):
    """fp32 weights, no autocast (conftest.FP32): numbers compare exactly."""
    from factories import sampled_lower_setup

    return sampled_lower_setup(tiny_cfg, policies)


@pytest.fixture(scope="module")
def bf16_setup(lower_setup, debug_cfg):
    """The path `model.dtype: auto` takes on CPUs with native bf16, forced on any CPU: bf16 base
    weights and bf16 autocast (torch emulates bf16 where the CPU lacks it), on the debug base (the
    same tokenizer, so the fp32 fixture's episodes are its token ids too). What is checked is the
    bf16 forward's arithmetic, not what the model knows; the embedded model's 30 layers in emulated
    bf16 cost ~100 s a test on AVX2-only CPUs (~50x slower than fp32). bf16 sampling is covered on
    the debug model too (test_bf16_update_keeps_fp32_master_adapters_and_finite_losses)."""
    from factories import bf16_pair

    cfg, policies = bf16_pair(replace(lower_setup[0], model=debug_cfg.model))
    return cfg, lower_setup[1], policies
