"""train-upper on a real snapshot from ``collect`` (slow: collects, trains the writer).

On the random-weight debug base (conftest.DEBUG_MODEL): what is checked is the learner's
mechanics (which weights move, checkpoints, resume, the exported head, provenance, the report),
not what the model knows, and its rewards are 0 either way at these lengths. The tests that need
rewarded decisions (the text loss) set the rewards themselves."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DEBUG_MODEL, FP32, run_mlmt, set_args
from tosca_mlmt.config import load_config
from tosca_mlmt.models.loading import weights_fingerprint
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.train_upper import train_upper
from tosca_mlmt.store import load_snapshot
from tosca_mlmt.upper.dataset import build_transitions
from tosca_mlmt.upper.trunk import WriterTrunk

pytestmark = pytest.mark.slow

TINY = {**FP32, **DEBUG_MODEL, "solver_sampling.max_new_tokens": 8, "writer_sampling.max_new_tokens": 8,
        "episode.max_feedback_tokens": 8, "logging.wandb": False, "logging.progress": False}


@pytest.fixture(scope="module")
def pair():
    p = PolicyPair(load_config(overrides=TINY).model, seed=0)
    yield p
    torch.use_deterministic_algorithms(False)  # determinism mode is process-wide; do not leak it


@pytest.fixture(scope="module")
def snapshot(pair, tmp_path_factory):
    """arith, 2 problems x 2 samples, K = 2 rounds (so s' and the gamma backup are exercised)."""
    root = tmp_path_factory.mktemp("upper-snaps")
    cfg = load_config(overrides={**TINY, "task.limit": 2, "episode.n_samples": 2, "episode.rounds": 2,
                                 "collect.out": str(root)})
    res = collect(cfg, policies=pair)
    return root, res.snapshot_id


def _cfg(snapshot, **over):
    root, sid = snapshot
    return load_config(overrides={**TINY, "upper.snapshots": [sid], "upper.snapshot_root": str(root),
                                  "upper.steps": 3, "upper.batch_size": 2, "upper.warmup_steps": 1,
                                  "upper.save_every": 2, "upper.log_every": 1, "upper.eval_every": 3,
                                  # a zero-initialised Q head over the debug base's 128 features: at the
                                  # default 1e-4, 3 steps leave Q within 0.02 of 0 and its mean over the
                                  # logged states inside the 1e-3 Q readings are compared at; at 1e-2 Q is O(1)
                                  "upper.head_lr": 1e-2, "deterministic": True, **over})


def _others_fingerprint(pair) -> str:
    """Every tensor of the model except the writer adapter: solver adapter, base, buffers."""
    m = pair.model("writer")
    sd = {n: t for n, t in list(m.named_parameters()) + list(m.named_buffers()) if ".writer." not in n}
    return weights_fingerprint(sd)


def _reset_writer(pair, init):
    WriterTrunk(pair).load_state_dict(init)
    pair.q_head, pair.strategies = None, None


@pytest.fixture(scope="module")
def trained(pair, snapshot, tmp_path_factory):
    init = WriterTrunk(pair).state_dict()
    others = _others_fingerprint(pair)
    run = tmp_path_factory.mktemp("upper-run") / "a"
    res = train_upper(_cfg(snapshot), run, policies=pair)
    root, sid = snapshot
    states = [t.state_ids for t in build_transitions([(sid, load_snapshot(root, sid).episodes())])]
    return {"init": init, "others_before": others, "others_after": _others_fingerprint(pair), "run": run,
            "res": res, "after": WriterTrunk(pair).state_dict(), "q_states": pair.q_values(states), "states": states}


def test_training_changes_the_writer_adapter_and_q_head_and_nothing_else(trained):
    init, after = trained["init"], trained["after"]
    changed = [n for n in init if not torch.equal(init[n], after[n])]
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    assert trained["others_after"] == trained["others_before"]  # solver adapter and base bit-identical
    head = load_file(trained["run"] / "writer" / "q_head.safetensors")
    assert head["proj.weight"].abs().sum() > 0 and head["proj.weight"].shape[0] == 6


def test_run_folder_provenance_metrics_report(trained, snapshot):
    run, (_, sid) = trained["run"], snapshot
    assert trained["res"].step == 3 and trained["res"].writer_dir == run / "writer"
    cfg = run / "config.yaml"
    assert cfg.exists() and sid in cfg.read_text()
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["parents"] == [sid] and prov["snapshots"][0]["id"] == sid and prov["final_step"] == 3
    assert prov["decisions"] == 8  # 4 episodes x 2 rounds
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*recs)
    for k in ("upper/td_loss", "upper/cql_term", "upper/q_data", "upper/v", "upper/adv_mean", "upper/adv_std",
              "upper/w_ess_frac", "upper/text_loss", "upper/q/check_arithmetic", "upper/ope/value",
              "upper/ope/behaviour_value", "upper/ope/ess", "upper/time/update"):
        assert k in keys, k
    assert [r["upper/text_on"] for r in recs if "upper/text_on" in r] == [0.0, 1.0, 1.0]  # warm-up of 1 step
    report = (run / "report.md").read_text()
    assert "## arith/L" in report and ": prefers `" in report and "check_arithmetic" in report
    # 8 decisions are below episode.min_q_decisions: the next collect picks uniformly, and the report says so
    assert "strategy selection at collect: uniform (Q fitted on 8 decisions < episode.min_q_decisions=200" in report
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert json.loads((run / "writer" / "strategies.json").read_text())[0]["name"] == "check_arithmetic"


