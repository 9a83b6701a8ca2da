"""The output head the trainer's log-probs go through: the model's LM head plus what its forward does next.

Every trainer log-prob (PPO, the bonus, the writer's text loss, the HF engine's scoring) runs the trunk
once and the LM head in chunks over the last hidden states (tensors.token_logprobs_from_hidden), never
the model's own forward to its logits. Some forwards change the head's output: Gemma 2 soft-caps it at
``final_logit_softcapping`` (30), Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling``. Left out, the trainer scores another distribution than the one sampled (4 nats
apart on a tiny Gemma 2). :class:`OutputHead` applies those; :func:`check_output_head` proves at load,
on a short probe, that the chunked path gives the model's own logits, so a model that does something
else after its head stops there instead of training on wrong log-probs.
"""

from __future__ import annotations

import torch

from tosca_mlmt.errors import ModelError
from tosca_mlmt.tensors import fp32_logits


class OutputHead:
    """``model``'s LM head and the transform its forward applies to the head's output (``post``)."""

    def __init__(self, model: torch.nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
        self.name = type(base).__name__
        self.module = base.get_output_embeddings()
        cfg = base.config.get_text_config()
        self.softcap = getattr(cfg, "final_logit_softcapping", None) or None
        self.scale = getattr(cfg, "logit_scale", None)
        self.divisor = getattr(cfg, "logits_scaling", None)

    @property
    def weight(self) -> torch.Tensor:  # read at call time: DeepSpeed may swap the parameter
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.module, "bias", None)

    def post(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def check_output_head(model: torch.nn.Module, ids: list[int], what: str) -> None:
    """Refuse ``model`` (``what`` names it) when the chunked head path does not give its own logits
    on the probe ``ids``, or when an adapter sits on its LM head (the fp32 head reads the base
    weight alone). Tolerance: bf16 rounding of logits of that size."""
    head = OutputHead(model)
    if hasattr(head.module, "lora_A"):
        raise ModelError(f"{what}: model.lora.target_modules puts an adapter on the LM head, which the trainer's "
                         "log-probs (computed from the head's weight in fp32) would leave out; drop it from the list")
    x = torch.tensor([ids], device=head.weight.device)
    with torch.no_grad():
        out = model(input_ids=x, output_hidden_states=True)
        want = out.logits[0].float()
        got = fp32_logits(out.hidden_states[-1][0], head)
    gap = float((got - want).abs().max())
    if gap > 0.02 * float(want.abs().max()) + 0.05:
        raise ModelError(f"{what}: its forward does something after the LM head that the trainer's log-probs do "
                         f"not ({head.name}: logits {gap:.3g} apart on a probe); this architecture is not supported")
