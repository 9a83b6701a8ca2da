"""train-joint's one timeline (pipelines/support/timeline.py), the group statistics of a PPO batch and its
engine/trainer log-prob mismatch, the round's console line, and factories.wandb_history, the reader of wandb's
offline run files."""

import json
import math

import pytest
import torch

from conftest import FP32
from factories import wandb_history
from tosca_mlmt.config import load_config
from tosca_mlmt.lower.stats import group_reward_stats
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.timeline import Timeline, round_line, summary_rows


def test_group_reward_stats_on_hand_made_groups():
    # problem a: all right (zero spread), b: all wrong (zero spread), c: one of two right
    s = group_reward_stats([1, 1, 0, 0, 1, 0], ["a", "a", "b", "b", "c", "c"])
    assert s["reward_mean"] == pytest.approx(0.5)
    assert s["reward_std"] == pytest.approx((0 + 0 + 0.5) / 3)  # the mean within-group std
    assert s["frac_reward_zero_std"] == pytest.approx(2 / 3)  # a and b carry no GRPO gradient
    # a group of one has nothing to compare against: zero spread
    assert group_reward_stats([0.3, 2.0, 1.0], ["x", "y", "y"])["frac_reward_zero_std"] == pytest.approx(0.5)
    assert group_reward_stats([], []) == {}


def _cfg():
    return load_config(overrides={**FP32, "logging.wandb": False, "logging.progress": False})


