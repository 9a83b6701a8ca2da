"""What the benchmark scripts record about a run: the demo's seeds run the commands a reader can
repeat from the JSON, and the machine line names the CPU flags that decide bf16 numerics."""

import importlib
import json
import statistics
import sys
from pathlib import Path

import pytest

from tosca_mlmt.tasks.arith import VERIFIER_VERSION as ARITH_VERIFIER

ROOT = Path(__file__).resolve().parents[2]


def _script(module: str):
    """A benchmark script (or benchmarks.common) as a fresh module: benchmarks/ is a package run from the
    repository root (python -m benchmarks.<kind>.<script>), its shared helpers in benchmarks.common."""
    sys.modules.pop(module, None)
    return importlib.import_module(module)


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    # the machine line lives in benchmarks.common, which every script imports it from
    return _script("benchmarks.learning.demo_seeds"), _script("benchmarks.common")


def test_demo_seeds_passes_every_override_to_all_three_commands(scripts, monkeypatch, tmp_path):
    demo_seeds, _ = scripts
    ran = []
    monkeypatch.setattr(demo_seeds, "_run", lambda cmd: ran.append(cmd) or 1.0)
    demo_seeds.run_seed(tmp_path, 3, 10, "configs/demo.yaml",
                        ["lower.bonus.scorer=auto", "engine.vllm.cpu_norm_kernel=false"])
    assert [c[1] for c in ran] == ["eval", "train-joint", "eval"]
    for cmd in ran:
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        assert sets == ["lower.bonus.scorer=auto", "engine.vllm.cpu_norm_kernel=false"]
        assert cmd[cmd.index("--seed") + 1] == "3" and cmd[cmd.index("--config") + 1] == "configs/demo.yaml"
    assert ran[2][ran[2].index("--compare-to") + 1] == str(tmp_path / "eval-before")


