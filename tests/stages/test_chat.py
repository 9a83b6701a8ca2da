"""`mlmt chat` through the CLI on the random-weight debug base: the three turns, the strategy
table, verdicts, and a writer folder with a Q head (its Q-values shown and, when trusted, used)."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import FP32, TINY, run_mlmt
from tosca_mlmt.config import DEFAULT_STRATEGIES

pytestmark = pytest.mark.slow

DEBUG = ["--set", "model.solver=tiny-random", *TINY]
NAMES = [s["name"] for s in DEFAULT_STRATEGIES]


def chat(*args, **kw):
    return run_mlmt("chat", *DEBUG, *args, env={"PYTHONIOENCODING": "utf-8"}, timeout=300, **kw)


def strategy_rows(stdout: str) -> list[dict]:
    """The strategy table's rows: name, Q (None for '—'), pi, picked."""
    rows = []
    for line in stdout.splitlines():
        name = next((n for n in NAMES if f" {n} " in line), None)
        if name is None or "(feedback" in line:
            continue
        nums = re.findall(r"[+-]?\d+\.\d{3}", line)
        q = float(nums[0]) if len(nums) == 2 else None
        rows.append({"name": name, "q": q, "pi": float(nums[-1]), "picked": "→" in line})
    return rows


@pytest.fixture(scope="module")
def run_with_q_writer(tmp_path_factory):
    """A run folder whose writer/ has a Q head with non-zero weights (saved the way train-upper does)."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.models.q_head import QHead

    cfg = load_config(overrides={**FP32, "model.solver": "tiny-random"})
    pair = PolicyPair(cfg.model, seed=0)
    hidden = pair.model("writer").get_base_model().config.hidden_size
    pair.q_head = QHead(hidden, len(NAMES))
    with torch.no_grad():
        torch.manual_seed(0)
        pair.q_head.proj.weight.normal_(0.0, 1.0)
        pair.q_head.proj.bias.copy_(torch.linspace(-0.5, 0.5, len(NAMES)))
    pair.strategies = [dict(s) for s in DEFAULT_STRATEGIES]
    pair.q_decisions = 50  # fewer than episode.min_q_decisions (200): shown, not used
    run = tmp_path_factory.mktemp("run")
    pair.save_role("writer", run / "writer")
    return run


def test_stdin_problems_play_three_turns_with_the_strategy_table(tmp_path):
    p = chat(input="3 + 4 = ?\t7\n12 - 5 = ?\n\nnot read: after the empty line\n", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert out.count("z (solve)") == 2 and out.count("g (feedback, round 1") == 2
    assert out.count("ŷ (refine, round 1)") == 2 and out.count("strategies, round 1") == 2
    assert "not read" not in out
    rows = strategy_rows(out)
    assert [r["name"] for r in rows] == NAMES * 2
    assert all(r["q"] is None and r["pi"] == pytest.approx(1 / 6, abs=1e-3) for r in rows)
    assert sum(r["picked"] for r in rows) == 2
    assert "the writer has no Q head" in out
    # the gold answer (tab-separated) gives verdicts on the first problem only; the random base is never right
    assert len(re.findall(r"wrong \((no answer|read .*), gold 7\)", out)) == 2
    assert out.count("gold ") == 2


def test_a_run_writer_with_a_q_head_shows_q_and_greedy_selection_picks_the_max(run_with_q_writer, tmp_path):
    p = chat("--run", run_with_q_writer, "--problem", "2 + 2 = ?", "--answer", "4",
             "--set", "episode.min_q_decisions=0", "--set", "episode.strategy_selection=greedy", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = strategy_rows(p.stdout)
    assert [r["name"] for r in rows] == NAMES and all(r["q"] is not None for r in rows)
    assert len({r["q"] for r in rows}) > 1  # the head's weights, not zeros
    best = max(rows, key=lambda r: r["q"])
    assert best["picked"] and best["pi"] == 1.0
    assert "picked by greedy" in p.stdout


def test_q_values_of_an_untrusted_head_are_shown_but_selection_stays_uniform(run_with_q_writer, tmp_path):
    p = chat("--writer-adapter", run_with_q_writer / "writer", "--problem", "2 + 2 = ?", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = strategy_rows(p.stdout)
    assert all(r["q"] is not None and r["pi"] == pytest.approx(1 / 6, abs=1e-3) for r in rows)
    assert "Q fitted on 50 decisions < episode.min_q_decisions=200" in p.stdout


def test_strategy_option_pins_the_choice_and_an_unknown_one_is_one_error_line(tmp_path):
    p = chat("--strategy", "start_over", "--problem", "1 + 1 = ?", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["name"] for r in strategy_rows(p.stdout) if r["picked"]] == ["start_over"]
    assert "g (feedback, round 1, start_over)" in p.stdout and "picked by --strategy" in p.stdout
    p = chat("--strategy", "shout", "--problem", "1 + 1 = ?", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: --strategy 'shout' is not in")
    assert "start_over" in p.stderr
    assert "chat: loading" not in p.stdout + p.stderr  # refused before any weights load


def test_a_run_folder_without_trained_policies_is_a_user_error(tmp_path):
    p = chat("--run", tmp_path, "--problem", "1 + 1 = ?", cwd=tmp_path)
    assert p.returncode == 2 and "no trained solver/ or writer/" in p.stderr
