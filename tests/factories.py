"""Objects that tests in several folders build the same way: hand-made episodes, lower-level
trajectories sampled from a model, snapshot edits. Test modules import from here (or take
conftest.py's fixtures), never from one another, so moving or deleting a test module breaks no
other (tests/properties/test_architecture.py checks this)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from tosca_mlmt.records import Episode, Turn
from tosca_mlmt.tasks.base import Problem

# ---------------------------------------------------------------- hand-made episodes

# (first attempt right?, refine right?, feedback text): one episode per outcome the snapshot readers
# tell apart (wrong -> right twice: one of them leaks the gold answer). Problem i's gold is i + 10.
OUTCOME_CASES = [(False, True, "The answer is 10."), (True, False, "Check [bold]your[/] sum."),
                 (True, True, "Looks right."), (False, False, "Recompute 3 + 4."),
                 (False, True, "Read the question again.")]


def make_episodes(n=3, reward_shift=0.0, cases=None) -> list[Episode]:
    """Three-turn arith episodes (solve, feedback, refine) with no model behind them.

    Without ``cases``: ``n`` episodes, each wrong then right (rewards 0 + ``reward_shift``, then 1),
    the refine prompt extending the solve turn token-exactly as the trajectory code requires. With
    ``cases`` (e.g. OUTCOME_CASES): one episode per (first right?, refine right?, feedback text),
    with readable turn texts ("I think 99.", "So 10.") for what the readers print."""
    if cases is not None:
        return [_case_episode(i, *case) for i, case in enumerate(cases)]
    eps = []
    for i in range(n):
        p = Problem("arith", f"arith-L1-{i:06d}", f"What is {i} + 1?", str(i + 1), "train", {"level": 1})
        ep = Episode(f"{p.id}/s0", p, 0)
        ep.turns = [
            Turn(0, 0, "solver", "solve", [1, 2, 3], [7, 8, 2], [-0.1, -0.2, -0.3], "stop", "x", reward=0.0 + reward_shift,
                 correct=False, extracted="9"),
            Turn(1, 1, "writer", "feedback", [1, 5, 7, 8, 6], [9, 2], [-1.0, -0.5], "stop", "check", strategy=2,
                 strategy_name="verify", behaviour_prob=1 / 6, behaviour_probs=[1 / 6] * 6, state_len=4),
            Turn(2, 1, "solver", "refine", [1, 2, 3, 7, 8, 2, 4, 9, 4], [5, 2], [-0.4, -0.01], "stop", "y",
                 reward=1.0, correct=True, extracted=str(i + 1), info={"pass_rate": 1.0}),
        ]
        eps.append(ep)
    return eps


def _case_episode(i: int, c1: bool, c2: bool, g: str) -> Episode:
    gold = str(i + 10)
    p = Problem("arith", f"arith-L1-{i:06d}", f"What is {i + 3} + 7?", gold, "train", {"level": 1})
    ep = Episode(f"{p.id}/s0", p, 0)
    ep.turns = [
        Turn(0, 0, "solver", "solve", [1, 2], [3], [-0.1], "stop", f"I think {gold if c1 else 99}.",
             reward=float(c1), correct=c1, extracted=gold if c1 else "99"),
        Turn(1, 1, "writer", "feedback", [1, 2, 3], [4], [-0.2], "stop", g, strategy=1,
             strategy_name="reread_question", behaviour_prob=0.5, behaviour_probs=[0.5, 0.5], state_len=2),
        Turn(2, 1, "solver", "refine", [1, 2, 3, 4], [5], [-0.3], "stop", f"So {gold if c2 else 98}.",
             reward=float(c2), correct=c2, extracted=gold if c2 else "98", info={"counterfactual_reward": 0.0}),
    ]
    return ep


# the strategies patterned_episode's feedback turns name
PATTERN_STRATEGIES = ["verify", "hint", "explain"]


def patterned_episode(i: int, pattern, strategies, lengths, prefix: str) -> Episode:
    """Solver attempts correct per ``pattern`` (reward 1/0), one feedback turn per later attempt."""
    p = Problem("arith", f"{prefix}-{i:03d}", f"What is {i} + 1?", str(i + 1), "train", {"level": 1})
    ep = Episode(f"{p.id}/s0", p, 0)
    ep.turns = [Turn(0, 0, "solver", "solve", [1, 2], [7, 2], [-0.1, -0.2], "stop", "x", reward=float(pattern[0]),
                     correct=pattern[0])]
    for k, (ok, name, n) in enumerate(zip(pattern[1:], strategies, lengths), 1):
        i0 = len(ep.turns)
        ep.turns += [
            Turn(i0, k, "writer", "feedback", [1, 3], list(range(n)), [-0.5] * n, "stop", "fb",
                 strategy=PATTERN_STRATEGIES.index(name), strategy_name=name, behaviour_prob=1 / 3,
                 behaviour_probs=[1 / 3] * 3, state_len=1),
            Turn(i0 + 1, k, "solver", "refine", [1, 4], [5, 2], [-0.3, -0.1], "stop", "y", reward=float(ok),
                 correct=ok)]
    return ep


def rewarded_episode(eid: str, solver_rewards: list[float], actions: list[int], level: int = 2,
                     n_strategies: int = 4) -> Episode:
    """Solver attempts rewarded ``solver_rewards``, feedback ``actions`` between them (the upper level's
    transitions), drawn uniformly from ``n_strategies``."""
    ep = Episode(eid, Problem("arith", f"p-{eid}", "What is 1 + 1?", "2", "train", {"level": level}), 0)
    for k, r in enumerate(solver_rewards):
        kind = "solve" if k == 0 else "refine"
        if k > 0:
            a = actions[k - 1]
            ep.turns.append(Turn(len(ep.turns), k, "writer", "feedback", [1, 2, 3, 10 + k, 90, 91], [50 + k, 51],
                                 [-0.1, -0.2], "stop", "fb", strategy=a, strategy_name=f"s{a}", behaviour_prob=0.25,
                                 behaviour_probs=[0.25] * n_strategies, state_len=4))
        ep.turns.append(Turn(len(ep.turns), k, "solver", kind, [7], [8], [-0.5], "stop", "x", reward=r, correct=r > 0))
    return ep


# ---------------------------------------------------------------- snapshots


def rewrite_manifest(folder, edit, rehash=True):
    """An edit made by someone who knows the format: the manifest's own hash recomputed."""
    from tosca_mlmt.store.manifest import manifest_sha

    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    if rehash:
        m["manifest_sha256"] = manifest_sha(m)
    (folder / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------- lower-level trajectories


def cut_first_attempt(n=2):
    """make_episodes(n)'s trajectories, the first episode's first attempt cut at max_new_tokens."""
    from tosca_mlmt.lower.trajectory import episode_to_trajectory

    eps = make_episodes(n)
    eps[0].turns[0].finish_reason = "length"  # ran into max_new_tokens
    return [episode_to_trajectory(e) for e in eps]


def sampled_lower_setup(cfg, policies):
    """(cfg with a small, fast PPO update, trajectories of 2 arith problems sampled by ``policies``)."""
    from tosca_mlmt.lower.trajectory import episode_to_trajectory
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks.arith import ArithTask

    cfg = replace(cfg, lower=replace(cfg.lower, minibatch_size=4, lr=5e-3, kl_coef=0.05,
                                     bonus=replace(cfg.lower.bonus, coef=0.5, clip=100.0)))
    task = ArithTask(1)
    eps = EpisodeRunner(cfg, task, HFEngine(policies, 8), policies).run(task.load("train", 2).problems)
    return cfg, [episode_to_trajectory(e) for e in eps]


def bf16_pair(cfg):
    """(cfg, PolicyPair) with bf16 base weights and bf16 autocast."""
    import torch

    from tosca_mlmt.models.policies import PolicyPair

    cfg = replace(cfg, model=replace(cfg.model, dtype="bfloat16"), lower=replace(cfg.lower, autocast="bf16"))
    policies = PolicyPair(cfg.model, seed=0)
    assert policies.dtype == torch.bfloat16
    return cfg, policies


# ---------------------------------------------------------------- model bases and chat templates


# config class; whether the head is tied to the embeddings; whether vLLM fuses its layers (q/k/v, gate/up),
# which the direct kernels and delta syncs need (GPT-2's Conv1D layers: every sync is a full reload)
ARCHS = {"qwen2": ("Qwen2Config", True, True), "gemma2": ("Gemma2Config", True, True),
         "phi3": ("Phi3Config", False, True), "gpt2": ("GPT2Config", True, False)}


def build_arch(arch: str, folder) -> str:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tosca_mlmt.models.loading import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    name, tied, _ = ARCHS[arch]
    config = getattr(transformers, name)(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=tied,
        initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # a model card's sampling defaults, which no engine may apply to the run's own sampling
    model.generation_config.update(repetition_penalty=5.0, no_repeat_ngram_size=1, do_sample=True, top_k=3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def bpe_writer(folder) -> str:
    """A tiny random Llama on a byte-level BPE trained here (352 ids, none shared with the solver's
    vocabulary), saved to ``folder``: a writer base whose ids must cross to the solver as text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = ["What is 12 plus 30? The answer is: 42. Check your calculation carefully.",
            "You are a concise tutor. Read the student's attempt and write short feedback."] * 50
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# Templates written in the shape of other model families, on SmolLM2's vocabulary (ids 0/1/2 are
# <|endoftext|>, <|im_start|>, <|im_end|>): each closes an assistant turn with <|im_end|>.
_TURN = "{{ '<|im_start|>' + role + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
_ROLE = "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
_GEN = "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
TEMPLATES = {
    # Gemma 2: a system message raises
    "refuses_system": ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                       "{% endif %}{% for m in messages %}" + _ROLE + _TURN + "{% endfor %}" + _GEN),
    # a template that renders only user and assistant turns, silently
    "drops_system": "{% for m in messages if m['role'] != 'system' %}" + _ROLE + _TURN + "{% endfor %}" + _GEN,
    # Llama 3.2: the date in the system block comes from the clock unless date_string is given
    "dated": ("{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
              "{{ '<|im_start|>system\\nToday Date: ' + date_string + '<|im_end|>\\n' }}"
              "{% for m in messages %}" + _ROLE + _TURN + "{% endfor %}" + _GEN),
    # Qwen3: enable_thinking=false opens the reply with an empty thinking block
    "thinks": ("{% for m in messages %}" + _ROLE + _TURN + "{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>model\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
               "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"),
}


def with_template(tok, name):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = TEMPLATES[name]
    return t


# ---------------------------------------------------------------- wandb's offline run files


def wandb_history(run_file: Path, expect: int = 0, wait: float = 60) -> list[tuple[int, dict]]:
    """(step, {key: value}) per history record of an offline ``run-*.wandb`` file, once it holds
    ``expect`` of them: wandb's writer (a service process) may still be writing the file when
    ``finish`` returned (seen on a loaded machine), so this polls for up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while len(rows := _read_history(run_file)) < expect and time.monotonic() < deadline:
        time.sleep(0.2)
    return rows


def _read_history(run_file: Path) -> list[tuple[int, dict]]:
    """wandb has no public reader for the file: it is a leveldb log (32 KiB blocks of chunks with a
    7-byte header, after a 7-byte file header) of ``wandb_internal_pb2.Record`` protobufs; a
    record not yet written whole is left out."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    if len(data) < 7:  # not even the file header yet
        return []
    assert data[:4] == b":W&B", run_file
    pos, buf, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append((rec.history.step.num,
                             {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}))
    return rows