def test_demo_seeds_sums_each_ppo_stage_over_the_iterations_of_a_run(scripts, tmp_path):
    """Only train-lower iterations count (the rows with lower/iteration_seconds), not the writer's or
    the joint step's rows, and a stage one iteration lacks adds nothing there."""
    import json

    demo_seeds, _ = scripts
    rows = [{"upper/time/step": 9.0, "step": 1},
            {"lower/iteration_seconds": 10.0, "lower/time/update": 4.0, "lower/time/bonus": 2.5, "lower/kl": 0.1},
            {"joint/time/lower": 99.0},
            {"lower/iteration_seconds": 12.5, "lower/time/update": 5.25}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert demo_seeds.ppo_stage_seconds(tmp_path) == {"iterations": 2, "iteration_seconds": 22.5, "update": 9.25,
                                                      "bonus": 2.5}


def test_machine_info_names_the_bf16_flags_the_dtype_decision_reads(scripts):
    from tosca_mlmt.precision import native_bf16

    _, ct = scripts
    flags = ct.machine_info()["cpu_flags"]
    assert set(flags) <= set(ct.BF16_FLAGS)
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    assert set(flags) == set(ct.BF16_FLAGS) & set(line.split(":", 1)[-1].split())
    # the same CPU, read by the package's own precision decision (which asks CUDA first where it can)
    import torch

    if not torch.cuda.is_available():
        assert native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_a_measurement_never_overwrites_an_earlier_result_of_its_day_and_variant(scripts, monkeypatch, tmp_path):
    """out_path gives a run the first free name: today's result (JSON or its .md) stays, a second run of the
    same variant takes -2, a third -3; an explicit --out is the caller's to overwrite."""
    _, ct = scripts
    monkeypatch.setattr(ct, "RESULTS", tmp_path)
    first = ct.out_path(None, "bench", ("env",), env="none")
    assert first == tmp_path / "bench" / f"{ct.today()}_none.json" and first.parent.is_dir()
    assert ct.out_path(None, "bench", ("env",), env="none") == first  # nothing written yet: still free
    first.write_text("{}")
    second = ct.out_path(None, "bench", ("env",), env="none")
    assert second.name == f"{ct.today()}_none-2.json"
    second.with_suffix(".md").write_text("table")  # a script that wrote its table first
    assert ct.out_path(None, "bench", ("env",), env="none").name == f"{ct.today()}_none-3.json"
    assert ct.out_path(str(first), "bench", ("env",), env="none") == first and first.read_text() == "{}"


def test_allocator_ab_preloads_each_arms_malloc_alternates_and_takes_medians(monkeypatch, tmp_path):
    """--allocators: every run's child gets its arm's library and MALLOC_CONF, no malloc or
    MALLOC_CONF inherited (a glibc arm must not run on the caller's malloc) but other preloads kept, as
    the mlmt command does; the order reverses every other round, and the summary is the median of
    each arm's runs."""
    monkeypatch.syspath_prepend(str(ROOT))
    tlt = _script("benchmarks.speed.train_lower_throughput")

    from tosca_mlmt import runtime

    monkeypatch.setattr(runtime, "allocator_library", lambda name: f"/lib/lib{name}.so")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so.4:/opt/libcaller.so")
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    speed = {"glibc": [60.0, 70.0, 80.0], "jemalloc@dirty_decay_ms:-1": [30.0, 50.0, 40.0]}
    seen = []

    def spawn(args, what, env=None, sets=()):
        assert sets == ()
        arm = "jemalloc@dirty_decay_ms:-1" if "libjemalloc" in env["LD_PRELOAD"] else "glibc"
        seen.append((arm, env.get("LD_PRELOAD"), env.get("MALLOC_CONF")))
        tok = speed[arm][sum(a == arm for a, *_ in seen) - 1]
        return {"tokens_per_s": tok, "time_breakdown": {"update": 100 / tok}, "minor_page_faults": int(tok),
                "peak_rss_mb": {"self": 1024 * tok}, "malloc": arm.split("@")[0]}

    monkeypatch.setattr(tlt, "spawn", spawn)
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["x", "--allocators", "glibc", "jemalloc@dirty_decay_ms:-1", "--rounds", "3",
                                      "--out", str(out)])
    tlt.main()
    assert [s[0] for s in seen] == [
        "glibc", "jemalloc@dirty_decay_ms:-1", "jemalloc@dirty_decay_ms:-1", "glibc", "glibc",
        "jemalloc@dirty_decay_ms:-1"]
    assert {s for s in seen if s[0] == "glibc"} == {("glibc", "/opt/libcaller.so", None)}
    assert {s for s in seen if s[0] != "glibc"} == {("jemalloc@dirty_decay_ms:-1", "/lib/libjemalloc.so:/opt/libcaller.so",
                                                     "dirty_decay_ms:-1")}
    summary = json.loads(out.read_text())["summary"]
    assert summary["glibc"]["tokens_per_s_median"] == 70.0
    assert summary["jemalloc@dirty_decay_ms:-1"]["tokens_per_s_median"] == 40.0
    assert summary["jemalloc@dirty_decay_ms:-1"]["ratio_to_glibc"] == round(40 / 70, 3)
    assert summary["jemalloc@dirty_decay_ms:-1"]["update_s_median"] == 2.5
    assert summary["glibc"]["peak_rss_gib_median"] == 70.0
    with pytest.raises(SystemExit, match="mimalloc"):
        monkeypatch.setattr(sys, "argv", ["x", "--allocators", "mimalloc", "--out", str(out)])
        tlt.main()


