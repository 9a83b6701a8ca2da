"""train-joint end to end: artifacts through the CLI (kill -9 and resume: tests/properties/test_faults.py)."""

import json

import pytest

from conftest import DEBUG_MODEL, FP32, run_mlmt, set_args
from factories import wandb_history

pytestmark = pytest.mark.slow

# artefacts and their links, not learning: the random-weight debug base runs it ~4x faster
TINY_JOINT = {
    **DEBUG_MODEL, "joint.rounds": 2, "joint.collect_problems": 1, "joint.lower_iterations": 1, "joint.upper_steps": 2,
    "upper.batch_size": 2, "upper.warmup_steps": 1, "upper.eval_every": 2, "upper.log_every": 1,
    "upper.save_every": 1, "lower.problems_per_iteration": 1, "lower.minibatch_size": 2, "lower.save_every": 1,
    "solver_sampling.max_new_tokens": 10, "episode.max_feedback_tokens": 8, **FP32,
    "task.level": 1, "logging.wandb": False, "logging.progress": False,
}


def test_tiny_train_joint_through_the_cli_then_eval_and_analyze(tmp_path):
    over = {**TINY_JOINT, "logging.wandb": True, "joint.eval_problems": 2}
    sets = set_args(over)
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")}
    run = tmp_path / "run"
    p = run_mlmt("train-joint", "--out", run, *sets, check=True, env=env)
    assert p.stdout.strip().splitlines()[-1] == str(run)
    assert_one_timeline(run, p.stderr)
    # the PPO batch's episodes as a table per round, each refine with the bonus it was trained with
    tables = sorted(run.glob("wandb/offline-run-*/files/media/table/lower/samples_*.table.json"))
    assert len(tables) == 2
    t = json.loads(tables[-1].read_text())
    bonus = [row[t["columns"].index("bonus")] for row in t["data"]]
    assert bonus and all("raw" in b for b in bonus), bonus
    man = json.loads((run / "manifest.json").read_text())
    assert [r["done"] for r in man["rounds"]] == [["collect", "upper", "lower", "eval"]] * 2
    # the per-round held-out eval: test-split snapshots under evals/, its numbers on the timeline
    for r in man["rounds"]:
        ev_man = json.loads((run / "evals" / r["eval_snapshot"] / "manifest.json").read_text())
        assert ev_man["task"]["split"] == "test" and len(ev_man["task"]["problem_ids"]) == 2
    ev_lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval/acc_t1"' in x]
    assert [x["eval/acc_t1"] for x in ev_lines] == [r["eval_metrics"]["acc_t1"] for r in man["rounds"]]
    for r in man["rounds"]:
        assert (run / "snapshots" / r["snapshot"] / "manifest.json").exists()
        assert (run / r["upper"] / "checkpoints" / "latest").exists()
        assert (run / r["lower"] / "checkpoints" / "latest").exists()
        assert r["lower_snapshots"] and all((run / r["lower"] / "snapshots" / s).exists() for s in r["lower_snapshots"])
    assert man["rounds"][1]["upper_snapshots"] == [man["rounds"][0]["snapshot"], man["rounds"][1]["snapshot"]]
    snap1 = json.loads((run / "snapshots" / man["rounds"][1]["snapshot"] / "manifest.json").read_text())
    assert snap1["parents"] == [man["rounds"][0]["snapshot"]]
    assert (run / "solver" / "adapter_model.safetensors").exists() and (run / "writer" / "q_head.safetensors").exists()
    # the trained writer drives strategy choice in eval (greedy over its Q-values when asked, logged)
    ev = tmp_path / "eval"
    run_mlmt("eval", "--run", run, "--out", ev, "--limit", "2", *sets, "--set", "episode.strategy_selection=greedy",
             "--set", "episode.min_q_decisions=0",
             check=True, env=env)
    # held-out numbers under eval/, not beside the training batches' collect/
    (ev_file,) = ev.glob("snapshots/_logs/*/wandb/offline-run-*/run-*.wandb")
    assert "eval/acc_t1" in wandb_history(ev_file, expect=1)[0][1]
    rep = json.loads((ev / "eval.json").read_text())
    from tosca_mlmt.store import load_snapshot

    fb = [t for e in load_snapshot(ev / "snapshots", rep["snapshot_id"]).episodes() for t in e.turns if t.kind == "feedback"]
    assert all(t.q_values is not None and t.behaviour_prob == 1.0 for t in fb)
    # every key the run and its eval logged has its meaning in the docs' metrics glossary
    from tosca_mlmt.analysis.glossary import undocumented

    keys = {k for f in [*run.rglob("metrics.jsonl"), *ev.rglob("metrics.jsonl")]
            for line in f.read_text().splitlines() if line.strip() for k in json.loads(line)}
    assert len(keys) > 100
    assert undocumented(keys) == [], f"add {undocumented(keys)} to tosca_mlmt/analysis/glossary.py"
    a = run_mlmt("analyze", run, ev, "--out", tmp_path / "report", check=True)
    report = tmp_path / "report" / "report.md"
    assert a.stdout.strip().splitlines()[-1] == str(report) and "Correction matrix" in report.read_text()
    # a joint run's real layout (nested stage runs, joint/q/*, joint/bonus/*) fills every curated figure
    page = (tmp_path / "report" / "report.html").read_text()
    assert all(f'alt="{f}"' in page for f in ("accuracy per turn", "correction matrix", "Q per strategy",
                                                "bonus per transition"))


