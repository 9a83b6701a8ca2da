"""Architectures besides the embedded Llama, on the trainer's side.

Tiny random models are built locally on the embedded tokenizer: a Qwen2 (biased q/k/v, the most
common RL base), a Gemma 2 (its head tied to the embeddings; soft-capped attention scores and final
logits), a Phi-3 (q/k/v and gate/up fused in the checkpoint itself; an untied head) and a GPT-2
(Conv1D layers, whose LoRA deltas merge transposed; learned positions). Their weights
are drawn wide (``initializer_range``) for peaked logits, so a missing transform shows. Here: the
trainer's chunked log-probs are the model's own; tests/unit/rollout/engines/vllm/test_vllm_architectures.py
serves the same models from vLLM.
"""

import pytest

from conftest import FP32
from factories import ARCHS, build_arch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_pair(request, tmp_path_factory):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair

    folder = build_arch(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, PolicyPair(load_config(overrides={**FP32, "model.solver": folder}).model)


def test_the_trainers_chunked_log_probs_are_the_models_own(arch_pair):
    """train/batching.forward_logprobs (PPO, the bonus, the writer's text loss) against the model's own
    forward, fp32: equal, Gemma 2's final soft-cap included (4 nats apart without it)."""
    import torch

    from tosca_mlmt.train.batching import build_batch, forward_logprobs

    arch, pair = arch_pair
    model = pair.model("solver")
    ids = torch.randint(0, 40000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        got = forward_logprobs(model, build_batch([r[:1] for r in ids.tolist()], [r[1:] for r in ids.tolist()], 0))
    assert float((got[:, 1:] - want).abs().max()) < 1e-4, arch


@pytest.mark.parametrize("arch_pair", ["gemma2"], indirect=True)  # the one whose forward transforms its head's output
def test_a_transform_the_trainer_left_out_stops_the_load(arch_pair, monkeypatch):
    """check_output_head: with the head's transform taken away (as for a model whose forward does
    something unknown after its head), Gemma 2 is refused at load, naming the model."""
    from tosca_mlmt.errors import ModelError
    from tosca_mlmt.models import head

    _, pair = arch_pair
    probe = pair.tokenizer("solver").encode("The answer is: 42", add_special_tokens=False)
    head.check_output_head(pair.model("solver"), probe, "model.solver 'g'")
    monkeypatch.setattr(head.OutputHead, "post", lambda self, logits: logits)
    with pytest.raises(ModelError, match="model.solver 'g': its forward does something after the LM head"):
        head.check_output_head(pair.model("solver"), probe, "model.solver 'g'")


def test_an_adapter_on_the_lm_head_is_refused():
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ModelError
    from tosca_mlmt.models.policies import PolicyPair

    cfg = load_config(overrides={**FP32, "model.solver": "tiny-random", "model.lora.target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ModelError, match="model.lora.target_modules puts an adapter on the LM head"):
        PolicyPair(cfg.model)
