"""A writer on its own base model with its own tokenizer (``model.writer``), through the CLI.

The writer is a tiny random Llama on a byte-level BPE trained here (352 ids, none shared with the
solver's vocabulary by design), so every id that crosses between the roles has to go through text:
the attempt the writer reads, the feedback the solver reads (rollout/turns.py). One train-joint
round (collect, train-upper, train-lower) on the HF engine, then the episodes and saved folders are
checked against each role's own tokenizer.
"""

import json
from pathlib import Path

import pytest

from conftest import DEBUG_MODEL, FP32, run_mlmt, set_args
from factories import bpe_writer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def writer(tmp_path_factory) -> str:
    return bpe_writer(tmp_path_factory.mktemp("writer-base"))


def test_each_policy_keeps_its_own_base_in_peft(writer):
    """peft keeps the LoraConfig object it is given and writes the base's path into it (and reads it back
    to check the vocabulary on saving): one shared object named the writer's base for the solver too."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.loading import resolve_model
    from tosca_mlmt.models.policies import PolicyPair

    pair = PolicyPair(load_config(overrides={**DEBUG_MODEL, **FP32, "model.writer": writer}).model)
    assert not pair.shared_base
    assert pair.model("solver").peft_config["solver"].base_model_name_or_path == str(resolve_model("tiny-random"))
    assert pair.model("writer").peft_config["writer"].base_model_name_or_path == writer


def test_a_writer_with_its_own_base_and_tokenizer_trains_in_the_loop(tmp_path, writer):
    from transformers import AutoTokenizer

    from tosca_mlmt.models.artefacts import read_meta, resolve_base
    from tosca_mlmt.models.loading import resolve_model
    from tosca_mlmt.store import load_snapshot

    over = {**DEBUG_MODEL, **FP32, "model.writer": writer, "joint.rounds": 1, "joint.collect_problems": 2,
            "joint.lower_iterations": 1, "joint.upper_steps": 2, "upper.batch_size": 2, "upper.warmup_steps": 1,
            "lower.problems_per_iteration": 1, "lower.minibatch_size": 2, "solver_sampling.max_new_tokens": 10,
            "writer_sampling.max_new_tokens": 8, "episode.max_feedback_tokens": 8, "task.level": 1,
            "logging.wandb": False, "logging.progress": False}
    run = tmp_path / "run"
    run_mlmt("train-joint", "--out", run, *set_args(over), check=True)
    wtok, stok = AutoTokenizer.from_pretrained(writer), AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    assert len(wtok) < 400 < len(stok)
    man = json.loads((run / "manifest.json").read_text())
    episodes = load_snapshot(run / "snapshots", man["rounds"][0]["snapshot"]).episodes()
    assert episodes
    for ep in episodes:
        z, fb, ref = ep.turns
        assert max(fb.prompt_ids + fb.response_ids) < len(wtok)  # the writer's turn is in its own ids
        # the attempt reached the writer as text, re-encoded in its vocabulary
        assert wtok.decode(wtok.encode(z.text, add_special_tokens=False)) in wtok.decode(fb.prompt_ids)
        # and the feedback reached the solver the same way: the span the bonus removes is that text
        g = stok.decode(ref.prompt_ids[ref.feedback_span.start:ref.feedback_span.end])
        assert g == stok.decode(stok.encode(fb.text, add_special_tokens=False))
    # each role's folder, the round's and the run's final copy, names its own base and carries its own
    # tokenizer; a local base as a path relative to the folder, so the copy re-points it
    for role, base, size in (("solver", resolve_model("tiny-random"), len(stok)), ("writer", writer, len(wtok))):
        for folder in (run / role, run / man[role]):
            cfg = json.loads((folder / "adapter_config.json").read_text())
            assert resolve_base(folder).resolve() == Path(base).resolve(), cfg["base_model_name_or_path"]
            assert read_meta(folder)["base"] == cfg["base_model_name_or_path"]
            assert len(AutoTokenizer.from_pretrained(folder)) == size