def assert_one_timeline(run, stderr: str) -> None:
    """Every stage's records of every round in the joint run's metrics.jsonl and wandb run, each at
    its own rising global step; no key with two meanings; a console line per round."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == list(range(1, len(recs) + 1))
    lower = [r for r in recs if "lower/acc_t1" in r]
    upper = [r for r in recs if "upper/td_loss" in r]
    assert [r["joint/round"] for r in lower] == [0, 1] and {r["joint/round"] for r in upper} == {0, 1}
    assert all({"lower/reward_mean", "lower/reward_std", "lower/frac_reward_zero_std"} <= r.keys() for r in lower)
    assert max(r["step"] for r in upper if r["joint/round"] == 0) < lower[0]["step"] < min(
        r["step"] for r in upper if r["joint/round"] == 1)
    assert sum("joint/collect/acc_t1" in r for r in recs) == 2 and not any("joint/acc_t1" in r for r in recs)
    (run_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    hist = wandb_history(run_file, expect=len(steps))
    assert [s for s, _ in hist] == steps
    keys = set().union(*(r for _, r in hist))
    assert {"lower/acc_t1", "lower/frac_reward_zero_std", "upper/td_loss", "joint/collect/acc_t1"} <= keys
    for r in (1, 2):
        assert stderr.count(f"round {r}/2: acc_t1 ") == 1 and "zero-std groups" in stderr
    # one table at the end, not a table per round repeating the lines above
    assert stderr.count("train-joint rounds") == 1 and ": snapshot snap-" not in stderr


def test_a_frozen_writer_spends_no_collect_episodes(tmp_path):
    """Equal compute is counted in episodes: with joint.freeze_writer the round's writer snapshot is
    not collected (no policies or engine are touched), and a later round names no missing parent."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines import train_joint as tj

    cfg = load_config(overrides={"joint.freeze_writer": True})
    rec, manifest = {}, {"rounds": [{"snapshot": None}, {}]}
    tj._collect(cfg, rec, manifest, tmp_path, None, None, 1, None)  # None policies/engine: any use would raise
    assert rec == {"snapshot": None} and not any(tmp_path.iterdir())
    tj._upper(cfg, rec, manifest, tmp_path, tmp_path, tmp_path, None, None, 1)
    assert rec["upper"] is None