def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_weights(pair, snapshot, trained, tmp_path):
    _reset_writer(pair, trained["init"])
    run = tmp_path / "b"
    part = train_upper(_cfg(snapshot), run, policies=pair, stop_at=2)  # "crash" right after step 2's checkpoint
    assert part.writer_dir is None and (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    # scramble the live weights: the resumed run must take everything from the checkpoint
    with torch.no_grad():
        for p in WriterTrunk(pair).params.values():
            p.add_(0.01)
    res = train_upper(_cfg(snapshot), run, policies=pair, resume=True)
    assert res.step == 3
    a, b = trained["run"], run
    for f in ("writer/adapter_model.safetensors", "writer/q_head.safetensors",
              "checkpoints/step-000003/heads.safetensors", "checkpoints/step-000003/writer_adapter.safetensors"):
        ta, tb = load_file(a / f), load_file(b / f)
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), f
    assert json.loads((b / "provenance.json").read_text())["resumed_from"] == ["step-000002"]


def test_saved_writer_is_what_collect_loads(trained, snapshot, tmp_path):
    """collect --set model.writer_adapter=<run>/writer: the Q head is read, strategies are drawn
    by softmax over it, and the behaviour probabilities are logged."""
    writer = str(trained["run"] / "writer")
    loaded = PolicyPair(load_config(overrides={**TINY, "model.writer_adapter": writer}).model, seed=0)
    assert loaded.q_head is not None and [s["name"] for s in loaded.strategies][0] == "check_arithmetic"
    q = loaded.q_values(trained["states"])
    assert torch.allclose(q, trained["q_states"], atol=1e-4)
    # the learner's own reading of Q (right-padded, inside the full sequence) agrees with collect's
    report = json.loads((trained["run"] / "report.json").read_text())
    (rows,) = report["table"].values()  # one task type: arith at the configured level
    learner_q = torch.tensor([r["q"] for r in rows])
    assert torch.allclose(learner_q, q.mean(0), atol=1e-3)
    # the head carries the number of decisions it was fitted on
    decisions = json.loads((trained["run"] / "provenance.json").read_text())["decisions"]
    assert loaded.q_decisions == decisions and 0 < decisions < 200
    base = {**TINY, "model.writer_adapter": writer, "task.limit": 1, "episode.n_samples": 1}
    # below episode.min_q_decisions (default 200) the under-fitted Q is not consulted: uniform
    cfg = load_config(overrides={**base, "collect.out": str(tmp_path / "gated")})
    res = collect(cfg, policies=loaded)
    fb = [t for ep in load_snapshot(tmp_path / "gated", res.snapshot_id).episodes() for t in ep.turns
          if t.kind == "feedback"][0]
    assert fb.q_values is None and fb.behaviour_probs == pytest.approx([1 / len(fb.behaviour_probs)] * len(fb.behaviour_probs))
    cfg = load_config(overrides={**base, "episode.min_q_decisions": 0, "collect.out": str(tmp_path)})
    res = collect(cfg, policies=loaded)
    fb = [t for ep in load_snapshot(tmp_path, res.snapshot_id).episodes() for t in ep.turns if t.kind == "feedback"][0]
    assert fb.q_values is not None
    soft = torch.softmax(torch.tensor(fb.q_values, dtype=torch.float64) / cfg.episode.strategy_temperature, 0)
    expect = cfg.episode.epsilon / len(soft) + (1 - cfg.episode.epsilon) * soft  # auto: epsilon-softmax
    assert torch.allclose(torch.tensor(fb.behaviour_probs, dtype=torch.float64), expect, atol=1e-6)
    assert fb.behaviour_prob == pytest.approx(fb.behaviour_probs[fb.strategy])


