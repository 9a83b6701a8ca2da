"""End a vLLM solver turn at its first complete answer line inside the engine (issue #15).

vLLM's stop strings are literal and the answer line is a pattern (engines/stop.py), so without this a
turn decodes on to eos or max_tokens and the cut is made afterwards. This logits processor
watches each request whose SamplingParams carry a pattern (``extra_args[EXTRA_KEY]``): once the
text it has sampled holds a complete answer line, the next token can only be end-of-sequence, and
the request ends there. What comes before is sampled as without it: vLLM takes the raw log-probs
before any logits processor, and other rows of the batch are left alone. ``apply_stop`` then cuts
the forced eos with everything after the line, so a turn returns the same ids, log-probs and
finish reason "answer" as the post-hoc cut, and the decoding after the line is never done.
(In bf16 a shorter-lived request changes later batch shapes, which moves other rows' logits by
rounding, as any change of batch composition does.)
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from tosca_mlmt.rollout.engines.stop import AnswerLine

# SamplingParams.extra_args key: {"regex": the answer-line pattern, "eos": the id to force}
EXTRA_KEY = "tosca_stop_at_answer"


class AnswerLineStop(AdapterLogitsProcessor):
    """Registered on every engine (``LLM(logits_processors=[...])``); acts only on requests that ask."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        # the tokenizer files vLLM serves, so the text is what the engine's own decode gives
        self._decode = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code).decode

    def is_argmax_invariant(self) -> bool:
        return False  # forcing eos changes the argmax: it must apply to greedy requests too

    def new_req_logits_processor(self, params):
        spec = (params.extra_args or {}).get(EXTRA_KEY)
        if not spec:
            return None
        line, eos, decode = AnswerLine(spec["regex"]), int(spec["eos"]), self._decode

        def force_eos_after_answer(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if not line.done(output_ids, decode):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[eos] = 0.0
            return forced

        return force_eos_after_answer