def test_old_pass_ab_runs_each_arms_old_logprobs_after_the_callers_overrides(monkeypatch, tmp_path):
    """--old-pass-ab: each child gets --set lower.old_logprobs=<arm> after the caller's --set (so the
    arm wins), in the caller's environment; the order reverses every other round, and the summary
    holds each arm's median old/ref seconds, the share of rows its pi_old pass scored and each
    round's old/ref ratio divided by the drift of the stages both arms run alike."""
    monkeypatch.syspath_prepend(str(ROOT))
    tlt = _script("benchmarks.speed.train_lower_throughput")

    old_ref = {"auto": [5.0, 6.0], "recompute": [9.0, 8.0]}
    slow = {"auto": [1.0, 1.0], "recompute": [2.0, 1.0]}  # the machine ran round 0's recompute at half speed
    seen = []

    def spawn(args, what, env=None, sets=()):
        arm = sets[0].split("=")[1]
        seen.append((arm, env, tuple(args.set), sets))
        i = sum(a == arm for a, *_ in seen) - 1
        return {"tokens_per_s": 100 / old_ref[arm][i], "seconds": 2 * old_ref[arm][i], "old_pass": {"auto": 0.5}.get(arm, 1.0),
                "time_breakdown": {"generate": 3.0 * slow[arm][i], "bonus": 1.0 * slow[arm][i],
                                   "update": 1.0 * slow[arm][i], "old_ref_logprobs": old_ref[arm][i]},
                "minor_page_faults": 1,
                "peak_rss_mb": {"self": 1024}, "malloc": "glibc"}

    monkeypatch.setattr(tlt, "spawn", spawn)
    import tosca_mlmt.runtime as runtime

    monkeypatch.setattr(runtime, "use_allocator", lambda choice: None)  # no re-exec of pytest on tcmalloc
    out = tmp_path / "old.json"
    monkeypatch.setattr(sys, "argv", ["x", "--old-pass-ab", "--rounds", "2", "--set", "lower.minibatch_size=8",
                                      "--out", str(out)])
    tlt.main()
    assert [s[0] for s in seen] == ["auto", "recompute", "recompute", "auto"]
    assert {s[1:] for s in seen} == {(None, ("lower.minibatch_size=8",), (f"lower.old_logprobs={a}",))
                                     for a in ("auto", "recompute")}
    summary = json.loads(out.read_text())["summary"]
    assert summary["auto"]["old_ref_logprobs_s_median"] == 5.5 and summary["recompute"]["old_ref_logprobs_s_median"] == 8.5
    assert summary["old_ref_ratio_per_round"] == [
        {"round": 0, "raw": 1.8, "alike_stages": 2.0, "drift_adjusted": 0.9},
        {"round": 1, "raw": round(8 / 6, 3), "alike_stages": 1.0, "drift_adjusted": round(8 / 6, 3)}]
    assert summary["auto"]["old_pass"] == 0.5 and summary["recompute"]["old_pass"] == 1.0
    assert summary["recompute"]["ratio_to_auto"] == round(statistics.median([100 / 9, 100 / 8]) /
                                                          statistics.median([100 / 5, 100 / 6]), 3)


def test_the_benchmark_passes_set_overrides_to_its_child_after_its_own(monkeypatch, tmp_path):
    """spawn's child command line carries the caller's --set and then the arm's, in that order,
    and run_ours applies them over the script's own overrides (the later --set wins)."""
    monkeypatch.syspath_prepend(str(ROOT))
    tlt = _script("benchmarks.speed.train_lower_throughput")

    import tosca_mlmt.pipelines.train_lower as tl

    cmds, cfgs = [], []

    class Done(Exception):
        pass

    def fake_popen(cmd, env=None):
        cmds.append(cmd)
        raise Done

    monkeypatch.setattr(tlt.subprocess, "Popen", fake_popen)
    args = tlt.argparse.Namespace(problems=4, group=4, max_new_tokens=32, iterations=3, workdir=str(tmp_path),
                                  trl_bf16="auto", single_turn=False, set=["lower.minibatch_size=8"])
    with pytest.raises(Done):
        tlt.spawn(args, "ours:vllm:auto:direct", sets=("lower.old_logprobs=recompute",))
    assert cmds[0][-4:] == ["--set", "lower.minibatch_size=8", "--set", "lower.old_logprobs=recompute"]

    def fake_train(cfg, out):
        cfgs.append(cfg)
        raise Done

    monkeypatch.setattr(tl, "train_lower", fake_train)
    with pytest.raises(Done):
        tlt.run_ours(tlt.argparse.Namespace(**{**vars(args), "set": ["lower.minibatch_size=8", "lower.kl_mode=loss"]}),
                     "hf")
    assert cfgs[0].lower.minibatch_size == 8 and cfgs[0].lower.kl_mode == "loss"  # the script's own: 16