def test_stage_records_reach_the_timeline_and_a_resumed_stage_replays_what_it_keeps(tmp_path):
    joint = RunDir(tmp_path / "joint", "train-joint")
    timeline = Timeline(joint.sink(_cfg()))
    inner = RunDir(tmp_path / "joint" / "lower", "train-lower")
    sink = inner.sink(_cfg(), tee=timeline.tee("lower"))
    for it in (1, 2):
        sink.log({"lower/acc_t1": it / 10}, step=it)
    kept = inner.metrics_bytes()
    sink.log({"lower/acc_t1": 0.3}, step=3)  # after the stage's checkpoint: killed here
    timeline.log({"joint/time/lower": 1.0})
    rows = [json.loads(x) for x in (tmp_path / "joint" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("lower/step")) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, None)]
    # resume: the joint file is cut back to the last finished step (here: nothing), the stage's to
    # its checkpoint; the stage logs iteration 3 again and its sink replays 1 and 2 first
    joint.rewind_metrics(0)
    inner.rewind_metrics(kept)
    timeline = Timeline(joint.sink(_cfg()), 0)
    sink = inner.sink(_cfg(), tee=timeline.tee("lower"))
    sink.log({"lower/acc_t1": 0.3}, step=3)
    again = [json.loads(x) for x in (tmp_path / "joint" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lower/step"], r["lower/acc_t1"]) for r in again] == [(1, 1, 0.1), (2, 2, 0.2), (3, 3, 0.3)]


def test_round_line_names_the_headline_numbers_and_leaves_out_what_was_not_measured():
    rec = {"collect_metrics": {"acc_t1": 0.21, "acc_final": 0.24},
           "lower_metrics": {"reward_mean": 0.18, "reward_std": 0.3, "frac_reward_zero_std": 0.62},
           "upper_metrics": {"q/verify": 0.5, "q/hint": 0.38, "td_loss": 9.0}}
    assert round_line(1, 4, rec, 186) == ("round 2/4: acc_t1 0.21 -> final 0.24 (collect), PPO reward 0.18 ±0.30, "
                                          "zero-std groups 62%, Q spread 0.12, 3.1 min")
    assert round_line(0, 1, {}, 60) == "round 1/1: 1.0 min"  # frozen writer and solver: only the time


def test_the_final_summary_is_one_row_per_round_with_the_round_lines_numbers():
    man = {"rounds": [
        {"round": 0, "snapshot": "snap-a", "collect_metrics": {"acc_t1": 0.21, "acc_final": 0.24},
         "lower_metrics": {"reward_mean": 0.18}, "eval_metrics": {"acc_final": 0.3}, "seconds": {"collect": 30, "lower": 90}},
        {"round": 1, "snapshot": None, "seconds": {"lower": 6}}]}  # a frozen writer: nothing collected
    assert summary_rows(man) == [
        {"round": 1, "snapshot": "snap-a", "acc_t1": 0.21, "acc_final": 0.24, "ppo_reward": 0.18,
         "eval_acc_final": 0.3, "minutes": 2.0},
        {"round": 2, "snapshot": None, "acc_t1": None, "acc_final": None, "ppo_reward": None,
         "eval_acc_final": None, "minutes": 0.1}]


def test_the_wandb_reader_reads_back_what_was_logged(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(overrides={**FP32, "logging.wandb": True, "logging.wandb_mode": "offline",
                                 "logging.progress": False})
    sink = RunDir(tmp_path, "train-joint").sink(cfg)
    for s in range(1, 300):  # long enough to cross wandb's 32 KiB blocks
        sink.log({f"lower/metric_{j}_with_a_long_name": s * j for j in range(12)}, step=s)
    sink.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 3 * 32768
    rows = wandb_history(run_file, expect=299)
    assert [s for s, _ in rows] == list(range(1, 300))
    assert rows[-1][1]["lower/metric_11_with_a_long_name"] == 299 * 11


def test_one_bar_counts_rounds_times_steps_and_shows_an_eta():
    from io import StringIO

    from rich.console import Console

    from tosca_mlmt.pipelines.support.timeline import RoundsBar

    over = {**FP32, "logging.progress": True, "joint.rounds": 2, "joint.upper_steps": 3, "joint.lower_iterations": 2}
    out = StringIO()
    bar = RoundsBar(load_config(overrides=over), Console(file=out, force_terminal=True, width=120), done_rounds=1)
    task = bar.progress.tasks[0]
    assert (task.total, task.completed) == (12, 6)  # a resumed run starts after its finished rounds
    with bar:
        bar.at(1, "upper", 2)  # collect (1) and two upper steps of round 2
        assert task.completed == 6 + 1 + 2
        bar.done(1, "lower")
        assert task.completed == 12
    assert "ETA" in out.getvalue() and "round 2/2" in out.getvalue()
    quiet = RoundsBar(load_config(overrides={**over, "logging.progress": False}), Console(file=StringIO()), 0)
    assert quiet.progress.disable


def test_engine_mismatch_against_a_token_by_token_computation():
    from tosca_mlmt.lower.stats import engine_mismatch

    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(3, 7, generator=g) * 3  # [B, T] the engine's log pi of the sampled tokens
    trainer = behaviour + torch.randn(3, 7, generator=g) * 0.05
    mask = (torch.rand(3, 7, generator=g) > 0.4).float()
    trainer[mask == 0] += 100.0  # prompts and padding: never read
    got = engine_mismatch(behaviour, trainer, mask)
    gaps, kls = [], []
    for b in range(3):
        for t in range(7):
            if mask[b, t]:
                lr = float(trainer[b, t]) - float(behaviour[b, t])  # log pi_trainer / pi_engine
                gaps.append(abs(lr))
                kls.append(math.exp(lr) - 1 - lr)
    assert got["engine_logprob_gap_mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-6)
    assert got["engine_logprob_gap_max"] == pytest.approx(max(gaps), rel=1e-6)
    assert got["engine_kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-6) and got["engine_kl"] > 0
    same = engine_mismatch(behaviour, behaviour.clone(), mask)
    assert same == {"engine_logprob_gap_mean": 0.0, "engine_logprob_gap_max": 0.0, "engine_kl": 0.0}
    assert engine_mismatch(behaviour, trainer, torch.zeros_like(mask)) == {}