def test_logits_q_source_trains_the_adapter_and_exports_an_equivalent_head(pair, snapshot, trained, tmp_path):
    _reset_writer(pair, trained["init"])
    res = train_upper(_cfg(snapshot, **{"upper.q_source": "logits", "upper.conservatism": "iql",
                                        "upper.text_loss": "none", "upper.steps": 1}), tmp_path / "l", policies=pair)
    after = WriterTrunk(pair).state_dict()
    assert any(not torch.equal(trained["init"][n], after[n]) for n in after)  # TD moved the adapter
    states = trained["states"][:2]
    with torch.no_grad(), pair.use("writer"):
        h = WriterTrunk(pair).states(states)
        logits = pair.model("writer").get_base_model().get_output_embeddings()(h)
    tok = pair.tokenizer("writer")
    ids = [tok.encode(str(k), add_special_tokens=False)[0] for k in range(1, 7)]
    assert torch.allclose(pair.q_values(states), logits[:, ids].float(), atol=1e-3)
    assert res.metrics["ope/ess"] > 0


def test_cli_train_upper(snapshot, tmp_path):
    root, sid = snapshot
    out = tmp_path / "cli-run"
    sets = set_args({**TINY, "upper.steps": 1, "upper.batch_size": 2})
    p = run_mlmt("train-upper", "--snapshot", sid, "--root", root, "--out", out, "--no-wandb", *sets, check=True)
    assert p.stdout.strip().splitlines()[-1] == str(out / "writer")
    assert (out / "writer" / "q_head.safetensors").exists() and (out / "report.md").exists()
    # user errors exit 2 with one line, before any model is loaded (in-process: no start-up cost)
    from typer.testing import CliRunner

    from tosca_mlmt.cli.main import app

    again = CliRunner().invoke(app, ["train-upper", "--snapshot", sid, "--root", str(root), "--out", str(out), *sets])
    assert again.exit_code == 2 and "already holds a train-upper run" in again.stderr
    missing = CliRunner().invoke(app, ["train-upper", "--snapshot", "snap-nope", "--root", str(root),
                                       "--out", str(tmp_path / "x"), *sets])
    assert missing.exit_code == 2 and "no snapshot 'snap-nope'" in missing.stderr