def test_rescore_finds_the_turns_a_verifier_change_moves(monkeypatch, tmp_path):
    """benchmarks/probes/rescore.py re-verifies stored turns from their text: a refine stored wrong under the
    old reading of "The answer is 2. So" scores right now, the others keep their verdicts, and the
    pooled difference over two snapshots of the same problems is the moved share."""
    monkeypatch.syspath_prepend(str(ROOT))
    rescore = _script("benchmarks.probes.rescore")

    from factories import make_episodes
    from tosca_mlmt.store import write_snapshot

    manifest = {"config": {"task": {"name": "arith", "level": 1}}, "task": {"verifier_version": "arith-v2"}}
    folders = []
    for k in range(2):
        eps = make_episodes(4)
        for i, ep in enumerate(eps):  # gold i + 1
            solve, _, refine = ep.turns
            solve.text, solve.correct = f"The answer is {i + 5}.", False
            refine.text, refine.correct = f"The answer is {i + 1}.", True
        eps[k].turns[2].text, eps[k].turns[2].correct = f"The answer is {k + 1}. So", False  # the old reading
        sid, _ = write_snapshot(tmp_path / "s", eps, {**manifest, "seed": k})
        folders.append(tmp_path / "s" / sid)
    units = [rescore.rescore(f) for f in folders]
    assert [(u["acc_final"]["stored"], u["acc_final"]["now"], u["turns_moved"]) for u in units] == [(0.75, 1.0, 1)] * 2
    assert units[0]["moved"][0]["now"] == ["1", True] and units[0]["moved"][0]["turn"] == "refine"
    assert units[0]["verifier_now"] == ARITH_VERIFIER and units[0]["acc_t1"] == {"stored": 0.0, "now": 0.0}
    pooled = rescore.pooled(units)
    assert pooled["acc_final"]["now_minus_stored"]["mean"] == 0.25 and pooled["bootstrap"] == "snapshots x problems"
    assert pooled["turns_moved"] == 2


def test_compare_grids_pools_each_grid_and_differences_the_seeds_both_have(monkeypatch, tmp_path):
    """benchmarks/learning/compare_grids.py on hand-made units: each grid's means are over all its seeds, A minus B
    over the seeds both have, problems matched by id whatever order a unit stored them in, and a grid
    whose units disagree on their config is refused."""
    monkeypatch.syspath_prepend(str(ROOT))
    compare_grids = _script("benchmarks.learning.compare_grids")

    monkeypatch.setattr(compare_grids, "UNITS", tmp_path)
    ids = ["p0", "p1", "p2", "p3"]

    def unit(grid, seed, t1, final, config="c", order=ids):
        pos = {p: i for i, p in enumerate(ids)}
        (tmp_path / grid).mkdir(exist_ok=True)
        u = {"method": "m", "seed": seed, "config": config, "git_sha": "x", "date": "d", "ids": list(order),
             "t1": [t1[pos[p]] for p in order], "final": [final[pos[p]] for p in order]}
        (tmp_path / grid / f"m-seed{seed}-{config}.json").write_text(json.dumps(u))

    unit("a", 0, [1, 1, 0, 0], [1, 0, 0, 1])
    unit("a", 1, [1, 0, 0, 0], [1, 0, 0, 0], order=list(reversed(ids)))
    unit("b", 0, [1, 1, 1, 0], [1, 1, 1, 1])
    unit("b", 1, [0, 0, 0, 0], [0, 0, 0, 0])
    unit("b", 2, [1, 1, 1, 1], [1, 1, 1, 1])
    res = compare_grids.compare(compare_grids.grid_units("a", "m"), compare_grids.grid_units("b", "m"))
    a, b, d = res["grids"]["a"], res["grids"]["b"], res["a_minus_b"]
    assert a["seeds"] == [0, 1] and b["seeds"] == [0, 1, 2] and d["seeds"] == [0, 1]
    assert a["acc_final"]["mean"] == 3 / 8 and a["acc_t1"]["mean"] == 3 / 8 and a["delta"]["mean"] == 0
    assert a["right_to_wrong"]["mean"] == 1 / 8 and a["wrong_to_right"]["mean"] == 1 / 8
    assert b["acc_final"]["mean"] == 8 / 12 and b["per_seed_acc_final"] == [1.0, 0.0, 1.0]
    assert d["acc_final"]["mean"] == 3 / 8 - 4 / 8  # seeds 0-1 only: B's seed 2 has no partner
    assert d["acc_final"]["lo"] <= d["acc_final"]["mean"] <= d["acc_final"]["hi"]
    unit("b", 3, [0, 0, 0, 0], [0, 0, 0, 0], config="other")
    with pytest.raises(SystemExit, match="several configs"):
        compare_grids.grid_units("b", "m")
    assert sorted(compare_grids.grid_units("b", "m", "other")) == [3]


