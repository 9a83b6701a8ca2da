"""vLLM offline engine with weight sync.

vLLM serves merged weights (base + one adapter), so the solver and the writer are two
weight sets. When they are identical (both adapters still zero, the usual state at
the start of training) one engine serves both with no swap; otherwise the engine
serves whichever policy the next turn needs. On an in-process CPU engine
(``engine.vllm.direct_sync``, kernels.py) each policy's layers are packed into kernels
once per adapter change and kept, so a swap sets the layers' kernels and merges nothing.
Elsewhere vLLM reloads the policy's weights: only the modules the adapters change
(``engine.vllm.delta_sync``), each fused vLLM layer whole (sync.py says why), or the
full state dict where a delta cannot be trusted. With ``engine.vllm.serve_adapters`` vLLM
serves the adapters themselves instead: each policy is a LoRA request on the base it loaded, a
sync moves only that policy's adapter tensors, and the two policies never displace each other.
An engine holds one base: a writer on a base of its own gets a second engine (pair.py).
The merged weights come from models/merge.py. How vLLM starts (in-process on CPU, on the rank's
GPU) is launch.py; how weights reach the worker (``engine.vllm.weight_sync``: in memory, or through
a safetensors file) is sync.py.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import torch

from tosca_mlmt.config import VLLMConfig
from tosca_mlmt.models import merge
from tosca_mlmt.rollout.engines.base import Generation, SamplingParams
from tosca_mlmt.rollout.engines.vllm import launch, placement, sync
from tosca_mlmt.rollout.engines.vllm.kernels import kernel_sets
from tosca_mlmt.rollout.engines.stop import apply_stop


class VLLMEngine:
    name = "vllm"

    def __init__(self, policies, cfg: VLLMConfig, seed: int = 0, roles: tuple[str, ...] = tuple(launch.LORA_IDS),
                 share: float = 1.0):
        """``roles``: the policies this engine serves, all on one base (pair.py gives each base an
        engine of its own); ``share``: its part of gpu_memory_utilization (GPU) or kv_cache_gb (CPU)."""
        launch.configure_cpu_env(cfg)
        from vllm import LLM

        if not policies.shared_base and len(roles) > 1:
            raise ValueError("solver and writer have different bases: one VLLMEngine per base (vllm.pair.VLLMPair)")
        self.policies = policies
        self.cfg = cfg
        self.roles = tuple(roles)
        self.on_cpu = not torch.cuda.is_available()
        self.serve_adapters = cfg.serve_adapters
        self.extension = launch.uses_extension(cfg)
        kwargs = launch.llm_kwargs(policies, cfg, self.roles, seed, share, self.on_cpu)
        self.stop_in_engine = cfg.stop_in_engine
        self.continuous = cfg.continuous_episodes  # rollout/continuous.py
        with placement.on_rank_gpu(self.on_cpu):  # each rank's engine on the rank's own GPU
            self.llm = LLM(**kwargs)
        self.loaded_key: str | None = None  # weights_key() of the weights vLLM holds now
        self.sync_seconds = 0.0  # time in syncs that pushed weights (key check + merge + reload)
        self.check_seconds = 0.0  # time in sync checks that found nothing to load (~0.02 s each on the 135M model)
        self.syncs = 0  # syncs that changed what vLLM serves (kernels installed, or a reload)
        # prompt tokens handed to vLLM and those its prefix cache served (turn 3 extends turn 1's
        # ids, so a warm cache skips most of a refine's prefill): the prefix hit rate
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        # tokens vLLM decoded and those the turns kept after the answer-line cut: the difference is
        # decoding past an answer (what stop_in_engine saves)
        self.decoded_tokens = 0
        self.kept_tokens = 0
        self.weight_sync = cfg.weight_sync  # "memory" | "file"; benchmarks switch it on a live engine
        # a multiprocess engine's staging buffer for memory syncs (rpc_transport=shared); unused in-process
        self.stage = sync.SharedStage(cfg.rpc_bucket_mb * 2**20) if cfg.rpc_transport == "shared" else None
        self.sync_route: str | None = None  # how the last sync travelled: kernels, runner, shared, rpc or file
        # what it carried: "direct" (kernels built), "cached" (kept kernels), "delta", "full" or "adapter"
        self.sync_kind: str | None = None
        # vLLM's fused layers, or None where deltas are off or unsafe (sync.packed_modules)
        packed = sync.packed_modules(self.llm)
        self.packed = packed if cfg.delta_sync else None
        # HF modules whose weights in vLLM may differ from the base (None: unknown, push in full);
        # empty at start-up, when vLLM holds the base it read from disk.
        self.stale: set[str] | None = set()
        # serve_adapters: weights_key() of the adapter each policy's LoRA id holds in vLLM
        self.served: dict[str, str] = {}
        # direct_sync: the packed kernels of the base and of each policy (None: the weight_sync route)
        self.kernels = (kernel_sets(self.llm, sync.inprocess_runner(self.llm), packed, policies, self.roles)
                        if cfg.direct_sync and not self.serve_adapters else None)
        # submit/step: the requests in flight (id -> tag, policy, stop regex) and the next id's number
        self._stream: dict[str, tuple[object, str, str | None]] = {}
        self._stream_ids = 0
        self.route_norms(cfg.cpu_norm_kernel)
        self.sync_weights(self.roles[0])

    def route_norms(self, on: bool) -> int:
        """engine.vllm.cpu_norm_kernel on a live engine: route RMSNorm to vLLM's C++ kernel (``on``)
        or back to vLLM's own PyTorch ops; returns how many layers run the kernel. An eager CPU
        engine only (norm.py): in this process, or in a multiprocess engine's worker through
        the worker extension, where one is installed."""
        from tosca_mlmt.rollout.engines.vllm import norm

        if not self.on_cpu or not self.cfg.enforce_eager:
            return 0
        runner = sync.inprocess_runner(self.llm)
        if runner is not None:
            return norm.install(runner.get_model(), on)
        if self.extension:
            return sum(self.llm.collective_rpc("tosca_route_norms", args=(on,)))
        return 0

    def close(self) -> None:
        """Stop vLLM now: a multiprocess engine's core process ends and, on a GPU, its memory
        (gpu_memory_utilization of the card) is free for the next engine in this process, even
        where something still holds the LLM, which dropping our reference alone would not ensure.
        A second call does nothing."""
        llm, self.llm = getattr(self, "llm", None), None
        self.kernels = None  # packed kernels of an in-process CPU engine hold its layers' memory
        self.stage = None  # and a multiprocess one's staging buffer its size in shared memory
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm, core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ weights
    def weights_key(self, policy: str) -> str:
        """A cheap identity of the merged weights ``policy`` would serve (PolicyPair.adapter_key:
        "base" or a hash of the live LoRA tensors, 0.022 s for r=16 all-linear on 135M). Hashing the
        full merged state dict instead cost ~2 s per generate call (merge ~1 s + sha256 of 540 MB)."""
        return self.policies.adapter_key(policy)

    def sync_weights(self, policy: str, force: bool = False) -> float:
        """Load ``policy``'s merged weights unless vLLM already holds exactly them.

        Returns the seconds spent (0.0 when nothing had to move; the ~0.02 s check then counts
        in ``check_seconds``). The base weights are assumed frozen; after changing them in
        place, call with ``force=True``, which reloads the full state dict (direct_sync: the
        base, whose kernels are then rebuilt with every policy's).
        """
        if self.serve_adapters:
            return self._sync_adapter(policy, force)
        t0 = time.perf_counter()
        key = self.weights_key(policy)
        if key == self.loaded_key and not force:
            self.check_seconds += time.perf_counter() - t0
            return 0.0
        # vLLM read the base from disk at start-up: nothing to push while the policy is the base.
        if not (force or self.loaded_key is not None or key != "base"):
            self.loaded_key = key
            self.check_seconds += time.perf_counter() - t0
            return 0.0
        if self.kernels is not None:
            self._sync_kernels(policy, key, force)
        else:
            self._sync_reload(policy, force)
        self.loaded_key = key
        self.syncs += 1
        dt = time.perf_counter() - t0
        self.sync_seconds += dt
        return dt

    def _sync_reload(self, policy: str, force: bool) -> None:
        """Push ``policy``'s merged weights by vLLM's reload (``weight_sync``): a delta or in full.
        Through a multiprocess engine's shared stage each layer group is merged only as its bucket
        fills, so the whole merged state dict never exists at once (an 8B model's ~14 GiB on a GPU)."""
        adapted = self.policies.adapted_modules(policy)
        modules = self.delta_plan(adapted, force)
        stage = self.stage
        if (stage is None or stage.refused or self.weight_sync != "memory"
                or sync.inprocess_runner(self.llm) is not None):
            self.load_state_dict(merge.merged_state_dict(self.policies, policy, modules), partial=modules is not None,
                                 reset=force)
        else:
            names = merge.sync_modules(self.policies, policy) if modules is None else sorted(modules)
            parts = merge.merged_parts(self.policies, policy, [set(g) for g in sync.layer_groups(names)])
            self.sync_route = stage.push(self.llm, parts, partial=modules is not None)
            self.sync_kind = "delta" if modules is not None else "full"
            if force:
                self.llm.reset_prefix_cache()
        if modules is None:  # after a full push, only the adapted modules differ from the base
            modules = None if adapted is None or self.packed is None else sync.delta_modules(adapted, self.packed)
        self.stale = modules

    def _sync_kernels(self, policy: str, key: str, force: bool) -> None:
        """direct_sync: serve ``policy`` from its kept kernels, built first if its adapter changed."""
        ks = self.kernels
        if force:  # the base changed in place: vLLM reloads it whole and every kept kernel goes
            sync.push(self.llm, merge.merged_state_dict(self.policies, policy, lora=False), "memory", reset=True)
            ks.reset()
            self.stale = set()
        held = ks.held.get(policy)
        if key == "base":
            kernels, self.sync_kind = {}, "cached"
        elif held is not None and held[0] == key:
            kernels, self.sync_kind = held[1], "cached"
        else:
            ks.held.pop(policy, None)  # its old kernels go before the new ones are built
            kernels = ks.build(lambda outs: merge.merge_into(self.policies, policy, outs), self.policies.adapted_modules(policy))
            ks.held[policy] = (key, kernels)
            self.sync_kind = "direct"
        ks.install(kernels)
        self.sync_route = "kernels"

    def _sync_adapter(self, policy: str, force: bool) -> float:
        """serve_adapters: give vLLM ``policy``'s adapter unless its LoRA slot holds it already. A
        zero adapter ("base") is served as the base, with no LoRA request and nothing to move."""
        t0 = time.perf_counter()
        key = self.weights_key(policy)
        if (key == self.served.get(policy) and not force) or key == "base":
            self.served[policy] = key
            self.check_seconds += time.perf_counter() - t0
            return 0.0
        adapter = self.policies.adapter_state(policy)  # fresh copies: push_lora consumes them
        self.sync_route = sync.push_lora(self.llm, launch.LORA_IDS[policy], adapter, self.policies.adapter_config(policy))
        self.sync_kind = "adapter"
        self.served[policy] = key
        self.syncs += 1
        dt = time.perf_counter() - t0
        self.sync_seconds += dt
        return dt

    def lora_request(self, policy: str):
        """The LoRARequest that serves ``policy`` (None: the base). Its name is the adapter's
        weights_key, and vLLM hashes prefix-cache blocks by that name, so KV cached under an
        older adapter is never reused and nothing has to be reset after a sync."""
        key = self.served.get(policy, "base") if self.serve_adapters else "base"
        if key == "base":
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=key, lora_int_id=launch.LORA_IDS[policy], lora_path=f"in-memory:{policy}")

    def delta_plan(self, adapted: set[str] | None, force: bool = False) -> set[str] | None:
        """The HF modules a delta sync pushes for a policy whose adapter touches ``adapted``
        (policies.adapted_modules), or None for a full push (forced, deltas off or unsafe, an
        adapter with modules_to_save, or vLLM's state unknown). The delta holds
        the policy's adapted modules and those an earlier delta (of the other policy) changed,
        which must go back to the base, each with the modules fused into the same vLLM layer."""
        if force or self.packed is None or adapted is None or self.stale is None:
            return None
        return sync.delta_modules(adapted | self.stale, self.packed)

    def load_state_dict(self, sd: dict[str, torch.Tensor], partial: bool = False, reset: bool = True) -> None:
        """Push an HF-named state dict into the running engine (``self.weight_sync``): complete,
        or with ``partial`` a delta of whole fused layers (sync.delta_modules). ``reset``: drop
        the prefix cache (sync.push); a sync keeps it, as its KV is salted (``cache_salt``)."""
        self.sync_route = sync.push(self.llm, sd, self.weight_sync, partial, reset, self.stage)
        self.sync_kind = "delta" if partial else "full"

    # ------------------------------------------------------------------ generation
    def sampling_params(self, params: SamplingParams, policy: str):
        """The vLLM SamplingParams for ``params`` (also used by benchmarks for raw baselines)."""
        from vllm import SamplingParams as VSP

        # logprobs=0: the sampled token's logprob only; vLLM's default logprobs_mode is
        # raw_logprobs (before temperature/top-k/top-p), i.e. raw log pi. detokenize=False:
        # engines deal in ids only, so skip incremental detokenization and decoded_token.
        eos = self.policies.eos_ids(policy)
        extra = None
        if params.stop_regex and self.stop_in_engine:
            from tosca_mlmt.rollout.engines.vllm.stop import EXTRA_KEY

            extra = {EXTRA_KEY: {"regex": params.stop_regex, "eos": eos[0]}}
        return VSP(n=params.n, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
                   logprobs=0, seed=params.seed, stop_token_ids=eos, detokenize=False, extra_args=extra)

    def score(self, prompts: list[list[int]], responses: list[list[int]], policy: str) -> list[list[float]]:
        """Prompt log-probs of prompt + response: one prefill each and a single decoded token that
        is thrown away. vLLM computes them as log_softmax of the raw logits (no temperature, no
        logits processor), as it does the sampling log-probs of ``generate``."""
        from vllm import SamplingParams as VSP

        self.sync_weights(policy)
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        # With LoRA enabled, vLLM maps the LM head's adapter per *sampled* row, not per prompt position,
        # so prompt log-probs of a batch fail (vllm#16668, #29955); one request per call is right as long
        # as no adapter sits on the LM head (whose delta prompt log-probs drop, vllm#51594): PolicyPair
        # refuses one (models/head.check_output_head).
        per_call = 1 if self.serve_adapters else max(1, len(seqs))
        outs = []
        for i in range(0, len(seqs), per_call):
            outs += self.llm.generate(self.requests(seqs[i: i + per_call]), sp,
                                      use_tqdm=False, lora_request=self.lora_request(policy))
        self.prompt_tokens += sum(len(s) for s in seqs)  # counted, never cached: prompt log-probs skip the cache
        self.cached_prompt_tokens += sum(o.num_cached_tokens or 0 for o in outs)
        # prompt_logprobs[i] holds {token: Logprob} for seq[i], the sampled id among them (None at i = 0)
        return [[o.prompt_logprobs[i][s[i]].logprob for i in range(len(p), len(s))]
                for o, s, p in zip(outs, seqs, prompts)]

    def requests(self, prompts: list[list[int]]) -> list[dict]:
        """vLLM prompts for ``prompts`` under the weights vLLM serves now (call after sync_weights).

        Merged weights are salted by their weights_key: vLLM hashes the salt into every prefix-cache
        block, so KV computed under one policy's weights is never served to another and a sync need
        not empty the cache. The solver's turn-1 KV then outlives the writer's turn, and the refine
        (whose ids extend turn 1's) is prefilled from it. The base vLLM read from disk goes unsalted,
        like any bare LLM.generate call; with serve_adapters the LoRA name already keys the cache."""
        from vllm.inputs import TokensPrompt

        salt = None if self.serve_adapters or self.loaded_key in (None, "base") else self.loaded_key
        if salt is None:
            return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        return [TokensPrompt(prompt_token_ids=list(p), cache_salt=salt) for p in prompts]

    def generate(self, prompts: list[list[int]], params: SamplingParams, policy: str) -> list[list[Generation]]:
        self.sync_weights(policy)
        # vLLM refuses n > 1 at temperature 0 ("n must be 1 when using greedy sampling"); greedy
        # samples of one prompt are all the same, so decode once and hand out n copies, as many
        # as the HF engine returns for the same config.
        copies = params.n if params.greedy else 1
        one = replace(params, n=1) if copies > 1 else params
        # one request per prompt, each with its own seed (SamplingParams.seeds)
        sp = [self.sampling_params(replace(one, seed=params.prompt_seed(i)), policy) for i in range(len(prompts))]
        outs = self.llm.generate(self.requests(prompts), sp, use_tqdm=False,
                                 lora_request=self.lora_request(policy))
        return [self._generations(o, policy, params.stop_regex) * copies for o in outs]

    def _generations(self, out, policy: str, stop_regex: str | None) -> list[Generation]:
        """One finished vLLM RequestOutput as Generations, counted in the engine's token counters."""
        eos = set(self.policies.eos_ids(policy))
        tok = self.policies.tokenizer(policy)
        self.prompt_tokens += len(out.prompt_token_ids or ())
        self.cached_prompt_tokens += out.num_cached_tokens or 0
        gens = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if c.logprobs else [0.0] * len(ids)
            # vLLM keeps the eos / stop token as the last entry of token_ids (with its logprob),
            # which is the Generation contract; "stop" therefore means "ends with an eos id",
            # exactly as in the HF engine.
            reason = "stop" if c.finish_reason == "stop" and ids and ids[-1] in eos else "length"
            gens.append(apply_stop(Generation(tuple(ids), tuple(lps), reason), tok.decode, stop_regex))
            self.decoded_tokens += len(ids)
            self.kept_tokens += len(gens[-1].token_ids)
        return gens

    # ------------------------------------------------------------------ continuous episodes
    def mixes_roles(self) -> bool:
        """Whether solver and writer requests can share one vLLM batch (rollout/continuous.py): vLLM
        serves both adapters as LoRA requests, or both policies' merged weights are the same (two
        untrained adapters, as in a first collect)."""
        if set(self.roles) != set(launch.LORA_IDS):
            return False
        return self.serve_adapters or self.weights_key("solver") == self.weights_key("writer")

    def open_stream(self, roles: tuple[str, ...]) -> None:
        """Ready the engine for ``submit``: the weights of every role that will submit, at once.
        Merged weights hold one policy at a time, so several roles need ``mixes_roles``."""
        if len(roles) > 1 and not self.mixes_roles():
            raise RuntimeError(f"roles {roles} cannot share a vLLM batch: their merged weights differ "
                               "and the engine does not serve adapters")
        if self._stream:
            raise RuntimeError(f"{len(self._stream)} requests of an earlier stream are still in flight")
        for role in roles:
            self.sync_weights(role)

    def submit(self, tag, prompt: list[int], params: SamplingParams, policy: str) -> None:
        """Queue one request (n = 1) under ``policy``; ``step`` hands its Generation back with ``tag``."""
        from vllm.sampling_params import RequestOutputKind

        if params.n != 1:
            raise ValueError("submit takes one sample per request (n = 1); submit each sample with its own seed")
        sp = self.sampling_params(params, policy)
        sp.output_kind = RequestOutputKind.FINAL_ONLY
        # ids of their own: LLM.generate numbers its requests from a counter of its own
        rid = f"tosca-{self._stream_ids}"
        self._stream_ids += 1
        req = self.requests([prompt])[0]
        # rendered as LLM.generate renders its prompts (vLLM deprecates raw prompts in add_request)
        render = getattr(self.llm, "_preprocess_cmpl_one", None)
        self.llm.llm_engine.add_request(rid, render(req) if render else req, sp, lora_request=self.lora_request(policy))
        self._stream[rid] = (tag, policy, params.stop_regex)

    def step(self) -> list[tuple[object, Generation]]:
        """One vLLM engine step: the (tag, Generation) of each request it finished, in the order
        vLLM returned them (the same for the same requests: the scheduler is deterministic)."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                tag, policy, stop_regex = self._stream.pop(out.request_id)
                done.append((tag, self._generations(out, policy, stop_regex)[0]))
        return done

    def abort_stream(self) -> None:
        """Drop the requests still in flight (a run that failed midway), so none of them ends
        inside a later LLM.generate call, which steps every request vLLM holds."""
        if self._stream:
            self.llm.llm_engine.abort_request(list(self._stream))
            self._stream.clear()

    @property
    def streaming(self) -> bool:
        """Requests submitted and not yet handed back by ``step``."""
        return bool(self._stream)