def test_train_upper_learns_from_a_train_lower_batch_snapshot(pair, snapshot, trained, tmp_path):
    """train-lower's per-iteration snapshots carry the manifest collect writes (strategies,
    sampling, both fingerprints, code), so train-upper can learn from them."""
    from tosca_mlmt.pipelines.train_lower import train_lower
    from tosca_mlmt.store import verify_snapshot
    from tosca_mlmt.store.manifest import INFORMATIONAL

    model = pair.model("solver")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _reset_writer(pair, trained["init"])
    cfg = load_config(overrides={**TINY, "episode.n_samples": 2, "episode.rounds": 1, "lower.iterations": 1,
                                 "lower.problems_per_iteration": 1, "lower.minibatch_size": 2})
    train_lower(cfg, tmp_path / "lower", policies=pair)
    for n, p in model.named_parameters():
        p.data.copy_(before[n])
    root = tmp_path / "lower" / "snapshots"
    (sid,) = [p.name for p in root.iterdir()]
    batch = load_snapshot(root, sid).manifest
    collected = load_snapshot(*snapshot).manifest
    assert verify_snapshot(root / sid) == []  # still content-addressed
    assert set(batch) == set(collected) | {"iteration"} and batch["kind"] == "train-lower-batch"
    assert batch["iteration"] == 0 and batch["parents"] == [] and batch["seeds"] == {"seed": cfg.seed}
    assert [s["name"] for s in batch["strategies"]] == [s["name"] for s in collected["strategies"]]
    assert set(batch["models"]) == set(batch["sampling"]) == {"solver", "writer"}
    assert batch["packages"]["tosca-mlmt"] and "git_sha" in batch and batch["task"]["n_problems"] == 1
    assert {"packages", "git_sha", "summary", "timings"} <= set(INFORMATIONAL)

    res = train_upper(_cfg((root, sid), **{"upper.steps": 1, "upper.save_every": 1, "upper.eval_every": 1}),
                      tmp_path / "upper", policies=pair)
    assert res.step == 1 and (res.writer_dir / "q_head.safetensors").exists()
    assert json.loads((tmp_path / "upper" / "provenance.json").read_text())["parents"] == [sid]