def test_a_unit_keeps_its_eval_answers_and_rescore_scores_them_again(monkeypatch, tmp_path):
    """learning_efficacy.answer_tails keeps each eval answer's end in problem-id order (as t1/final), and
    rescore.rescore_unit scores a unit from them with today's verifier: a restated sum stored right moves,
    the rest keep their verdicts."""
    monkeypatch.syspath_prepend(str(ROOT))
    learning_efficacy = _script("benchmarks.learning.learning_efficacy")
    rescore = _script("benchmarks.probes.rescore")

    from factories import make_episodes
    from tosca_mlmt.store import write_snapshot
    from tosca_mlmt.tasks.arith import ArithTask

    eps = make_episodes(3)[::-1]  # stored out of id order
    for ep in eps:
        ep.turns[0].text = "x" * 300 + f"The answer is {ep.problem.answer}."
        # no answer line: the verifier reads the last number, 400 characters before the end
        ep.turns[2].text = "x" * 300 + f"so it is -{ep.problem.answer} apples" + " and words" * 40
    sid, _ = write_snapshot(tmp_path / "eval" / "snapshots", eps, {"task": {"name": "arith", "split": "test"}})
    (tmp_path / "eval" / "eval.json").write_text(json.dumps({"snapshot_id": sid}))
    from tosca_mlmt.pipelines.evaluate import eval_outcomes

    tails = learning_efficacy.answer_tails(eval_outcomes(tmp_path / "eval", texts=True))
    margin = learning_efficacy.ANSWER_MARGIN
    assert tails["t1"] == [("x" * margin + f"The answer is {i + 1}.") for i in range(3)]  # sorted by id
    task = ArithTask(1)
    for ep in sorted(eps, key=lambda e: e.problem.id):
        full, tail = ep.turns[2].text, tails["final"][int(ep.problem.id[-1])]
        assert len(tail) < len(full) and task.verify(ep.problem, tail) == task.verify(ep.problem, full)
        assert f"-{ep.problem.answer}" in tail

    probs = ArithTask(2).load("test", 3).problems
    unit = {"key": {"level": 2}, "git_sha": "abcdef0", "ids": [p.id for p in probs], "t1": [1, 1, 0],
            "final": [1, 1, 0],
            "answers": {"t1": [f"The answer is {probs[0].answer}.", "The answer is: 1 + 2", "The answer is 9999."],
                        "final": [f"The answer is {probs[0].answer}.", "The answer is: 1 + 2", "The answer is 9999."]}}
    path = tmp_path / "m-seed0-c.json"
    path.write_text(json.dumps(unit))
    u = rescore.rescore_unit(path)
    assert u["acc_t1"] == {"stored": 2 / 3, "now": 1 / 3} and u["turns_moved"] == 2
    assert {m["episode"] for m in u["moved"]} == {probs[1].id} and u["verifier_now"] == ARITH_VERIFIER


