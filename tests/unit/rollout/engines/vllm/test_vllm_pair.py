"""vLLM with solver and writer on different bases (rollout/engines/vllm/pair.py).

The solver is tiny-random on the embedded tokenizer; the writer is tests/stages/test_two_bases.py's tiny
Llama on a BPE vocabulary of its own (no id shared with the solver's by design). engine.name=vllm
builds one in-process vLLM engine per base, and the test checks that each role's turns come from
its own base (the engine's log-probs are that role's trainer log-probs, fp32), that a trained
writer reaches only the writer's engine, that the memory is split by engine.vllm.writer_share,
and that a three-turn episode runs across the two vocabularies with the pair's counters summed.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from conftest import (DEBUG_MODEL, FP32, VLLM_MARKS, max_diff, perturbed_lora_b, teacher_forced,  # noqa: E402
                      vllm_session)
from factories import bpe_writer  # noqa: E402

pytestmark = VLLM_MARKS

LOGPROB_TOL = 1e-3  # fp32 engine against fp32 trainer, as tests/unit/rollout/engines/vllm/test_vllm_engine.py
WRITER_SHARE = 0.25


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    writer = bpe_writer(tmp_path_factory.mktemp("writer-base"))
    with vllm_session({**DEBUG_MODEL, **FP32, "model.writer": writer, "engine.name": "vllm",
                       "engine.vllm.kv_cache_gb": 1, "engine.vllm.writer_share": WRITER_SHARE,
                       "engine.vllm.max_model_len": 512, "episode.max_prompt_tokens": 384,
                       "task.name": "arith", "task.level": 1, "episode.n_samples": 2,
                       "solver_sampling.max_new_tokens": 12, "episode.max_feedback_tokens": 8,
                       "logging.wandb": False, "logging.progress": False}) as (cfg, policies, engine):
        yield cfg, policies, engine, writer


def _sampled(policies, engine, role: str, text: str, seed: int = 0):
    """(prompt, ids, engine log-probs) of one sampled turn of ``role`` on its own chat template."""
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams

    prompt = ChatFormat(policies.tokenizer(role), policies.eos_ids(role)).first_prompt(text)
    g = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed), role)[0][0]
    assert g.token_ids
    return prompt, g.token_ids, g.logprobs


def test_each_role_is_served_by_an_engine_on_its_own_base(pair):
    from tosca_mlmt.models.loading import resolve_model
    from tosca_mlmt.rollout.engines.vllm import VLLMEngine, VLLMPair

    cfg, policies, engine, writer = pair
    assert isinstance(engine, VLLMPair)
    served = {r: e.llm.llm_engine.model_config.model for r, e in engine.engines.items()}
    assert served == {"solver": str(resolve_model("tiny-random")), "writer": writer}
    for role in ("solver", "writer"):
        prompt, ids, lps = _sampled(policies, engine, role, "What is 12 plus 30?")
        assert max(ids) < len(policies.tokenizer(role))
        assert max_diff(lps, teacher_forced(policies, role, prompt, ids)) < LOGPROB_TOL, role
    # the memory is split: writer_share of kv_cache_gb to the writer's engine, the rest to the solver's
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # vLLM's legacy env would set both
        kv = {r: e.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes for r, e in engine.engines.items()}
        assert kv == {"solver": int((1 - WRITER_SHARE) * 2**30), "writer": int(WRITER_SHARE * 2**30)}
    # one engine for two bases is refused before vLLM starts
    with pytest.raises(ValueError, match="different bases"):
        VLLMEngine(policies, cfg.engine.vllm)


def test_a_trained_writer_reaches_only_the_writers_engine(pair):
    _, policies, engine, _ = pair
    solver_syncs = engine.engines["solver"].syncs
    _, ids0, lps0 = _sampled(policies, engine, "writer", "Give short feedback.", seed=3)
    with contextlib.ExitStack() as stack:
        stack.enter_context(perturbed_lora_b(policies, "writer", seed=1, scale=0.5))
        prompt, ids, lps = _sampled(policies, engine, "writer", "Give short feedback.", seed=3)
        assert max_diff(lps, teacher_forced(policies, "writer", prompt, ids)) < LOGPROB_TOL
        moved = (ids, lps) != (ids0, lps0)
    assert moved, "the perturbed writer adapter must change what the writer's engine samples"
    assert engine.engines["writer"].syncs >= 1
    assert engine.engines["solver"].syncs == solver_syncs
    assert engine.syncs == sum(e.syncs for e in engine.engines.values())
    # restored: the writer's engine serves the base again
    prompt, ids, lps = _sampled(policies, engine, "writer", "Give short feedback.", seed=3)
    assert (ids, lps) == (ids0, lps0)


def test_an_episode_crosses_the_two_vocabularies(pair):
    from tosca_mlmt.rollout.engines.base import prefix_counts
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks import make_task

    cfg, policies, engine, _ = pair
    task = make_task(cfg.task)
    problems = task.load("train", 2).problems
    before = {r: prefix_counts(e) for r, e in engine.engines.items()}
    pair0 = prefix_counts(engine)
    episodes = EpisodeRunner(cfg, task, engine, policies).run(problems)
    assert len(episodes) == 2 * cfg.episode.n_samples
    wtok, stok = policies.tokenizer("writer"), policies.tokenizer("solver")
    for ep in episodes:
        z, fb, ref = ep.turns
        assert [t.role for t in ep.turns] == ["solver", "writer", "solver"]
        assert max(fb.prompt_ids + fb.response_ids) < len(wtok) < max(z.prompt_ids)
        assert len(fb.logprobs) == len(fb.response_ids)
        g = stok.decode(ref.prompt_ids[ref.feedback_span.start:ref.feedback_span.end])
        assert g == stok.decode(stok.encode(fb.text, add_special_tokens=False))
    # each turn's prompt tokens were counted by its own engine, and the pair reports the sum
    grew = {r: prefix_counts(e)[0] - before[r][0] for r, e in engine.engines.items()}
    assert grew["writer"] == sum(len(ep.turns[1].prompt_ids) for ep in episodes)
    assert prefix_counts(engine)[0] - pair0[0] == grew["solver"] + grew["writer"]