@pytest.mark.parametrize("every, window, want", [
    (1, 1, {0: ["s0"], 1: ["s1"], 2: ["s2"], 3: ["s3"], 4: ["s4"]}),
    (1, 2, {0: ["s0"], 1: ["s0", "s1"], 2: ["s1", "s2"], 3: ["s2", "s3"], 4: ["s3", "s4"]}),
    (2, 1, {0: ["s0"], 2: ["s1", "s2"], 4: ["s3", "s4"]}),  # a window of rounds dropped s1 and s3
    (2, 0, {0: ["s0"], 2: ["s0", "s1", "s2"], 4: ["s0", "s1", "s2", "s3", "s4"]}),
])
def test_writer_updates_read_every_round_of_their_window_and_warm_up_once(monkeypatch, tmp_path, every, window, want):
    """joint.replay_window counts writer updates, so with upper_every > 1 every collected round is read;
    upper.warmup_steps counts the writer's steps over the run (the Q head goes on between updates),
    where each update used to start its own warm-up, so 20-step updates under a 50-step warm-up never
    trained the text."""
    from types import SimpleNamespace

    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines import train_joint as tj

    seen = {}

    def train_upper(ucfg, out, **kw):
        seen[int(out.parent.name)] = (list(ucfg.upper.snapshots), ucfg.upper.warmup_steps, ucfg.upper.steps)
        return SimpleNamespace(writer_dir=tmp_path / "w", metrics={})

    monkeypatch.setattr(tj, "train_upper", train_upper)
    cfg = load_config(overrides={"joint.upper_every": every, "joint.replay_window": window, "joint.rounds": 5,
                                 "joint.upper_steps": 3, "upper.warmup_steps": 7})
    manifest = {"rounds": [], "writer": None}
    for r in range(5):
        manifest["rounds"].append({"round": r, "done": [], "snapshot": f"s{r}"})
        tj._upper(cfg, manifest["rounds"][r], manifest, tmp_path, tmp_path / f"{r:03d}", None, None, None, r)
    assert {r: w for r, (w, _, _) in seen.items()} == want
    assert [warm for _, warm, _ in seen.values()] == [7, 4, 1, 0, 0][: len(seen)]
    assert {steps for _, _, steps in seen.values()} == {3}
    # joint.writer_warmup=update: every update starts its own warm-up, as before the count went over the run
    seen.clear()
    cfg = load_config(overrides={"joint.upper_every": every, "joint.replay_window": window, "joint.rounds": 5,
                                 "joint.upper_steps": 3, "upper.warmup_steps": 2, "joint.writer_warmup": "update"})
    for r in range(5):
        tj._upper(cfg, manifest["rounds"][r], manifest, tmp_path, tmp_path / f"{r:03d}", None, None, None, r)
    assert [warm for _, warm, _ in seen.values()] == [2] * len(seen) and len(seen) == len(want)


def test_a_joint_run_whose_writer_never_passes_its_warm_up_is_refused(tmp_path):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ConfigError
    from tosca_mlmt.pipelines.train_joint import _check_writer_warmup, train_joint

    over = {"joint.rounds": 4, "joint.upper_every": 2, "joint.upper_steps": 20, "upper.warmup_steps": 40}
    with pytest.raises(ConfigError, match=r"upper\.warmup_steps.*40 steps in all"):
        train_joint(load_config(overrides=over), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    for ok in ({"upper.warmup_steps": 39}, {"upper.text_loss": "none"}, {"joint.freeze_writer": True}):
        _check_writer_warmup(load_config(overrides={**over, **ok}))  # no error
    # per update, 20 steps under a 20-step warm-up never train the text, though the run has 40 steps
    per_update = {**over, "joint.writer_warmup": "update", "upper.warmup_steps": 20}
    with pytest.raises(ConfigError, match=r"upper\.warmup_steps.*20 steps per update"):
        _check_writer_warmup(load_config(overrides=per_update))
    _check_writer_warmup(load_config(overrides={**per_update, "upper.warmup_steps": 19}))