def test_hierarchy_cost_sums_each_stages_clocks_and_divides_by_grpo_at_the_same_seed(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    hc = _script("benchmarks.speed.hierarchy_cost")
    run = tmp_path / "run"
    run.mkdir()
    rounds = [{"round": 0, "seconds": {"collect": 10.0, "upper": 30.0, "lower": 5.0}, "sync_seconds": 1.5},
              {"round": 1, "seconds": {"collect": 12.0, "upper": 28.0, "lower": 6.0}, "sync_seconds": 2.0}]
    (run / "manifest.json").write_text(json.dumps({"rounds": rounds}))
    records = [{"joint/collect/time/episodes": 8.0, "joint/time/collect": 10.0, "joint/peak_rss_gib/collect": 3.1,
                "joint/collect/gen_seconds": 6.0, "joint/collect/score_seconds": 1.5},
               {"upper/time/q_eval": 14.0, "upper/time/update": 9.0, "upper/step": 1},
               {"upper/time/q_eval": 13.0, "lower/time/generate": 3.0, "lower/time/update": 2.0},
               {"lower/time/generate": 4.0, "joint/peak_rss_gib/lower": 4.7, "lower/reward_mean": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p = hc.profile(run, wall=123.456)
    assert p["stage_seconds"] == {"collect": 22.0, "upper": 58.0, "lower": 11.0} and p["sync_seconds"] == 3.5
    assert p["steps"] == {"collect": {"episodes": 8.0, "episodes.gen": 6.0, "episodes.score": 1.5},
                          "upper": {"q_eval": 27.0, "update": 9.0},
                          "lower": {"generate": 7.0, "update": 2.0}}
    assert list(p["steps"]["upper"]) == ["q_eval", "update"]  # largest first: where the time goes
    assert p["peak_rss_gib"] == 4.7 and p["train_seconds"] == 123.5 and p["rounds"] == 2
    units = [{"method": "single-turn-grpo", "seed": 0, "train_seconds": 100.0},
             {"method": "mlmt", "seed": 0, "train_seconds": 450.0},
             {"method": "mlmt", "seed": 1, "train_seconds": 500.0},  # no baseline at seed 1: no ratio
             {"method": "single-turn-grpo", "seed": 2, "train_seconds": 80.0},
             {"method": "solver-only", "seed": 2, "train_seconds": 200.0}]
    assert hc.ratios(units) == {"mlmt": {"0": 4.5}, "solver-only": {"2": 2.5}}


def test_hierarchy_cost_overhead_splits_each_ratio_into_its_stages(monkeypatch):
    """The stage shares (with the rest of the wall) sum to the ratio; solver steps are multiples of the
    baseline's own, and a step the baseline barely ran (< 1 s) gives no multiple."""
    monkeypatch.syspath_prepend(str(ROOT))
    hc = _script("benchmarks.speed.hierarchy_cost")
    grpo = {"method": "single-turn-grpo", "seed": 0, "train_seconds": 100.0, "stage_seconds": {"lower": 90.0},
            "steps": {"lower": {"update": 40.0, "generate": 30.0, "bonus": 0.5}}}
    mlmt = {"method": "mlmt", "seed": 0, "train_seconds": 450.0,
            "stage_seconds": {"collect": 100.0, "upper": 150.0, "lower": 180.0},
            "steps": {"lower": {"update": 100.0, "generate": 60.0, "bonus": 20.0}}}
    cut = {**mlmt, "method": "solver-only", "finished": False}
    got = hc.overhead([grpo, mlmt, cut])
    assert list(got) == ["mlmt"]
    shares = got["mlmt"]["0"]["of_baseline_time"]
    assert shares == {"collect": 1.0, "upper": 1.5, "lower": 1.8, "rest": 0.2}
    assert sum(shares.values()) == pytest.approx(hc.ratios([grpo, mlmt])["mlmt"]["0"])
    assert got["mlmt"]["0"]["solver_steps_x_baseline"] == {"update": 2.5, "generate": 2.0}


def test_hierarchy_cost_assembles_a_cut_invocation_and_gives_no_ratio_to_an_unfinished_run(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    hc = _script("benchmarks.speed.hierarchy_cost")
    full = {"collect", "upper", "lower"}
    for name, used, rounds in (("single-turn-grpo", 100.0, [full, full]), ("solver-only", 250.0, [full, full]),
                               ("mlmt", 300.0, [full, {"collect"}])):  # mlmt killed in its second round
        run = tmp_path / name / "seed0"
        run.mkdir(parents=True)
        recs = [{"round": r, "done": sorted(d), "seconds": {s: 1.0 for s in d}} for r, d in enumerate(rounds)]
        (run / "manifest.json").write_text(json.dumps({"rounds": recs, "seconds_used": used}))
        (run / "metrics.jsonl").write_text(json.dumps({"lower/time/update": 2.0}) + "\n")
    units = hc.assembled(tmp_path, ["single-turn-grpo", "solver-only", "mlmt", "mlmt-sentences-only"], [0])
    assert [(u["method"], u["train_seconds"], u["finished"]) for u in units] == [
        ("single-turn-grpo", 100.0, True), ("solver-only", 250.0, True), ("mlmt", 300.0, False)]
    assert units[2]["stage_seconds"] == {"collect": 2.0, "upper": 1.0, "lower": 1.0}
    assert hc.ratios(units) == {"solver-only": {"0": 2.5}}


def test_the_trl_comparison_runs_on_the_malloc_mlmt_picks_and_an_allocator_ab_on_its_arms(monkeypatch):
    """The default mode re-executes itself on engine.allocator auto's malloc before any run (both sides
    inherit it: until 2026-12-07 it measured glibc's peaks); --allocators leaves each arm its own."""
    monkeypatch.syspath_prepend(str(ROOT))
    tlt = _script("benchmarks.speed.train_lower_throughput")
    import tosca_mlmt.runtime as runtime

    calls = []

    class Done(Exception):
        pass

    def fake_use(choice):
        calls.append(("use_allocator", choice))

    def fake_mode(name):
        def run(args, *rest):
            calls.append((name,))
            raise Done
        return run

    monkeypatch.setattr(runtime, "use_allocator", fake_use)
    for mode in ("ours_vs_trl", "allocator_ab", "old_pass_ab", "child"):
        monkeypatch.setattr(tlt, mode, fake_mode(mode))
    for argv, expected in ((["--engines", "vllm"], [("use_allocator", "auto"), ("ours_vs_trl",)]),
                           (["--old-pass-ab"], [("use_allocator", "auto"), ("old_pass_ab",)]),
                           (["--allocators", "glibc", "tcmalloc"], [("allocator_ab",)]),
                           (["--child", "trl", "--child-out", "x.json"], [("child",)])):
        calls.clear()
        monkeypatch.setattr(sys, "argv", ["train_lower_throughput", *argv])
        with pytest.raises(Done):
            tlt.main()
        assert calls == expected, argv


def test_memory_lower_variants_run_train_lower_at_the_library_defaults(monkeypatch, tmp_path):
    """lower-defaults[-vllm]: `mlmt train-lower` with no config file and two iterations (each
    iteration's peak read from metrics.jsonl, the malloc from run.json); the demo variants keep
    train-joint on configs/demo.yaml."""
    monkeypatch.syspath_prepend(str(ROOT))
    mem = _script("benchmarks.speed.memory")
    cmds = []

    def fake_run(cmd):
        cmds.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        if "train-lower" in cmd:
            rows = [{"lower/iteration": 1, "lower/peak_rss_gib": 3.2, "lower/iteration_seconds": 90.0},
                    {"lower/iteration": 2, "lower/peak_rss_gib": 3.9, "lower/iteration_seconds": 80.04}]
            (out / "run.json").write_text(json.dumps({"packages": {"malloc": "tcmalloc"}}))
        else:
            rows = [{"joint/round": 0, "joint/peak_rss_gib/collect": 2.5, "joint/time/collect": 10.0}]
            (out / "manifest.json").write_text(json.dumps({"packages": {"malloc": "jemalloc"}}))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 4000.0

    monkeypatch.setattr(mem, "_run", fake_run)
    row = mem.run_variant("lower-defaults-vllm", mem.variant("lower-defaults-vllm"), tmp_path, 3)
    cmd = cmds[-1]
    assert cmd[len(mem.MLMT):len(mem.MLMT) + 3] == ["train-lower", "--set", "lower.iterations=2"]
    assert "--config" not in cmd and cmd[-2:] == ["--set", "engine.name=vllm"] and cmd[cmd.index("--seed") + 1] == "3"
    assert row["malloc"] == "tcmalloc" and row["peak_rss_mib"] == 4000.0
    assert row["steps"] == [{"iteration": 1, "peak_rss_gib": 3.2, "seconds": 90.0},
                            {"iteration": 2, "peak_rss_gib": 3.9, "seconds": 80.0}]
    assert mem.variant("lower-defaults") == {}
    row = mem.run_variant("demo", mem.variant("demo"), tmp_path, 0)
    assert cmds[-1][len(mem.MLMT):len(mem.MLMT) + 3] == ["train-joint", "--config", "configs/demo.yaml"]
    assert row["malloc"] == "jemalloc" and row["steps"][0]["step"] == "collect"