def test_a_fresh_q_head_standardises_h_with_the_logged_states_stats(pair, snapshot, trained):
    """upper.q_standardize: a fresh head's mean/scale are h(s)'s per-feature mean and (floored)
    std over the logged states; off leaves the identity; a continued head keeps its own stats."""
    import numpy as np

    from tosca_mlmt.upper.learner import UpperLearner

    root, sid = snapshot
    trs = build_transitions([(sid, load_snapshot(root, sid).episodes())])
    cfg = _cfg(snapshot)
    saved = pair.q_head
    pair.q_head = None
    try:
        fresh = UpperLearner(cfg, pair, trs, cfg.episode.strategies)
        f = fresh.features_all().double().numpy()
        fresh.close()
        q = fresh.critic.q
        std = f.std(0)
        np.testing.assert_allclose(q.mean.numpy(), f.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(q.scale.numpy(), np.maximum(std, 0.1 * np.median(std)), rtol=1e-4)
        assert torch.equal(fresh.critic.q_target.mean, q.mean) and torch.equal(fresh.critic.q_target.scale, q.scale)
        # Q reads the standardised features: a weight on feature 0 alone gives (h0 - mean0) / scale0
        with torch.no_grad():
            q.proj.weight.zero_()
            q.proj.weight[:, 0] = 1.0
        h = fresh.features_all()
        np.testing.assert_allclose(q(h)[:, 2].detach().numpy(), (f[:, 0] - f[:, 0].mean()) / q.scale[0].item(), rtol=1e-4,
                                   atol=1e-4)

        off = UpperLearner(_cfg(snapshot, **{"upper.q_standardize": False}), pair, trs, cfg.episode.strategies)
        off.close()
        assert not off.critic.q.has_feature_stats()

        head = fresh.critic.exported_head()
        head.set_feature_stats(q.mean + 1.0, q.scale * 2.0)
        pair.q_head = head
        cont = UpperLearner(cfg, pair, trs, cfg.episode.strategies)
        cont.close()
        assert torch.equal(cont.critic.q.mean, q.mean + 1.0) and torch.equal(cont.critic.q.scale, q.scale * 2.0)
    finally:
        pair.q_head = saved


def test_a_q_head_saved_before_standardisation_loads_as_the_identity():
    from tosca_mlmt.models.q_head import QHead

    old = {"proj.weight": torch.randn(3, 5), "proj.bias": torch.randn(3)}  # what older writers saved
    head = QHead(5, 3)
    head.load_state_dict(dict(old))
    h = torch.randn(4, 5)
    assert not head.has_feature_stats()
    assert torch.allclose(head(h), h @ old["proj.weight"].T + old["proj.bias"])


def test_bc_text_loss_reads_only_cloned_feedback_and_updates_as_if_it_read_every_decision(pair, snapshot, trained):
    """improved_bc weighs a decision 1 only when its round reward is positive: the learner runs the
    [prompt + feedback] forward on those alone and a state-only forward on the rest. The update
    (losses, adapter, Q head) equals reading every decision, to float tolerance (other batch shapes)."""
    import dataclasses

    from tosca_mlmt.upper.learner import UpperLearner

    root, sid = snapshot
    trs = build_transitions([(sid, load_snapshot(root, sid).episodes())], reward_mode="improvement")
    trs = [dataclasses.replace(t, reward=1.0 if i % 3 == 0 else -0.5) for i, t in enumerate(trs)]  # some cloned
    cfg = _cfg(snapshot, **{"upper.text_loss": "improved_bc", "upper.q_trunk_grad": True, "upper.warmup_steps": 0,
                            "upper.batch_size": 4})
    saved = pair.q_head
    runs = []
    try:
        for skip in (True, False):
            _reset_writer(pair, trained["init"])
            learner = UpperLearner(cfg, pair, trs, cfg.episode.strategies)
            learner.skip_unweighted_text = skip
            rows = []
            full = learner.trunk.full
            learner.trunk.full = lambda p, r, s: rows.append(len(p)) or full(p, r, s)
            ms = [learner.update() for _ in range(3)]
            learner.close()
            runs.append((ms, rows, WriterTrunk(pair).state_dict(),
                         {k: v.clone() for k, v in learner.critic.q.state_dict().items()}))
    finally:
        pair.q_head = saved
        _reset_writer(pair, trained["init"])
    (m_skip, rows_skip, w_skip, q_skip), (m_all, rows_all, w_all, q_all) = runs
    assert rows_all == [4, 4, 4] and sum(rows_skip) < sum(rows_all)  # fewer feedback forwards...
    assert sum(m["w_mean"] for m in m_all) > 0  # ...while some decisions were cloned
    for a, b in zip(m_skip, m_all):
        for k in ("loss", "td_loss", "cql_term", "text_loss", "q_data"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert any(not torch.equal(trained["init"][n], w_all[n]) for n in w_all)  # the adapter moved
    for n in w_all:
        torch.testing.assert_close(w_skip[n], w_all[n], rtol=1e-4, atol=1e-6)
    for k in q_all:
        torch.testing.assert_close(q_skip[k], q_all[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("skip", [True, False])
def test_fixed_feedback_is_never_cloned(pair, snapshot, trained, skip):
    """A decision whose feedback was a fixed sentence (episode.prefix_only, finish 'fixed') weighs 0 in
    the text loss although its reward would clone it; only the written ones get the feedback forward
    (skip) and the text loss is theirs alone."""
    import dataclasses

    from tosca_mlmt.upper.dataset import batch_indices
    from tosca_mlmt.upper.learner import UpperLearner

    root, sid = snapshot
    trs = build_transitions([(sid, load_snapshot(root, sid).episodes())], reward_mode="improvement")
    cfg = _cfg(snapshot, **{"upper.text_loss": "improved_bc", "upper.warmup_steps": 0, "upper.batch_size": 4})
    first = batch_indices(len(trs), 4, cfg.seed, 1)  # the decisions of the first update: two of them written
    trs = [dataclasses.replace(t, reward=1.0, written=i in first[:2]) for i, t in enumerate(trs)]  # all would clone
    saved = pair.q_head
    try:
        _reset_writer(pair, trained["init"])
        learner = UpperLearner(cfg, pair, trs, cfg.episode.strategies)
        learner.skip_unweighted_text = skip
        rows, full = [], learner.trunk.full
        learner.trunk.full = lambda p, r, s: rows.append([len(x) for x in r]) or full(p, r, s)
        m = learner.update()
        learner.close()
    finally:
        pair.q_head = saved
        _reset_writer(pair, trained["init"])
    assert m["w_mean"] == pytest.approx(0.5) and m["text_loss"] > 0  # the two written of four
    assert rows == ([[len(trs[i].response_ids) for i in first[:2]]] if skip else [[len(trs[i].response_ids)
                                                                                    for i in first]])
