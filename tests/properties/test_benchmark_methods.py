"""The learning benchmark's methods: each resolves to a valid configuration in every environment, and
its units are keyed by what it trains with (two names share units only when their configurations are
one). A unit costs ~25 CPU minutes, so a method that fails validation or silently equals another must
fail here, not an hour into a run."""

import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(name: str):
    """A script of benchmarks/learning/ as a module (benchmarks is a package run from the repository root)."""
    import sys

    if str(ROOT) not in sys.path:  # run as plain `pytest`, the checkout may not be on the path
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"benchmarks.learning.{name}")


@pytest.fixture(scope="module")
def bench():
    return _benchmark("learning_efficacy")


@pytest.fixture(scope="module")
def summary():
    return _benchmark("learning_summary")


def sizes(env: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(env=env, level=2, test_problems=300, engine="vllm", rounds=4, n_samples=4,
                                 collect_problems=32, lower_iterations=2, problems_per_iteration=4, upper_steps=30)


@pytest.mark.parametrize("env", ["none", "confidence", "verdict", "tool"])
def test_every_method_resolves_and_names_one_configuration(bench, env):
    every = dict(bench.METHODS, **{"verdict": bench.VERDICT_CONTROL, "tool": bench.TOOL_CONTROL}.get(env, {}))
    common, train = bench.run_overrides(sizes(env))
    ids = {name: bench.identity(preset, extra, common, train) for name, (preset, extra) in every.items()}
    by_hash: dict[str, list[str]] = {}
    for name, (h, _) in ids.items():
        by_hash.setdefault(h, []).append(name)
    shared = sorted(sorted(names) for names in by_hash.values() if len(names) > 1)
    # the one declared alias: the preset's configuration under the name it was measured by
    assert shared == [["mlmt", "mlmt-turn-own-credit-kl-loss"]]
    assert not ids["untrained"][1] and not ids["solver-only"][1] and ids["mlmt"][1]


def test_untrained_unit_ignores_training_sections_only(bench):
    common, train = bench.run_overrides(sizes("verdict"))
    base = bench.identity(bench.MLMT, None, common, train)[0]
    assert bench.identity(bench.MLMT, None, common, {**train, "lower.lr": 1e-5})[0] == base
    assert bench.identity(bench.MLMT, None, {**common, "episode.max_feedback_tokens": 32}, train)[0] != base


def test_auto_precision_without_native_bf16_defines_units_of_its_own(bench):
    """On a CPU without avx512_bf16/amx_bf16, 'auto' trains in fp32: its units must not pool with bf16 ones."""
    from tosca_mlmt.precision import native_bf16

    common, train = bench.run_overrides(sizes("none"))
    explicit = ({**common, "model.dtype": "bfloat16"}, {**train, "lower.autocast": "bf16"})
    ids = {bf16: [bench.identity(*bench.METHODS[m], common, train, bf16)[0] for m in ("mlmt", "untrained")]
           + [bench.identity(*bench.METHODS["mlmt"], *explicit, bf16)[0]] for bf16 in (True, False)}
    assert [a != b for a, b in zip(ids[True], ids[False])] == [True, True, False]  # explicit: one path anywhere
    assert ids[True][2] != ids[True][0]
    assert bench.identity(*bench.METHODS["mlmt"], common, train)[0] == ids[native_bf16()][0]  # None: this machine


@pytest.mark.parametrize("env,method", [("none", "mlmt"), ("none", "mlmt-sentences-only"), ("confidence", "mlmt-sentences-only"),
                                        ("verdict", "mlmt-sentences-only"), ("verdict", "solver-only"),
                                        ("verdict", "mlmt-sentences-only-engine-bonus"),
                                        ("verdict", "mlmt-verdict-sentences"), ("verdict", "solver-only-verdict-sentences"),
                                        ("verdict", "mlmt-verdict-sentences-gold-prob"),
                                        ("verdict", "mlmt-verdict-sentences-sampled-refines")])
def test_the_measured_units_still_count_for_their_method(bench, env, method):
    """A knob added with a default that changes no result must not orphan days of measured units:
    the current resolution of the method hashes to the config its stored units recorded."""
    import json

    common, train = bench.run_overrides(sizes(env))
    preset, extra = bench.METHODS[method]
    h = bench.identity(preset, extra, common, train, bf16=True)[0]  # where every stored unit ran
    units = sorted((ROOT / "benchmarks" / "results" / "learning_efficacy" / f"{env}-L2").glob(f"{method}-seed*-*.json"))
    assert units and any(json.loads(u.read_text()).get("config") == h for u in units)


def test_ending_turns_inside_vllm_does_not_define_a_unit(bench):
    """engine.vllm.stop_in_engine changes how much vLLM decodes, not the kept turns, so units run with the
    post-hoc cut count for the same method, and engine.vllm.direct_sync, rpc_transport and rpc_bucket_mb
    change how weights reach vLLM, not which; a knob that does change the method still changes the hash."""
    common, train = bench.run_overrides(sizes("none"))
    preset, extra = bench.METHODS["mlmt"]
    h = bench.identity(preset, extra, common, train)[0]
    assert bench.identity(preset, extra, {**common, "engine.vllm.stop_in_engine": False}, train)[0] == h
    assert bench.identity(preset, extra, {**common, "engine.vllm.direct_sync": False}, train)[0] == h
    assert bench.identity(preset, extra, {**common, "engine.vllm.rpc_transport": "bytes",
                                          "engine.vllm.rpc_bucket_mb": 16}, train)[0] == h
    assert bench.identity(preset, extra, {**common, "engine.allocator": "glibc"}, train)[0] == h  # malloc
    # with one base there is no second engine to share memory with
    assert bench.identity(preset, extra, {**common, "engine.vllm.writer_share": 0.3}, train)[0] == h
    assert bench.identity(preset, extra, {**common, "engine.vllm.block_size": 64}, train)[0] != h
    # vLLM's C++ RMSNorm rounds bf16 differently from the PyTorch norm every stored unit ran: its own units
    assert bench.identity(preset, extra, {**common, "engine.vllm.cpu_norm_kernel": True}, train)[0] != h
    # a warm-up per writer update is another schedule: units of its own
    assert bench.identity(preset, extra, common, {**train, "joint.writer_warmup": "update"})[0] != h
    # scoring the tempered distribution is another objective: units of its own, while raw keeps the old ones
    assert bench.identity(preset, extra, common, {**train, "lower.logprob_temperature": "sampling"})[0] != h
    # leaving cut turns out of the loss is another objective: units of its own, while off keeps the old ones
    assert bench.identity(preset, extra, common, {**train, "lower.mask_truncated": True})[0] != h
    # chat-template variables change the prompts: units of their own, while none keeps the old ones
    assert bench.identity(preset, extra, {**common, "model.chat_template_kwargs": {"enable_thinking": False}},
                          train)[0] != h


def test_the_results_page_learning_tables_are_the_stored_units(summary):
    """The results page's learning-efficacy tables are generated (docs/gen/build.py calls summarise()): a
    unit added without regenerating it, or a hand edit, leaves the page claiming numbers the units do not give."""
    text = (ROOT / "docs" / "results" / "index.md").read_text()
    lines, record = summary.summarise()
    assert "\n".join(lines) + "\n" in text, "docs/results/index.md is stale: run python docs/gen/build.py"


def test_summary_judges_each_writer_by_the_targets_rule(summary):
    """On hand-made units: a writer 1 point under the template meets "≥ template − 0.02", one 4 points under
    misses it, and a writer that breaks 4 % of answers misses "c→i ≤ 3 %" while one that breaks none meets it."""
    import numpy as np

    n = 300
    template = np.zeros(n)
    template[:150] = 1
    close, far = template.copy(), template.copy()
    close[:3] = 0  # 1 point under the template
    far[:12] = 0  # 4 points under
    t1_far = template.copy()  # far's refines broke its 12 right first answers: c->i 4 %
    unit = lambda t1, fin: [{"seed": 0, "t1": t1, "final": fin, "used": {"rounds": 4}}]  # noqa: E731
    per = {"verdict-template": unit(template, template), "mlmt": unit(close, close),
           "mlmt-sentences-only": unit(t1_far, far)}
    data = {"verdict": {"per": per, "methods": {m: summary.pooled(r) for m, r in per.items()}},
            "confidence": {"per": {}, "methods": {}}, "none": {"per": {}, "methods": {}}}
    _, record = summary.targets(data)
    by = {t["target"]: t for t in record}
    assert by["verdict: ≥ template − 0.02"]["met_by"] == ["`mlmt`"]
    assert by["verdict: ≥ template − 0.02"]["missed_by"] == ["selector"]
    assert by["verdict: c→i ≤ 3 %"]["met_by"] == ["`mlmt`"] and by["verdict: c→i ≤ 3 %"]["missed_by"] == ["selector"]
    assert not any(t["env"] != "verdict" for t in record)  # no units, no judgement


def test_a_later_codes_grid_is_judged_as_a_section_of_its_own(summary):
    """Units of a tagged grid (later code) are judged apart from the env's stored grid: a writer that
    breaks more right answers than it fixes in the tagged grid misses there while the stored grid, with
    no units, gives no judgement."""
    import numpy as np

    t1 = np.zeros(300)
    t1[:100] = 1
    fin = t1.copy()
    fin[:6] = 0  # 6 right first answers broken
    fin[200:203] = 1  # 3 wrong ones fixed
    per = {"mlmt": [{"seed": 0, "t1": t1, "final": fin, "used": {"rounds": 4}}]}
    data = {"none-v4": {"per": per, "methods": {"mlmt": summary.pooled(per["mlmt"])}},
            "none": {"per": {}, "methods": {}}}
    _, record = summary.targets(data)
    assert [(t["env"], t["missed_by"]) for t in record] == [("none-v4", ["`mlmt`"])]
    assert summary.SECTIONS["none-v4"][:2] == ("none", "v4")
    lines = summary.method_table({**data, "none-v4": {**data["none-v4"], "refines": {"mlmt": True}}})
    assert any("grid none-L2-v4" in line and "`mlmt`" in line and "2.0 % / 1.0 %" in line for line in lines)


def test_train_curve_keeps_one_strategy_share_per_iteration(bench, tmp_path):
    """A strategy no PPO batch chose is absent from that iteration's record: its list holds None there,
    so every curve lines up with lower/episodes."""
    import json

    rows = [{"lower/episodes": 16, "lower/strategy_share/a/after_right": 1.0},
            {"upper/td_loss": 0.5},  # not a PPO iteration
            {"lower/episodes": 16, "lower/strategy_share/b/after_right": 0.5},
            {"lower/episodes": 8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = bench.train_curve(tmp_path / "metrics.jsonl")
    assert curve["lower/episodes"] == [16, 16, 8]
    assert curve["lower/strategy_share/a/after_right"] == [1.0, None, None]
    assert curve["lower/strategy_share/b/after_right"] == [None, 0.5, None]


def test_batch_table_skips_a_method_that_ran_no_ppo_iteration(bench):
    """writer-only freezes the solver: its unit's train curve has keys but no iteration, and the PPO-batch
    table leaves it out instead of failing (it did, on the first writer-only unit)."""
    empty = {k: [] for k in bench.CURVE_KEYS}
    trained = {"lower/reward_turn0": [0.25, 0.5], "lower/reward_turn1": [0.25, 0.5],
               "lower/right_to_wrong": [0.0, 0.5], "lower/wrong_to_right": [0.0, 0.0], "lower/episodes": [4, 4]}
    lines = bench.batch_lines({"writer-only": [{"train_curve": empty}], "mlmt": [{"train_curve": trained}]})
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    assert rows == ["| mlmt | 1 | 0.250 → 0.500 | 2 of 3 |"]  # 1 + 2 right first attempts, 0 + 2 broken


@pytest.mark.timeout(300)
def test_a_unit_whose_process_is_killed_raises_instead_of_hanging(bench):
    """The OOM killer ends a unit's process with a signal; the invocation must move on (multiprocessing.Pool
    replaced the worker and waited for its lost task forever). os.abort stands in for the kill."""
    import os
    from concurrent.futures.process import BrokenProcessPool

    assert bench.in_child(os.getpid) != os.getpid()  # it does run in another process
    with pytest.raises(BrokenProcessPool):
        bench.in_child(os.abort)


def test_units_are_not_trained_under_the_other_machines_precision():
    """--native-bf16 only reads another machine's grids: training under it would file fp32 units as bf16."""
    import subprocess
    import sys

    from tosca_mlmt.precision import native_bf16

    other = "no" if native_bf16() else "yes"
    cmd = [sys.executable, "-m", "benchmarks.learning.learning_efficacy", "--env", "none", "--native-bf16", other,
           "--methods", "untrained", "--seeds", "0", "--work", "/nonexistent"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 2 and f"--native-bf16 {other}" in r.stderr and "--table-only" in r.stderr


def test_summary_intervals_resample_facts_and_ci_targets_are_judged_by_them(summary):
    """arith's 300 level-2 test problems ask 35 facts. On hand-made units whose outcome is one per fact, the
    by-fact interval (whole facts resampled) is wider than the per-problem one, counts the facts, and decides
    "CI > 0": a writer 0.33 above the untrained pair whose per-problem interval clears 0 misses the target when
    the by-fact one does not."""
    from collections import Counter

    import numpy as np

    from tosca_mlmt.analysis.stats import paired_bootstrap
    from tosca_mlmt.tasks.arith import ArithTask

    problems = ArithTask(2).load("test", 300).problems
    ids, facts = [p.id for p in problems], np.array([p.meta["fact"] for p in problems])
    good = {f for f, _ in Counter(facts).most_common(19)}  # the writer is right on the 19 most asked facts
    fin = np.array([1.0 if f in good else 0.0 for f in facts])
    unit = lambda x: [{"seed": 0, "t1": x, "final": x, "used": {"rounds": 4}, "ids": ids}]  # noqa: E731
    per = {"untrained": unit(1 - fin), "mlmt": unit(fin)}
    cell = summary.pooled(per["mlmt"])
    by_fact, per_problem = cell["acc_final_by_fact"], cell["acc_final"]
    assert by_fact["clusters"] == len(set(facts)) == 35
    assert by_fact["hi"] - by_fact["lo"] > 2 * (per_problem["hi"] - per_problem["lo"])
    d = summary.contrast(per, "mlmt", "untrained")
    assert d["by_fact"] == paired_bootstrap(fin[None], (1 - fin)[None], groups=facts)
    assert d["mean"] >= 0.30 and d["lo"] > 0 > d["by_fact"]["lo"] == summary.lower(d)  # the premise
    data = {"verdict": {"per": per, "methods": {m: summary.pooled(r) for m, r in per.items()}}}
    _, record = summary.targets(data)
    by = {t["target"]: t for t in record}
    assert by["verdict: Acc@final ≥ untrained + 0.30, CI > 0"]["missed_by"] == ["`mlmt`"]
    lines = summary.method_table({"verdict": {**data["verdict"], "refines": {"mlmt": True, "untrained": True}}})
    assert any("`mlmt`" in line and "over 35 facts" in line for line in lines)
    rec, lines = summary.le.table(per, "mlmt")  # the benchmark's own table reports it too
    assert rec["mlmt-minus-untrained"]["by_fact"] == d["by_fact"] and any("(35 facts)" in x for x in lines)


def test_the_benchmark_table_reads_the_facts_once_and_pairs_only_units_of_the_same_problems(bench, monkeypatch):
    """The by-fact contrasts share the primary's facts (facts_of reads the test files: once, not per
    baseline), and a baseline evaluated on other problems is an error, not a contrast paired by position."""
    import numpy as np

    import tosca_mlmt.tasks.arith as arith

    problems = arith.ArithTask(2).load("test", 40).problems
    ids = [p.id for p in problems]
    rng = np.random.default_rng(0)
    unit = lambda ids_: [{"seed": s, "t1": (x := (rng.random(40) < 0.5).astype(float)), "final": x,  # noqa: E731
                          "used": {}, "ids": ids_} for s in (0, 1)]
    calls = []
    real = arith.facts_of
    monkeypatch.setattr(arith, "facts_of", lambda i: calls.append(1) or real(i))
    per = {"mlmt": unit(ids), "untrained": unit(ids), "writer-only": unit(ids)}
    rec, _ = bench.table(per, "mlmt")
    from tosca_mlmt.analysis.stats import paired_bootstrap

    finals = {m: np.stack([r["final"] for r in runs]) for m, runs in per.items()}
    for b in ("untrained", "writer-only"):
        want = paired_bootstrap(finals["mlmt"], finals[b], groups=np.array(real(ids)))
        assert rec[f"mlmt-minus-{b}"]["by_fact"] == want and want["clusters"] < 40
    assert len(calls) == 1
    with pytest.raises(ValueError, match="writer-only was evaluated on other problems than mlmt"):
        bench.table({**per, "writer-only": unit(ids[::-1])}, "mlmt")


def test_every_unit_is_also_evaluated_on_unseen_phrasings_and_gsm8k(bench, monkeypatch, tmp_path):
    """By default a unit runs arith's test split, then test-unseen (the same facts, phrasings training never
    uses) and gsm8k's test split, each a valid eval config, and keeps their per-problem outcomes apart from
    the unit's own (which define it); ood_lines reports them per method."""
    import numpy as np

    from tosca_mlmt.pipelines import evaluate as ev

    args = bench.parser().parse_args([])
    assert set(args.ood_evals) == {"test-unseen", "gsm8k"}
    assert "ood_evals" not in bench._unit_key(args) and bench.parser().parse_args(["--ood-evals"]).ood_evals == []
    common, train = bench.run_overrides(args)
    seen = []

    def fake_evaluate(cfg, out):  # the eval config each eval resolves to, without a model
        seen.append((cfg.task.name, cfg.task.split, cfg.task.limit))
        return types.SimpleNamespace(report={"environment": "honest"})

    fake_outcomes = lambda folder, texts=False: {  # noqa: E731
        "ids": [f"arith-L2-unseen-{k:04d}" for k in range(3)], "t1": [0, 1, 0], "final": [1, 1, 0],
        **({"t1_text": ["1"] * 3, "final_text": ["2"] * 3} if texts else {})}
    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    monkeypatch.setattr(ev, "eval_outcomes", fake_outcomes)
    monkeypatch.setattr(bench, "tool_flags", lambda folder: None)  # no snapshot without a model
    r = bench.run_method("untrained", bench.MLMT, None, common, train, {}, 0, tmp_path, "sha", None,
                         bench.ood_overrides(args))
    assert seen == [("arith", "test", 300), ("arith", "test-unseen", 300), ("gsm8k", "test", 300)]
    assert set(r["evals"]) == {"test-unseen", "gsm8k"} and r["evals"]["gsm8k"]["final"] == [1.0, 1.0, 0.0]
    lines = bench.ood_lines({"untrained": [{**r, "t1": np.array(r["t1"]), "final": np.array(r["final"])}]})
    assert any("| untrained | test-unseen | 1 x 3 | 0.333 | 0.667" in line for line in lines)
    assert any("| untrained | gsm8k |" in line for line in lines)
    assert bench.ood_lines({"untrained": [{"seed": 0}]}) == []  # a unit from before the OOD evals: no table


# methods named for a KL setting of their own: the units measured before every method got one
OWN_KL = {"mlmt-reward-to-go", "mlmt-reward-to-go-no-signal-table", "mlmt-reward-to-go-greedy-writer-data",
          "solver-only-reward-to-go", "verdict-template-reward-to-go", "mlmt-turn-own-credit-kl-reward",
          "score-kl-reward", "single-turn-grpo-no-kl"}


def test_every_method_trains_with_one_kl_setting(bench):
    """Baselines and controls are regularised as the method is: every preset the benchmark names, and every
    method that does not say otherwise by name (OWN_KL), resolves to beta 0.01 in the loss. Single-turn
    GRPO trained with beta 0 and SCoRe with its KL as a reward until then."""
    from tosca_mlmt.config import load_config

    common, train = bench.run_overrides(sizes("verdict"))
    every = dict(bench.METHODS, **bench.VERDICT_CONTROL, **bench.ladder(2))
    assert OWN_KL <= set(every)
    kl = {}
    for name, (preset, extra) in every.items():
        lo = bench.method_config(preset, {**common, **train, **(extra or {})}).lower
        kl[name] = (lo.kl_coef, lo.kl_mode)
    by_preset = {load_config(p).lower.kl_coef for p, _ in every.values()}
    assert by_preset == {0.01}
    assert {kl[m] for m in every if m not in OWN_KL} == {(0.01, "loss")}
    assert all(kl[m] != (0.01, "loss") for m in OWN_KL)


def test_the_ladder_rungs_differ_from_single_turn_grpo_in_iterations_alone(bench):
    """--ladder: single-turn GRPO at 2x, 4x, 8x a grid's PPO iterations per round; resolved, each rung is
    single-turn-grpo but for joint.lower_iterations, and each has units of its own."""
    import dataclasses

    from tosca_mlmt.config import load_config

    args = bench.parser().parse_args(["--env", "none", "--lower-iterations", "3", "--ladder"])
    common, train = bench.run_overrides(args)
    rungs = {"single-turn-grpo": bench.METHODS["single-turn-grpo"], **bench.ladder(args.lower_iterations)}
    resolved = {m: load_config(p, {**common, **train, **e}) for m, (p, e) in rungs.items()}
    iterations = {m: c.joint.lower_iterations for m, c in resolved.items()}
    assert iterations == {"single-turn-grpo": 3, "single-turn-grpo-x2": 6, "single-turn-grpo-x4": 12,
                          "single-turn-grpo-x8": 24}
    base = resolved["single-turn-grpo"]
    for m, c in resolved.items():
        assert dataclasses.replace(c, joint=dataclasses.replace(c.joint, lower_iterations=3)) == base, m
    hashes = {bench.identity(p, e, common, train)[0] for p, e in rungs.values()}
    assert len(hashes) == 4
    assert set(bench.Units(args).every) >= set(rungs)
    assert not set(bench.ladder(3)) & set(bench.Units(bench.parser().parse_args(["--env", "none"])).every)


def test_the_masked_refine_control_is_mlmt_but_for_the_refines_loss(bench):
    import dataclasses

    from tosca_mlmt.config import load_config

    common, train = bench.run_overrides(sizes("none"))
    preset, extra = bench.METHODS["mlmt-masked-refine"]
    control = load_config(preset, {**common, **train, **extra})
    method = load_config(bench.MLMT, {**common, **train})
    assert not control.lower.train_refine and method.lower.train_refine
    assert dataclasses.replace(control, lower=dataclasses.replace(control.lower, train_refine=True)) == method


def test_the_tool_grid_runs_the_library_defaults_and_the_earlier_grids_keep_their_pins(bench):
    """The tool environment's writer reads the task's check (honest:tool) and Q gets its flag; its grid started
    after the pins, so it runs the library's defaults, while the earlier grids keep the settings their stored
    units ran (their hashes are checked above, test_the_measured_units_still_count_for_their_method)."""
    from tosca_mlmt.config import Config, load_config

    pins = {**bench.LEGACY_COMMON, **bench.LEGACY_TRAIN}
    for env in ("none", "confidence", "verdict"):
        common, train = bench.run_overrides(sizes(env))
        assert {k: {**common, **train}[k] for k in pins} == pins
    common, train = bench.run_overrides(sizes("tool"))
    assert not set(pins) & (set(common) | set(train))
    mlmt = load_config(bench.MLMT, {**common, **train})
    # fp32 pinned: one hash whichever CPU a session of the grid runs on
    assert (mlmt.model.dtype, mlmt.lower.autocast) == ("float32", "none")
    assert len({bench.identity(bench.MLMT, {}, common, train, bf16)[0] for bf16 in (True, False)}) == 1
    default = Config()
    assert mlmt.engine.vllm.kv_cache_gb == default.engine.vllm.kv_cache_gb
    assert mlmt.lower.bonus.scorer == default.lower.bonus.scorer and mlmt.lower.score_batch == default.lower.score_batch
    assert mlmt.episode.writer_sees == "tool" and mlmt.upper.q_signal
    preset, extra = bench.TOOL_CONTROL["tool-template"]
    template = load_config(preset, {**common, **train, **extra})
    assert template.episode.feedback == "tool" and template.joint.freeze_writer
    preset, extra = bench.TOOL_CONTROL["mlmt-tool-selector"]
    selector = load_config(preset, {**common, **train, **extra})
    assert "point_at_step" in selector.episode.prefix_only and not selector.joint.freeze_writer
    assert set(bench.TOOL_CONTROL) <= set(bench.Units(bench.parser().parse_args(["--env", "tool"])).every)
    assert not set(bench.TOOL_CONTROL) & set(bench.Units(bench.parser().parse_args(["--env", "none"])).every)


def test_the_controls_run_on_the_solver_and_pair_with_the_primary_over_facts(bench, monkeypatch, tmp_path):
    """A controlled unit evaluates its solver once more with one tool-hint round, majority of CONTROL_K and
    tool-gated resampling, and keeps each control's per-problem outcomes in problem-id order;
    control_lines contrasts the primary's Acc@final with each, paired seed by seed, resampling facts."""
    import json

    import numpy as np

    import tosca_mlmt.tasks.arith as arith
    from tosca_mlmt.analysis.stats import paired_bootstrap
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines import evaluate as ev

    ids = [p.id for p in arith.ArithTask(2).load("test", 30).problems]
    seen = []

    def fake_evaluate(cfg, out, **kw):  # writes what the real eval writes for the controls, rows out of order
        seen.append((cfg.episode.rounds, cfg.episode.feedback, kw))
        out.mkdir(parents=True)
        rows = [{"id": i, "majority_correct": k % 2 == 0, "resample_correct": k % 3 == 0} for k, i in enumerate(ids)]
        (out / "controls.json").write_text(json.dumps({"rows": rows[::-1]}))
        return types.SimpleNamespace(report={"resample_flagged": 7, "resample_used": 7, "resample_fixed": 2,
                                             "resample_broke": 1})

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    monkeypatch.setattr(ev, "eval_outcomes", lambda folder, texts=False: {"ids": ids, "final": [1] * 30})
    common, train = bench.run_overrides(sizes("tool"))
    preset, _ = bench.METHODS["single-turn-grpo"]
    c = bench.control_eval(load_config(preset, {**common, "task.split": "test"}), tmp_path / "ctl")
    assert seen == [(1, "tool", {"majority": bench.CONTROL_K, "resample": "tool"})]
    assert c["ids"] == ids and c["majority"] == [int(k % 2 == 0) for k in range(30)]
    assert c["resample"] == [int(k % 3 == 0) for k in range(30)] and c["tool_hint"] == [1] * 30
    assert c["resample_fixed"] == 2
    rng = np.random.default_rng(1)
    finals = {s: (rng.random(30) < 0.5).astype(float) for s in (0, 1)}
    per = {"mlmt": [{"seed": s, "ids": ids, "final": finals[s]} for s in (0, 1)],
           "single-turn-grpo": [{"seed": s, "ids": ids, "controls": c} for s in (0, 1, 2)]}
    lines = bench.control_lines(per, "mlmt")
    want = paired_bootstrap(np.stack([finals[0], finals[1]]), np.array([c["majority"]] * 2),
                            groups=np.array(arith.facts_of(ids)))
    row = next(x for x in lines if f"majority of {bench.CONTROL_K}" in x and x.startswith("| single-turn-grpo"))
    assert "| 3 x 30 |" in row and f"{want['mean']:+.3f} [{want['lo']:+.3f}, {want['hi']:+.3f}] (2 seeds)" in row
    assert sum(x.startswith("| single-turn-grpo") for x in lines) == 3
    assert bench.control_lines({"mlmt": per["mlmt"]}, "mlmt") == []


def test_a_unit_keeps_whether_the_check_flagged_each_first_attempt(bench, tmp_path):
    """tool_flags reads the tool report stored on each eval episode's feedback turn, in problem-id order (the
    order of t1/final), and gives None for an eval whose episodes have no report (no refine, or no tool)."""
    import json

    from tosca_mlmt.records import Episode, Turn
    from tosca_mlmt.store import write_snapshot
    from tosca_mlmt.tasks.base import Problem

    def episode(pid: str, flagged: bool | None) -> Episode:
        solve = Turn(0, 0, "solver", "solve", [1], [2], [-0.1], "stop", "7 + 10 = 18")
        turns = [solve]
        if flagged is not None:
            turns.append(Turn(1, 1, "writer", "feedback", [1], [2], [], "fixed", "Recheck 7 + 10.",
                              info={"tool_report": {"flagged": flagged}}))
        return Episode(f"e-{pid}", Problem("arith", pid, "What is 7 + 10?", "17", "test"), 0, turns)

    for name, flags in (("tool", [True, False, True]), ("none", [None, None, None])):
        eps = [episode(f"p{k}", f) for k, f in zip((2, 0, 1), flags)]  # stored out of id order
        sid, _ = write_snapshot(tmp_path / name / "snapshots", eps, {"task": {"name": "arith", "split": "test"}})
        (tmp_path / name / "eval.json").write_text(json.dumps({"snapshot_id": sid}))
    assert bench.tool_flags(tmp_path / "tool") == [0, 1, 1]  # p0 (False), p1 (True), p2 (True)
    assert bench.tool_flags(tmp_path / "none") is None


def test_the_tool_targets_are_judged_from_their_own_contrasts(summary):
    """Issue 66's targets on hand-made tool-grid units: the fix rate counts only flagged wrong first attempts,
    the control contrasts pair each writer with single-turn GRPO's controls of the same seed, the unseen target
    reads the test-unseen evals, and SCoRe is judged seed by seed (one seed below the untrained pair misses)."""
    import numpy as np

    import tosca_mlmt.tasks.arith as arith

    ids = [p.id for p in arith.ArithTask(2).load("test", 300).problems]
    n = len(ids)
    t1 = np.zeros(n)
    t1[:100] = 1
    flagged = np.zeros(n)
    flagged[100:200] = 1  # 100 flagged wrong attempts
    good, weak = t1.copy(), t1.copy()
    good[100:140] = 1  # fixes 40 of the flagged wrong ones
    good[0] = 0  # breaks 1 of 100 right ones
    weak[100:120] = 1  # fixes 20
    weak[200:260] = 1  # and 60 unflagged wrong ones: not counted as fixes
    zeros, low = np.zeros(n), np.zeros(n)
    low[:50] = 1

    def unit(seed, fin, **extra):
        return {"seed": seed, "t1": t1, "final": fin, "ids": ids, "used": {"rounds": 4}, "flagged": flagged, **extra}

    unseen = lambda fin: {"test-unseen": {"ids": ids, "final": list(fin)}}  # noqa: E731
    per = {"mlmt": [unit(s, good, evals=unseen(good)) for s in (0, 1)],
           "mlmt-tool-selector": [unit(s, weak, evals=unseen(zeros)) for s in (0, 1)],
           "untrained": [unit(s, low, evals=unseen(low)) for s in (0, 1)],
           "single-turn-grpo": [unit(s, low, controls={"ids": ids, "majority": list(low), "resample": list(good),
                                                       "tool_hint": list(low)}) for s in (0, 1)],
           "score": [unit(0, good), unit(1, zeros)]}
    data = {"tool": {"per": per, "methods": {m: summary.pooled(r) for m, r in per.items()}}}
    _, record = summary.targets(data)
    by = {t["target"]: (t["met_by"], t["missed_by"]) for t in record}
    assert by["tool: fixes ≥ 30 % of the flagged wrong attempts, breaks ≤ 2 % of right ones"] == (
        ["`mlmt`"], ["tool selector"])
    assert by["tool: above GRPO's majority of 3, CI > 0"] == (["`mlmt`", "tool selector"], [])
    # mlmt's answers are the control's exactly; the selector's 60 unflagged fixes outweigh its 20 fewer flagged ones
    assert by["tool: above GRPO's tool-gated resampling, CI > 0"] == (["tool selector"], ["`mlmt`"])
    assert by["tool: unseen phrasings, over the untrained pair, CI > 0"] == (["`mlmt`"], ["tool selector"])
    assert by["tool: SCoRe ≥ untrained in every seed"] == ([], ["SCoRe"])
    assert "tool: ≥ tool template" not in by  # no template units, no judgement
    # two seeds of the five issue 66 asks: every verdict stands "so far"; five make it final
    lines, _ = summary.targets(data)
    fix_line = next(x for x in lines if x.startswith("| tool: fixes"))
    assert fix_line.endswith("| met by `mlmt`; missed by tool selector so far (2 of the 5 seeds it asks) |")
    generic = {"tool: Δ ≥ 0 and c→i ≤ i→c", "tool: ≥ SCoRe"}  # every honest grid's, judged on what it has
    assert {(t["seeds"], t["final"]) for t in record if t["env"] == "tool" and t["target"] not in generic} == {(2, False)}
    five = {"mlmt": [unit(s, good) for s in range(5)]}
    lines, record = summary.targets({"tool": {"per": five, "methods": {"mlmt": summary.pooled(five["mlmt"])}}})
    fix = next(t for t in record if t["target"].startswith("tool: fixes"))
    assert (fix["met_by"], fix["seeds"], fix["final"]) == (["`mlmt`"], 5, True)
    assert next(x for x in lines if x.startswith("| tool: fixes")).endswith("| met |")


def test_the_sampled_refine_targets_are_gated_by_the_check(summary):
    """The sampled-refine eval is judged tool-gated: a flagged attempt's refine is final and an unflagged one
    stands, as GRPO's resample control keeps it, so breaks and fixes of unflagged attempts do not count; a unit
    from before that eval (no refine_sampled) is not judged on it."""
    import numpy as np

    import tosca_mlmt.tasks.arith as arith

    ids = [p.id for p in arith.ArithTask(2).load("test", 300).problems]
    n = len(ids)
    t1, flagged = np.zeros(n), np.zeros(n)
    t1[:100] = 1
    flagged[100:200] = 1
    mine, weak = np.zeros(n), np.zeros(n)
    mine[100:140] = 1  # fixes 40 of the 100 flagged wrong attempts
    mine[200:260] = 1  # and refines 60 unflagged wrong ones right, while it breaks every right one: gated away
    weak[100:110] = 1
    resample = t1.copy()
    resample[100:110] = 1  # the control fixes the same 10 flagged attempts the selector's refine fixes

    def unit(seed, sampled=None):
        u = {"seed": seed, "t1": t1, "final": t1, "ids": ids, "used": {"rounds": 4}, "flagged": flagged}
        if sampled is not None:
            u["refine_sampled"] = {"ids": ids, "t1": list(t1), "final": list(sampled), "flagged": list(flagged)}
        return u

    per = {"mlmt": [unit(s, mine) for s in (0, 1)], "mlmt-tool-selector": [unit(s, weak) for s in (0, 1)],
           "mlmt-tool-selector-refine-groups": [unit(s) for s in (0, 1)],
           "single-turn-grpo": [unit(s) | {"controls": {"ids": ids, "majority": list(t1), "resample": list(resample),
                                                        "tool_hint": list(t1)}} for s in (0, 1)]}
    data = {"tool": {"per": per, "methods": {m: summary.pooled(r) for m, r in per.items()}}}
    _, record = summary.targets(data)
    by = {t["target"]: (t["met_by"], t["missed_by"]) for t in record}
    assert by["tool, refine sampled, tool-gated: fixes ≥ 30 % of the flagged wrong attempts, breaks ≤ 2 % of "
              "right ones"] == (["`mlmt`"], ["tool selector"])
    assert by["tool, refine sampled, tool-gated: above GRPO's tool-gated resampling, CI > 0"] == (
        ["`mlmt`"], ["tool selector"])


def test_a_unit_whose_eval_has_the_check_also_evaluates_a_sampled_refine(bench, monkeypatch, tmp_path):
    """Where the check flagged first attempts (the tool grid), a unit evaluates its pair once more with the
    refine sampled (mlmt eval --refine sampled) on the same problems and keeps that eval's outcomes and flags
    beside its own; without flags (no check) it does not (the OOD test above: three evals, no kwargs)."""
    from tosca_mlmt.pipelines import evaluate as ev

    args = bench.parser().parse_args(["--env", "tool", "--ood-evals"])
    common, train = bench.run_overrides(args)
    seen = []

    def fake_evaluate(cfg, out, **kw):
        seen.append((out.name, cfg.task.split, kw))
        return types.SimpleNamespace(report={"environment": "honest:tool"})

    def fake_outcomes(folder, texts=False):
        final = [1, 1, 0] if folder.name == "eval-refine-sampled" else [0, 1, 0]
        return {"ids": ["a", "b", "c"], "t1": [0, 1, 0], "final": final,
                **({"t1_text": ["1"] * 3, "final_text": ["2"] * 3} if texts else {})}

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    monkeypatch.setattr(ev, "eval_outcomes", fake_outcomes)
    monkeypatch.setattr(bench, "tool_flags", lambda folder: [1, 0, 1])
    r = bench.run_method("untrained", bench.MLMT, None, common, train, {}, 0, tmp_path, "sha", None, {})
    assert seen == [("eval", "test", {}), ("eval-refine-sampled", "test", {"refine": "sampled"})]
    assert r["refine_sampled"] == {"ids": ["a", "b", "c"], "t1": [0.0, 1.0, 0.0], "final": [1.0, 1.0, 0.0],
                                   "flagged": [1, 0, 1]}
    assert r["flagged"] == [1, 0, 1] and list(r["final"]) == [0.0, 1.0, 0.0]


def test_demo_is_the_best_honest_method_at_the_demo_sizes(bench):
    """`make demo` runs tool-template-refine-groups-mb8 in the tool environment (issue 66, item 5):
    configs/demo.yaml is configs/demo-selector.yaml (the demo's sizes) with exactly that method's and
    environment's overrides, so the README's demo paragraph and the benchmark's units name one configuration."""
    from tosca_mlmt.config import load_config

    _, method = bench.TOOL_CONTROL["tool-template-refine-groups-mb8"]
    demo = load_config(ROOT / "configs" / "demo.yaml")
    assert demo == load_config(ROOT / "configs" / "demo-selector.yaml", {**bench.ENV_OVERRIDES["tool"], **method})
    assert demo.episode.writer_sees == "tool" and demo.joint.freeze_writer and demo.lower.refine_samples == 4
