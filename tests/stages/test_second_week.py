"""Issue 67, a researcher's second week: ``--run`` brings the run's config (eval, chat, export), with a
drift warning naming what ``-c``/``--set`` change from what training used; and the rewards behind Acc
(partial credit) in every stage's summary and metrics. No model is loaded: the commands' pipelines are
replaced by stand-ins that keep the config they were given."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tosca_mlmt.metrics import summarize
from tosca_mlmt.records import Episode, Turn
from tosca_mlmt.tasks.base import Problem

SELECTOR = ["check_arithmetic", "reread_question", "verify_substitution", "start_over", "confirm", "simplify"]


# ---------------------------------------------------------------- point 5: rewards in the summaries

def _episode(pid: str, sample: int, rewards: list[float]) -> Episode:
    """Solve, then a feedback + refine per further reward; a turn is correct at reward >= 1."""
    ep = Episode(f"{pid}/s{sample}", Problem("arith", pid, "What is 7 + 8?", "15", "train", {}), sample)

    def solver(k, r):
        return Turn(2 * k, k, "solver", "solve" if k == 0 else "refine", [1], [2], [-0.1], "stop", "15",
                    reward=r, correct=r >= 1, extracted="15")

    ep.turns = [solver(0, rewards[0])]
    for k, r in enumerate(rewards[1:], start=1):
        ep.turns += [Turn(2 * k - 1, k, "writer", "feedback", [1], [2], [-0.1], "stop", "g", strategy=0,
                          strategy_name="a"), solver(k, r)]
    return ep


def test_summarize_reports_partial_credit_rewards_computed_by_hand():
    # p0: both samples 0.1 at t1 (no spread), 0.5 / 0.1 at the end; p1: 0.0 / 0.2 at t1, 1.0 / 1.0 at the end
    eps = [_episode("p0", 0, [0.1, 0.5]), _episode("p0", 1, [0.1, 0.1]),
           _episode("p1", 0, [0.0, 1.0]), _episode("p1", 1, [0.2, 1.0])]
    s = summarize(eps)
    assert s["acc_t1"] == 0.0  # what the summary showed before: nothing learned
    t1, final = [0.1, 0.1, 0.0, 0.2], [0.5, 0.1, 1.0, 1.0]
    mean_t1, mean_final = sum(t1) / 4, sum(final) / 4  # 0.1, 0.65
    std_t1 = math.sqrt(sum((x - mean_t1) ** 2 for x in t1) / 4)  # population std over episodes
    std_final = math.sqrt(sum((x - mean_final) ** 2 for x in final) / 4)
    assert s["reward_mean_t1"] == pytest.approx(0.1) == pytest.approx(mean_t1)
    assert s["reward_mean_final"] == pytest.approx(0.65) == pytest.approx(mean_final)
    assert s["reward_std_t1"] == pytest.approx(std_t1) == pytest.approx(math.sqrt(0.005))
    assert s["reward_std_final"] == pytest.approx(std_final)
    assert s["frac_reward_zero_std_t1"] == 0.5  # p0's t1 rewards are equal, p1's are not
    assert s["frac_reward_zero_std_final"] == 0.5  # p1's final rewards are equal, p0's are not
    # one sample per problem (eval): the means and spread, no group share (it would be 1 trivially)
    e = summarize([_episode("p0", 0, [0.25, 0.75]), _episode("p1", 0, [0.0, 0.25])])
    assert (e["reward_mean_t1"], e["reward_mean_final"]) == (pytest.approx(0.125), pytest.approx(0.5))
    assert e["reward_std_final"] == pytest.approx(0.25)
    assert not any(k.startswith("frac_reward_zero_std") for k in e)


def test_every_new_reward_key_is_in_the_glossary_under_every_summary_prefix():
    from tosca_mlmt.analysis.glossary import undocumented

    keys = [f"{p}{k}" for p in ("collect/", "eval/", "lower/", "joint/collect/")
            for k in ("reward_mean_t1", "reward_mean_final", "reward_std_t1", "reward_std_final",
                      "frac_reward_zero_std_t1", "frac_reward_zero_std_final")]
    assert undocumented(keys) == []


def test_train_lower_prints_the_group_reward_statistics():
    """The summary table after a train-lower run carries the reward statistics beside Acc."""
    from tosca_mlmt.cli.lower_cmd import SUMMARY_KEYS

    for key in ("lower/reward_mean", "lower/reward_std", "lower/frac_reward_zero_std", "lower/reward_mean_t1"):
        assert key in SUMMARY_KEYS


# ---------------------------------------------------------------- point 2: --run brings the run's config

def _run(tmp_path: Path, preset="mlmt-selector", overrides=None, roles=("solver", "writer"), name="run") -> Path:
    """A run folder as training leaves it: config.yaml (written as RunDir.claim writes it) and adapters."""
    from tosca_mlmt.config import load_config

    run = tmp_path / name
    for role in roles:
        (run / role).mkdir(parents=True)
        (run / role / "adapter_config.json").write_text("{}")
    cfg = load_config(preset, {"task.level": 2, "episode.n_samples": 4, **(overrides or {})})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run


def _drift(w) -> list[str]:
    return [str(x.message) for x in w if "differs from" in str(x.message)]


def test_run_config_is_the_run_s_saved_one_with_its_adapters_and_no_warning(tmp_path):
    from tosca_mlmt.cli.common import command_config

    run = _run(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # what eval and chat add: held-out split, an engine, logging switches: where/how to run, no drift
        cfg = command_config(None, {"task.split": "test", "task.limit": 3, "engine.name": "hf",
                                    "logging.wandb": False, "seed": 7}, run=run)
    assert _drift(w) == []
    assert cfg.episode.prefix_only == SELECTOR and cfg.task.level == 2 and cfg.episode.n_samples == 4
    assert cfg.model.solver_adapter == str(run / "solver") and cfg.model.writer_adapter == str(run / "writer")
    assert (cfg.task.split, cfg.task.limit, cfg.seed) == ("test", 3, 7)


def test_set_and_c_on_top_of_the_run_warn_naming_each_changed_field(tmp_path):
    from tosca_mlmt.cli.common import command_config

    run = _run(tmp_path, overrides={"writer_sampling.max_new_tokens": 40})
    with pytest.warns(UserWarning, match=r"episode\.prefix_only") as w:
        cfg = command_config(None, {"episode.prefix_only": [], "task.split": "test"}, run=run)
    assert cfg.episode.prefix_only == [] and cfg.task.level == 2  # --set applies last; the rest is the run's
    (msg,) = _drift(w)
    assert "episode.prefix_only" in msg and "task.split" not in msg and str(run / "config.yaml") in msg
    # -c goes on top of the run's config: the mlmt preset writes text, the run was a selector
    from tosca_mlmt.config import load_config

    with pytest.warns(UserWarning, match=r"episode\.prefix_only") as w:
        cfg = command_config("mlmt", {}, run=run)
    assert cfg.episode.prefix_only == load_config("mlmt").episode.prefix_only != SELECTOR
    assert cfg.task.level == 1 and cfg.writer_sampling.max_new_tokens == 40  # the run's where the preset is silent
    (msg,) = _drift(w)
    assert "task.level (2 -> 1)" in msg and "writer_sampling" not in msg


def test_eval_chat_export_run_use_the_run_s_config(tmp_path, monkeypatch):
    import tosca_mlmt.pipelines.chat as chat_pipeline
    import tosca_mlmt.pipelines.evaluate as evaluate_pipeline
    import tosca_mlmt.pipelines.export as export_pipeline
    from tosca_mlmt.cli.chat_cmd import chat
    from tosca_mlmt.cli.common import user_errors
    from tosca_mlmt.cli.eval_cmd import eval_cmd
    from tosca_mlmt.cli.export_cmd import export

    seen: dict = {}

    def fake_evaluate(cfg, out, **kw):
        seen["eval"] = cfg
        return evaluate_pipeline.EvalResult(Path(out) / "eval.json", {
            "task": cfg.task.name, "split": cfg.task.split, "snapshot_id": "s", "acc_t1": 0.0, "acc_final": 0.0,
            "delta": 0.0})

    class FakeSession:
        def __init__(self, cfg, **kw):
            seen["chat"] = cfg

        def close(self):
            pass

    def fake_merged(adapter, out, role=None, base=None, dtype="auto", card=None):
        seen["export"] = (Path(adapter), role, base)
        return {"role": role, "base": "smollm2-135m", "dtype": "float32", "merged_sha": "x"}

    monkeypatch.setattr(evaluate_pipeline, "evaluate", fake_evaluate)
    monkeypatch.setattr(chat_pipeline, "ChatSession", FakeSession)
    monkeypatch.setattr(export_pipeline, "export_merged", fake_merged)
    app = typer.Typer()
    for name, fn in (("eval", eval_cmd), ("chat", chat), ("export", export)):
        app.command(name)(user_errors(fn))
    run = _run(tmp_path)
    invoke = lambda *argv: CliRunner().invoke(app, [str(a) for a in argv], input="")  # noqa: E731

    res = invoke("eval", "--run", run, "--out", tmp_path / "ev", "--no-wandb")
    assert res.exit_code == 0, res.output
    assert seen["eval"].episode.prefix_only == SELECTOR and seen["eval"].task.split == "test"
    assert seen["eval"].model.writer_adapter == str(run / "writer")
    res = invoke("chat", "--run", run)
    assert res.exit_code == 0, res.output
    assert seen["chat"].episode.prefix_only == SELECTOR and seen["chat"].task.level == 2
    res = invoke("export", "--run", run, "--role", "writer", "--out", tmp_path / "merged")
    assert res.exit_code == 0, res.output
    assert seen["export"] == (run, "writer", None)  # the base the adapter records: the one training used

    with pytest.warns(UserWarning, match=r"episode\.strategy_selection"):
        res = invoke("eval", "--run", run, "--out", tmp_path / "ev2", "--set", "episode.strategy_selection=greedy")
    assert res.exit_code == 0, res.output
    assert seen["eval"].episode.strategy_selection == "greedy" and seen["eval"].episode.prefix_only == SELECTOR
    with pytest.warns(UserWarning, match=r"writer_sampling\.max_new_tokens"):
        res = invoke("chat", "--run", run, "--set", "writer_sampling.max_new_tokens=7")
    assert res.exit_code == 0, res.output
    # export: a changed base is named in the warning and is the base the adapter is merged into
    with pytest.warns(UserWarning, match=r"model\.solver"):
        res = invoke("export", "--run", run, "--out", tmp_path / "m2", "--set", "model.solver=smollm2-360m")
    assert res.exit_code == 0, res.output
    assert seen["export"] == (run, "solver", "smollm2-360m")
    assert invoke("export", "--out", tmp_path / "m3").exit_code == 2  # neither --adapter nor --run


def test_a_train_joint_run_uses_its_top_level_config_not_a_round_s(tmp_path):
    from tosca_mlmt.cli.common import command_config

    run = _run(tmp_path, name="joint")
    # a round's stage run: the same config with its own seed and length (train_joint._lower)
    lower = run / "rounds" / "000" / "lower"
    lower.mkdir(parents=True)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["seed"], saved["lower"]["iterations"] = 1001, 2
    (lower / "config.yaml").write_text(yaml.safe_dump(saved))
    (run / "manifest.json").write_text(json.dumps({"rounds": [], "solver": "solver", "writer": "writer"}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = command_config(None, {"task.split": "test"}, run=run)
    assert _drift(w) == [] and cfg.seed == 0 and cfg.lower.iterations == 4
    assert cfg.episode.prefix_only == SELECTOR
