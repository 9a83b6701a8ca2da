"""The solver's context bonus stored with train-lower's batch snapshots: each refine turn carries
the value its PPO update used and the raw term, the readers (samples table, snapshots show, the
report's episodes) show them, and "n/a" where no update saw the episode."""

import json
import math
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from factories import OUTCOME_CASES, make_episodes
from tosca_mlmt.analysis.html import _episodes
from tosca_mlmt.cli.main import app
from tosca_mlmt.lower.stats import refine_bonus_rows, with_refine_bonus
from tosca_mlmt.samples import episode_record, sample_rows


def test_bonus_lands_on_the_refine_of_its_row_and_nothing_is_mutated():
    eps = make_episodes(cases=OUTCOME_CASES)[:3]
    before = [json.dumps(t.info, sort_keys=True) for e in eps for t in e.turns]
    # trajectory rows 0, 1 are episodes 0 and 2 (episode 1 had a truncated prompt); solver turn 1 = the refine
    out = with_refine_bonus(eps, [0, 2], [(0, 1, 0.5, 0.05), (1, 1, -2.0, -0.1)])
    assert [json.dumps(t.info, sort_keys=True) for e in eps for t in e.turns] == before
    assert out[1] is eps[1]
    for ep, (raw, value) in ((out[0], (0.5, 0.05)), (out[2], (-2.0, -0.1))):
        solve, fb, refine = ep.turns
        assert refine.info == {"counterfactual_reward": 0.0, "bonus": value, "bonus_raw": raw}
        assert "bonus" not in solve.info and "bonus" not in fb.info
    assert refine_bonus_rows(None) == []


def test_readers_show_the_bonus_or_n_a():
    plain, = make_episodes(cases=OUTCOME_CASES)[:1]
    (with_bonus,) = with_refine_bonus([plain], [0], [(0, 1, 0.456, 0.0123)])
    assert episode_record(plain)["rounds"][0]["bonus"] is None
    rd = episode_record(with_bonus)["rounds"][0]
    assert (rd["bonus"], rd["bonus_raw"]) == (0.0123, 0.456)
    assert sample_rows([plain])[0]["bonus"] == "n/a"
    assert sample_rows([with_bonus])[0]["bonus"] == "0.0123 (raw 0.456)"


def test_the_report_episode_shows_a_refines_bonus():
    import pandas as pd

    from tosca_mlmt.analysis.tables import Tables

    turns = [{"role": "solver", "kind": "solve", "round": 0, "strategy_name": None, "correct": False, "text": "z",
              "bonus": None, "bonus_raw": None},
             {"role": "solver", "kind": "refine", "round": 1, "strategy_name": None, "correct": True, "text": "y",
              "bonus": 0.0123, "bonus_raw": 0.456},
             {"role": "solver", "kind": "refine", "round": 2, "strategy_name": None, "correct": True, "text": "y2",
              "bonus": None, "bonus_raw": None}]
    texts = [{"snapshot": "snap-a", "episode_id": "e", "question": "q", "answer": "1", "turns": turns}]
    t = Tables.__new__(Tables)
    t.snapshots = pd.DataFrame({"snapshot": ["snap-a"], "source": ["run"]})
    page = _episodes(t, pd.DataFrame({"episode_id": ["e"], "cell": ["wrong → right"]}), texts)
    assert page.count("bonus 0.0123 (raw 0.456)") == 1 and page.count("bonus n/a") == 1


@pytest.mark.slow
def test_a_train_lower_batch_snapshot_carries_the_bonus_its_update_logged(debug_cfg, debug_policies, tmp_path):
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = replace(debug_cfg, solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=8),
                  task=replace(debug_cfg.task, level=1), episode=replace(debug_cfg.episode, n_samples=2),
                  lower=replace(debug_cfg.lower, iterations=1, problems_per_iteration=2, minibatch_size=4,
                                advantage="gae", keep_snapshots=True,
                                # ungated: the debug solver is never right, so the improvement gate is 0
                                bonus=replace(debug_cfg.lower.bonus, gate="none")))
    model = debug_policies.model("solver")
    init = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    sampled_by = debug_policies.fingerprint("solver")["adapter_sha"]
    try:
        res = train_lower(cfg, tmp_path / "run", policies=debug_policies)
        trained = debug_policies.fingerprint("solver")["adapter_sha"]
    finally:
        for n, p in model.named_parameters():
            if n in init:
                p.data.copy_(init[n])
    (logged,) = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    sid = logged["lower/snapshot"]
    from tosca_mlmt.store import load_snapshot

    eps = load_snapshot(res.run_dir / "snapshots", sid).episodes()
    refines = [t for e in eps for t in e.turns if t.kind == "refine"]
    assert len(refines) == 4 and all(math.isfinite(t.info["bonus"]) and math.isfinite(t.info["bonus_raw"])
                                     for t in refines)
    values = torch.tensor([t.info["bonus"] for t in refines])
    raws = torch.tensor([t.info["bonus_raw"] for t in refines])
    assert values.mean().item() == pytest.approx(logged["lower/bonus/mean"], rel=1e-5, abs=1e-9)
    assert raws.mean().item() == pytest.approx(logged["lower/bonus/raw_logratio_mean"], rel=1e-5, abs=1e-9)
    assert values.abs().sum() > 0  # a random solver's log-probs move with its context
    # written after the update, the manifest still fingerprints the solver that sampled the batch
    m = load_snapshot(res.run_dir / "snapshots", sid).manifest
    assert m["models"]["solver"]["adapter_sha"] == sampled_by != trained
    shown = CliRunner().invoke(app, ["snapshots", "show", sid[:12], "--root", str(res.run_dir), "--episodes", "4"],
                               env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    first = next(t for t in eps[0].turns if t.kind == "refine").info
    assert f"bonus {first['bonus']:.4g} (raw {first['bonus_raw']:.4g})" in shown.stdout
    assert shown.stdout.count("bonus ") == 4 and "bonus n/a" not in shown.stdout
