"""vLLM serves architectures besides the embedded Llama, and every sync route loads the trainer's weights.

The tiny random models of tests/unit/models/test_model_architectures.py: a Qwen2 (biased q/k/v), a Gemma 2 (its head
tied to the embeddings, which vLLM's Gemma 2 loader refuses under the name ``lm_head``; soft-capped
attention scores, which the trainer must cap as vLLM does: models/loading.attention_implementation),
a Phi-3 (q/k/v and gate/up fused in the checkpoint itself; an untied head) and a GPT-2 (no fused
layers in vLLM, so every sync is a full reload; Conv1D deltas merged transposed). Their peaked logits
make a changed adapter visibly move log-probs. For each,
one in-process vLLM engine serves a trained-looking solver adapter through the direct kernels (the
CPU default), a delta reload, a full reload and the file route, and each gives the trainer's
log-probs; and both engines decode greedily as the model's argmax although its generation config
asks for a repetition penalty.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from conftest import FP32, VLLM_MARKS, argmax_chain, max_diff, perturbed_lora_b, teacher_forced, vllm_session  # noqa: E402
from factories import ARCHS, build_arch  # noqa: E402
from tosca_mlmt.models import merge  # noqa: E402

pytestmark = VLLM_MARKS

# fp32 on both sides (measured: 1.5e-5 Qwen2, 3.8e-6 Gemma 2). Gemma 2 read 9.8e-3 before the trainer
# loaded it with eager attention: SDPA, transformers' default, leaves its attention soft-cap out.
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_env(request, tmp_path_factory):
    folder = build_arch(request.param, tmp_path_factory.mktemp(request.param))
    overrides = {**FP32, "model.solver": folder, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1,
                 "engine.vllm.max_model_len": 1024, "episode.max_prompt_tokens": 768, "logging.wandb": False,
                 "logging.progress": False}
    with vllm_session(overrides) as (cfg, policies, engine):
        yield request.param, policies, engine


@contextlib.contextmanager
def _route(engine, mode: str, direct: bool):
    kernels, weight_sync = engine.kernels, engine.weight_sync
    engine.kernels, engine.weight_sync = (kernels if direct else None), mode
    try:
        yield
    finally:
        engine.kernels, engine.weight_sync = kernels, weight_sync


def test_a_full_sync_carries_a_checkpoints_tensors(arch_env):
    """The tied head goes once, under the name the saved checkpoint gives it; nothing else is dropped."""
    from safetensors import safe_open

    arch, policies, _ = arch_env
    with safe_open(os.path.join(policies.base_paths["solver"], "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(merge.merged_state_dict(policies, "solver")) == saved
    assert ("lm_head.weight" in saved) == (not ARCHS[arch][1])


def test_every_route_serves_the_trainers_weights(arch_env):
    arch, policies, engine = arch_env
    tok = policies.tokenizer("solver")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 5?"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    response = tok.encode(" The answer is 22.", add_special_tokens=False)
    base = engine.score([prompt], [response], "solver")[0]
    assert max_diff(base, teacher_forced(policies, "solver", prompt, response)) < TOL
    got = {}
    with perturbed_lora_b(policies, "solver", seed=1, scale=0.05):
        trainer = teacher_forced(policies, "solver", prompt, response)
        for name, mode, direct, force in (("direct", "memory", True, False), ("delta", "memory", False, False),
                                          ("full", "memory", False, True), ("file", "file", False, True)):
            with _route(engine, mode, direct):
                engine.sync_weights("writer")  # the base: each route has to move the solver's weights itself
                engine.sync_weights("solver", force=force)
                fused = ARCHS[arch][2]  # without fused layers: no kernels, no deltas, a full reload each time
                assert engine.sync_route == {"direct": "kernels" if fused else "runner", "file": "file"}.get(name, "runner")
                assert engine.sync_kind == ({"direct": "direct", "delta": "delta"}.get(name, "full") if fused else "full")
                got[name] = engine.score([prompt], [response], "solver")[0]
    moved = max_diff(got["full"], base)
    print(f"{arch}: the adapter moved vLLM's log-probs by {moved:.3f}; routes vs trainer: "
          + ", ".join(f"{r} {max_diff(lp, trainer):.1e}" for r, lp in got.items()))
    assert moved > 10 * TOL, "the perturbation did not move vLLM's log-probs: the comparison is vacuous"
    for name, lp in got.items():
        assert max_diff(lp, trainer) < TOL, f"{arch}, {name} route: vLLM disagrees with the trainer"
    engine.sync_weights("solver", force=True)  # the base again, for the next test on this engine


def test_greedy_decoding_is_the_argmax_chain_on_both_engines(arch_env):
    """The card's repetition penalty and no_repeat_ngram_size reach neither engine: both decode greedily
    as the argmax of the model's own logits, token after token."""
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams
    from tosca_mlmt.rollout.engines.hf import HFEngine

    arch, policies, engine = arch_env
    prompt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver")).first_prompt("Count to ten.")
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    got = {e.name: list(e.generate([prompt], params, "solver")[0][0].token_ids) for e in (engine, HFEngine(policies))}
    chain = argmax_chain(policies, "solver", prompt, len(got["vllm"]))
    ids = list(prompt) + chain
    # Gemma 2's chain repeats tokens, so there the penalty would have changed it (the wide random Qwen2 and
    # Phi-3 draw a new token every step: for them this is plain greedy agreement)
    repeats = any(t in ids[:len(prompt) + i] for i, t in enumerate(chain))
    assert repeats or arch != "gemma2", "no repeat: the card could not show"
    assert got["vllm"] == chain and got["hf"][:len(chain)] == chain, arch
