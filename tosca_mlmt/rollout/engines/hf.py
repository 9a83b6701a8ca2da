"""transformers ``generate`` engine: batched, left-padded, KV-cached."""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from tosca_mlmt.models.head import OutputHead
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.parallel import full_parameters
from tosca_mlmt.rollout.engines.base import Generation, SamplingParams
from tosca_mlmt.rollout.engines.stop import AnswerLine, apply_stop
from tosca_mlmt.seeds import seeded
from tosca_mlmt.tensors import onto, pad_batch, pad_pairs, token_logprobs_from_hidden


class _RawLogprobRecorder(LogitsProcessor):
    """Records log-softmax of the raw logits for each sampled token, then applies our warpers.

    HF warps scores before sampling and only exposes the warped ones, so we run generate
    with no HF warpers at all and do temperature/top-k/top-p here, after reading the raw
    distribution. The token picked at step t is only visible at step t+1 (as the last
    input id), so we keep one step of log-probs and gather it one call late.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.prev: torch.Tensor | None = None  # [B, V] log-probs of the previous step
        self.taken: list[torch.Tensor] = []  # per step [B]

    def gather_last(self, last_ids: torch.Tensor) -> None:
        if self.prev is not None:
            self.taken.append(self.prev.gather(-1, last_ids[:, None]).squeeze(-1))
            self.prev = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.gather_last(input_ids[:, -1])
        scores = scores.float()
        self.prev = torch.log_softmax(scores, dim=-1)
        p = self.params
        if p.greedy:
            return scores
        scores = scores / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scores, min(p.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_s, idx = torch.sort(scores, descending=True, dim=-1)
            cum = torch.softmax(sorted_s, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_s, dim=-1) > p.top_p  # keep the token that crosses top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
        return scores


class _AnswerLineStop(StoppingCriteria):
    """Marks a row done once its sampled tokens end the turn (stop.AnswerLine), so decoding stops
    early; the exact cut is made afterwards by ``apply_stop``."""

    def __init__(self, tok, prompt_width: int, pattern: str):
        self.tok, self.width, self.line = tok, prompt_width, AnswerLine(pattern)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        rows = input_ids[:, self.width:].tolist()
        return torch.tensor([self.line.done(r, self.tok.decode) for r in rows], dtype=torch.bool, device=input_ids.device)


class HFEngine:
    name = "hf"

    def __init__(self, policies: PolicyPair, batch_size: int = 32):
        self.policies = policies
        self.batch_size = batch_size

    def sync_weights(self, policy: str) -> float:
        return 0.0  # generation reads the trainer's live module

    def close(self) -> None:
        pass

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]], policy: str) -> list[list[float]]:
        """One forward of the live model per batch of ``batch_size`` pairs (no autocast: the
        model's own dtype, as ``generate`` runs)."""
        model = self.policies.model(policy)
        tok = self.policies.tokenizer(policy)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        head = OutputHead(model)
        out: list[list[float]] = []
        for start in range(0, len(prompts), self.batch_size):
            ps, rs = prompts[start: start + self.batch_size], responses[start: start + self.batch_size]
            # right-padded; the head runs on the response positions alone
            ids, attn, keep = onto(model, *pad_pairs(ps, rs, pad_id))
            with self.policies.use(policy), full_parameters(model):
                hidden = model(input_ids=ids, attention_mask=attn, output_hidden_states=True,
                               logits_to_keep=1).hidden_states[-1]
                lp = token_logprobs_from_hidden(hidden, head, ids, 256, keep=keep).cpu()  # [B, T]
            out += [lp[j, len(p): len(p) + len(r)].tolist() for j, (p, r) in enumerate(zip(ps, rs))]
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, policy: str) -> list[list[Generation]]:
        out: list[list[Generation]] = []
        # Expand n samples per prompt up front so a batch never straddles the same rows twice.
        flat = [p for p in prompts for _ in range(params.n)]
        gens: list[Generation] = []
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            # One generator per chunk, seeded from (seed, chunk start): results do not depend
            # on what ran before in the process.
            gens += self._generate_batch(chunk, params, policy, seed=params.seed * 1_000_003 + start)
        for i in range(len(prompts)):
            out.append(gens[i * params.n : (i + 1) * params.n])
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, policy: str, seed: int) -> list[Generation]:
        model = self.policies.model(policy)
        tok = self.policies.tokenizer(policy)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos_ids = self.policies.eos_ids(policy)
        ids, attn = onto(model, *pad_batch(prompts, pad_id, left=True))
        width = ids.shape[1]
        rec = _RawLogprobRecorder(params)
        gc = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not params.greedy, temperature=1.0, top_k=0,
            top_p=1.0, num_beams=1, eos_token_id=eos_ids, pad_token_id=pad_id,
        )
        # transformers samples from torch's global generator: seed it for this call only, and hand
        # the caller's state back afterwards. ZeRO-3 partitions the weights: generation needs
        # them whole (a no-op otherwise).
        with seeded(seed), self.policies.use(policy), full_parameters(model), _only_ours(model):
            stops = StoppingCriteriaList([_AnswerLineStop(tok, width, params.stop_regex)] if params.stop_regex else [])
            seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gc,
                                  logits_processor=LogitsProcessorList([rec]), stopping_criteria=stops)
        rec.gather_last(seqs[:, -1])
        resp = seqs[:, width:].cpu()
        lps = torch.stack(rec.taken, dim=1).cpu() if rec.taken else torch.zeros(len(prompts), 0)
        results = []
        for i in range(len(prompts)):
            toks = resp[i].tolist()
            n, reason = len(toks), "length"
            for j, t in enumerate(toks):
                if t in eos_ids:
                    n, reason = j + 1, "stop"
                    break
            gen = Generation(tuple(toks[:n]), tuple(float(x) for x in lps[i, :n]), reason)
            results.append(apply_stop(gen, tok.decode, params.stop_regex))
        return results


@contextlib.contextmanager
def _only_ours(model):
    """transformers fills every field a GenerationConfig leaves unset from the model's own
    generation_config.json (a checkpoint's repetition_penalty, min_p, typical_p, ...): sampling would
    then not be the configured one, and a repetition penalty, applied before _RawLogprobRecorder,
    would change the recorded raw log-probs. Inside, the model's is a bare GenerationConfig."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved
