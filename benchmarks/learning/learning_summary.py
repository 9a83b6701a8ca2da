"""The learning benchmark across environments: the results page's tables, computed from the stored units.

One table holds each environment's headline methods (pooled over their seeds x problems, paired
bootstrap 95 % intervals, and beside them the interval that resamples arith's facts instead of its
problems, with the number of facts: fact_groups) and one holds issue 13's targets ("CI > 0" judged by
the interval over facts: lower), each with the contrasts that decide it and
whether it is met. Both come from the units under benchmarks/results/learning_efficacy/<env>-L2/ (and the
later code's grids, <env>-L2-<tag>/, as sections of their own: SECTIONS) at the
benchmark's default sizes and eval rule (learning_efficacy.Units: a unit counts for a method only under
its configuration's hash), so a new unit changes them and nothing is copied by hand.

    python -m benchmarks.learning.learning_summary   # writes results/learning_summary/<date>_default.{md,json}
    python docs/gen/build.py                         # puts them on docs/results/index.md

summarise() is the library's entry: (the tables' lines, their record), from the stored units alone.

tests/properties/test_benchmark_methods.py checks that the results page's tables equal what the stored units give.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform

import numpy as np

from benchmarks.common import result_path
from benchmarks.learning import learning_efficacy as le

VARIANT = ()  # one summary of every stored grid: no variant (<date>_default)

ENVS = {"verdict": "verdict (privileged)", "confidence": "confidence (honest)", "none": "none (honest)",
        "tool": "tool (honest:tool, fp32)"}
# section -> (env, grid tag, label): the stored grids of each env, then grids of later code kept apart by
# --tag (their units ran on other code: pooled with the older ones they would mix two programs)
SECTIONS = {**{env: (env, "", label) for env, label in ENVS.items()},
            "confidence-fixes": ("confidence", "fixes", "confidence (honest), grid confidence-L2-fixes: the fixes of 2026-11-29"),
            "none-v4": ("none", "v4", "none (honest), grid none-L2-v4: verifier v4 on"),
            "tool-steps4x": ("tool", "steps4x", "tool (honest:tool, fp32), grid tool-L2-steps4x: 4x the PPO iterations "
                                                "(8 a round, 64 solver steps)")}
# a grid measured at other sizes than the benchmark's defaults: the options it ran with (they key its units)
GRID_ARGS = {"steps4x": ["--lower-iterations", "8"]}
# (method, label) per environment, in the table's order; the writers are the rows the targets judge
# (score-kl-reward and single-turn-grpo-no-kl: the baselines' units from before one KL setting for every method;
# the targets judge against score, the baseline as its paper specifies it)
CONTROLS = [("untrained", "untrained"), ("score", "SCoRe"),
            ("score-kl-reward", "SCoRe, KL as a reward under std normalisation (as first measured)"),
            ("single-turn-grpo", "single-turn GRPO"), ("single-turn-grpo-no-kl", "single-turn GRPO, β = 0 (as first measured)")]
WRITERS = {"verdict": [("mlmt", "`mlmt`"), ("mlmt-sentences-only", "selector"),
                       ("mlmt-verdict-sentences", "verdict selector"),
                       ("mlmt-verdict-sentences-gold-prob", "verdict selector on p_gold"),
                       ("mlmt-verdict-sentences-sampled-refines", "verdict selector on sampled refines")],
           "confidence": [("mlmt", "`mlmt`"), ("mlmt-sentences-only", "selector")],
           "none": [("mlmt", "`mlmt`"), ("mlmt-sentences-only", "selector")],
           "tool": [("mlmt", "`mlmt`"), ("mlmt-tool-selector", "tool selector"),
                    ("mlmt-tool-selector-refine-groups", "tool selector, refine groups, sampled collect refines")]}
# the compute ladder (--ladder): single-turn GRPO given 2x-8x the PPO iterations, so a method that costs more
# wall time or optimizer steps is also compared with GRPO given as much
LADDER_ROWS = [(f"single-turn-grpo-x{k}", f"single-turn GRPO, {k}× the PPO iterations (compute ladder)")
               for k in le.LADDER]
VERDICT_ONLY = [("verdict-template", "verdict template (control)"),
                ("solver-only-verdict-sentences", "random verdict sentences, frozen writer")]
TOOL_ONLY = [("tool-template", "tool template (control)"),
             ("tool-template-refine-groups", "tool template, 4 refines per attempt (refine groups)"),
             ("tool-template-refine-groups-mb8", "tool template, refine groups, 4× the optimizer steps"),
             ("tool-template-mb2", "tool template, 4× the optimizer steps (minibatches of 2)"),
             ("mlmt-masked-refine", "`mlmt`, refines out of the loss"),
             ("mlmt-tool-selector-writer-only", "tool selector writer-only (solver frozen)")]
# the ablations of `mlmt` (shown once measured; not judged by the targets)
ABLATIONS = [("mlmt-no-bonus", "`mlmt` without the bonus"), ("writer-only", "`mlmt` writer-only (solver frozen)"),
             ("solver-only", "`mlmt` solver-only (writer frozen)")]


def _short(section: str) -> str:
    env, tag, _ = SECTIONS[section]
    return f"{env} (grid {env}-L2-{tag})" if tag else env


def rows(env: str) -> list[tuple[str, str]]:
    return CONTROLS + LADDER_ROWS + {"verdict": VERDICT_ONLY, "tool": TOOL_ONLY}.get(env, []) + ABLATIONS + WRITERS[env]


def env_units(env: str, tag: str = "") -> tuple[dict[str, list[dict]], dict[str, bool]]:
    """(method -> its units at the default sizes and eval rule in grid ``tag``, method -> whether it has
    a refine turn)."""
    # every grid here ran where bf16 is native: its units are found as resolved there, on any machine
    args = le.parser().parse_args(["--env", env, "--native-bf16", "yes", "--ladder"] + (["--tag", tag] if tag else [])
                                  + GRID_ARGS.get(tag, []))
    per, _, _ = le.Units(args).per_method()
    common, train = le.run_overrides(args)
    every = dict(le.METHODS, **le.VERDICT_CONTROL, **le.TOOL_CONTROL, **le.ladder(args.lower_iterations))
    refines = {m: le.method_config(every[m][0], {**common, **train, **(every[m][1] or {})}).episode.rounds > 0
               for m, _ in rows(env)}
    return per, refines


def fact_groups(runs: list[dict]) -> np.ndarray | None:
    """Each test problem's arith fact (the units' problems, by id), or None when the units keep no ids.

    arith's test set asks few distinct facts (level 2: about 35) in many phrasings, and a method that
    gets a fact right mostly gets all its phrasings right: resampling problems treats phrasings as
    independent draws and overstates certainty, resampling facts does not (the "by fact" intervals)."""
    from tosca_mlmt.tasks.arith import facts_of

    ids = le.problem_ids(runs, "units")
    return None if ids is None else np.array(facts_of(ids))


def pooled(runs: list[dict]) -> dict:
    from tosca_mlmt.analysis.stats import paired_bootstrap

    t1, fin = np.stack([r["t1"] for r in runs]), np.stack([r["final"] for r in runs])
    facts = fact_groups(runs)
    return {"seeds": [r["seed"] for r in runs], "problems": int(t1.shape[1]), "trained": runs[0]["used"] != {},
            "acc_t1": float(t1.mean()), "acc_final": paired_bootstrap(fin), "delta": float((fin - t1).mean()),
            "acc_final_by_fact": None if facts is None else paired_bootstrap(fin, groups=facts),
            "right_to_wrong": float((t1 * (1 - fin)).mean()), "wrong_to_right": float(((1 - t1) * fin).mean())}


def contrast(per: dict[str, list[dict]], a: str, b: str) -> dict | None:
    """Acc@final of a minus b, paired over the seeds both have x problems; ``by_fact``: the interval with
    whole facts resampled (None without problem ids)."""
    from tosca_mlmt.analysis.stats import paired_bootstrap

    common, fa, fb = le.paired_finals(per, a, b)
    if not common:
        return None
    runs = [r for m in (a, b) for r in per[m] if r["seed"] in common]
    facts = fact_groups(runs)
    return {**paired_bootstrap(fa, fb), "seeds": common,
            "by_fact": None if facts is None else paired_bootstrap(fa, fb, groups=facts)}


def lower(d: dict) -> float:
    """The lower end a "CI > 0" target is judged by: the by-fact interval's where the units have one (the
    per-problem interval overstates certainty when phrasings of one fact share their outcome)."""
    return (d.get("by_fact") or d)["lo"]


def _num(x: float, sign: str = "") -> str:
    return f"{x:{sign}.3f}".replace("-", "\u2212")  # a typographic minus sign


def _ci(d: dict, sign: str = "") -> str:
    return f"{_num(d['mean'], sign)} [{_num(d['lo'], sign)}, {_num(d['hi'], sign)}]"


def _by_fact(d: dict | None, sign: str = "") -> str:
    """A by-fact interval and its number of facts: [lo, hi] over G facts."""
    return "—" if d is None else f"[{_num(d['lo'], sign)}, {_num(d['hi'], sign)}] over {d['clusters']} facts"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def method_table(data: dict) -> list[str]:
    lines = ["| env | method | seeds × problems | Acc@t1 | Acc@final [95 % CI] | 95 % CI by fact | Δ | "
             "c→i / i→c (of all problems) |", "|---|---|---|---|---|---|---|---|"]
    for section, (env, _, label) in SECTIONS.items():
        if section not in data or not data[section]["methods"]:
            continue
        cells = data[section]["methods"]
        best = max(c["acc_final"]["mean"] for c in cells.values())
        best_writer = max((cells[m]["acc_final"]["mean"] for m, _ in WRITERS[env] if m in cells), default=None)
        first = True
        for m, name in rows(env):
            if m not in cells:
                continue
            c = cells[m]
            fin = _ci(c["acc_final"])
            if c["acc_final"]["mean"] in (best, best_writer):
                fin = f"**{fin}**"
            size = f"{len(c['seeds'])} × {c['problems']}" if c["trained"] else "one unit"
            flips = (f"{_pct(c['right_to_wrong'])} / {_pct(c['wrong_to_right'])}" if data[section]["refines"][m] else "—")
            delta = _num(c["delta"], "+") if data[section]["refines"][m] else "0"
            lines.append(f"| {label if first else ''} | {name} | {size} | {c['acc_t1']:.3f} | {fin} | "
                         f"{_by_fact(c.get('acc_final_by_fact'))} | {delta} | {flips} |")
            first = False
    return lines


def _judge(results: dict[str, bool]) -> str:
    met = [name for name, ok in results.items() if ok]
    if not met:
        return "**missed** by all" if len(results) > 1 else "**missed**"
    if len(met) == len(results):
        return "met" + (" by all" if len(results) > 1 else "")
    return "met by " + ", ".join(met) + "; missed by " + ", ".join(n for n, ok in results.items() if not ok)


def targets(data: dict) -> tuple[list[str], list[dict]]:
    """Issue 13's targets, each judged per writer method from the contrasts that define it."""
    lines = ["| target (issue #13) | measured | verdict |", "|---|---|---|"]
    record = []

    def add(target: str, section: str, measure, ok, context=(), judged=None, min_seeds: int = 1) -> None:
        """``min_seeds``: the seeds a target is judged on; with fewer, the verdict is said to be provisional."""
        if section not in data:
            return
        per, cells = data[section]["per"], data[section]["methods"]
        shown, results, seeds = [], {}, []
        for m, name in judged or WRITERS[SECTIONS[section][0]]:
            v = measure(per, cells, m)
            if v is None:
                continue
            shown.append(f"{name} {v[0]}")
            results[name] = ok(v[1])
            seeds.append(len(per[m]))
        for m, name in context:
            v = measure(per, cells, m)
            if v is not None:
                shown.append(f"{name} {v[0]} (control)")
        if results:
            final = min(seeds) >= min_seeds
            so_far = "" if final else f" so far ({min(seeds)} of the {min_seeds} seeds it asks)"
            lines.append(f"| {target} | " + "; ".join(shown) + f" | {_judge(results)}{so_far} |")
            record.append({"target": target, "env": section, "met_by": [n for n, k in results.items() if k],
                           "missed_by": [n for n, k in results.items() if not k], "seeds": min(seeds), "final": final})

    def versus(base: str, seeds: bool = False):
        def measure(per, cells, m):
            d = contrast(per, m, base)
            if d is None:
                return None
            where = f" (seeds {', '.join(map(str, d['seeds']))})" if seeds else ""
            fact = f", by fact {_by_fact(d['by_fact'], '+')}" if d.get("by_fact") else ""
            return _ci(d, "+") + fact + where, d
        return measure

    def flips(per, cells, m):
        c = cells.get(m)
        return None if c is None else (f"Δ {_num(c['delta'], '+')}, {_pct(c['right_to_wrong'])} / "
                                       f"{_pct(c['wrong_to_right'])}", c)

    def broken(per, cells, m):
        c = cells.get(m)
        return None if c is None else (_pct(c["right_to_wrong"]), c)

    controls = [("verdict-template", "template"), ("single-turn-grpo", "single-turn GRPO")]
    add("verdict: Acc@final ≥ untrained + 0.30, CI > 0", "verdict", versus("untrained"),
        lambda d: d["mean"] >= 0.30 and lower(d) > 0, controls)
    add("verdict: ≥ SCoRe + 0.10, CI > 0", "verdict", versus("score", seeds=True),
        lambda d: d["mean"] >= 0.10 and lower(d) > 0)
    add("verdict: ≥ template − 0.02", "verdict", versus("verdict-template"), lambda d: d["mean"] >= -0.02)
    add("verdict: c→i ≤ 3 %", "verdict", broken, lambda c: c["right_to_wrong"] <= 0.03)
    # every section of the honest envs, each env's grids together
    honest = [section for e in ENVS if e != "verdict" for section, (env, _, _) in SECTIONS.items() if env == e]
    for section in honest:
        add(f"{_short(section)}: Δ ≥ 0 and c→i ≤ i→c", section, flips,
            lambda c: c["delta"] >= 0 and c["right_to_wrong"] <= c["wrong_to_right"])
    for section in honest:
        add(f"{_short(section)}: ≥ SCoRe", section, versus("score", seeds=True), lambda d: d["mean"] >= 0)
    tool_targets(add, versus)
    return lines, record


TOOL_SEEDS = 5  # issue 66 judges its targets on >= 5 seeds x >= 300 problems


def tool_targets(add, versus) -> None:
    """Issue 66's targets in the tool environment (honest:tool), each from the contrasts that define it;
    on fewer than TOOL_SEEDS seeds a verdict is marked as standing so far."""
    add = functools.partial(add, min_seeds=TOOL_SEEDS)
    def fixes(per, cells, m):
        got = [r for r in per.get(m, []) if r.get("flagged") is not None]
        if not got:
            return None
        t1, fin, flag = (np.concatenate([np.asarray(r[k], dtype=float) for r in got]) for k in ("t1", "final", "flagged"))
        wrong = flag * (1 - t1)
        d = {"fixed": float((wrong * fin).sum() / max(wrong.sum(), 1)), "broke": float((t1 * (1 - fin)).sum() / max(t1.sum(), 1))}
        return (f"fixes {_pct(d['fixed'])} of {int(wrong.sum())} flagged wrong, breaks {_pct(d['broke'])} of "
                f"{int(t1.sum())} right ({len(got)} seed{'s' if len(got) > 1 else ''})"), d

    def versus_control(key: str):
        def measure(per, cells, m):
            ctl = [{"seed": r["seed"], "final": np.asarray(r["controls"][key], dtype=float), "ids": r["controls"]["ids"]}
                   for r in per.get("single-turn-grpo", []) if r.get("controls")]
            return versus("control")({**per, "control": ctl}, cells, m) if ctl and m in per else None
        return measure

    def sampled_gated(measure):
        """``measure`` on the units' sampled-refine eval, tool-gated: a flagged attempt's refine is final, an
        unflagged attempt stands (as the resample control keeps it); None for units from before that eval."""
        def on(per, cells, m):
            got = []
            for r in per.get(m, []):
                if (s := r.get("refine_sampled")) is None:
                    continue
                t1, flag = np.asarray(s["t1"], dtype=float), np.asarray(s["flagged"], dtype=float)
                got.append({**r, "ids": s["ids"], "t1": t1, "flagged": flag,
                            "final": np.where(flag == 1, np.asarray(s["final"], dtype=float), t1)})
            return measure({**per, m: got}, cells, m) if got else None
        return on

    def on_unseen(base: str):
        def measure(per, cells, m):
            unseen = {k: [{"seed": r["seed"], "final": np.asarray(r["evals"]["test-unseen"]["final"], dtype=float),
                           "ids": r["evals"]["test-unseen"]["ids"]} for r in per.get(k, [])
                          if "test-unseen" in (r.get("evals") or {})] for k in (m, base)}
            return versus(base)(unseen, cells, m) if all(unseen.values()) else None
        return measure

    def every_seed(per, cells, m):
        common, a, b = le.paired_finals(per, m, "untrained")
        if not common:
            return None
        d = a.mean(1) - b.mean(1)
        return ", ".join(f"seed {s} {_num(x, '+')}" for s, x in zip(common, d)), d

    templates = [("tool-template", "template"), ("tool-template-refine-groups", "template, refine groups"),
                 ("tool-template-refine-groups-mb8", "template, refine groups, 4× steps"),
                 ("tool-template-mb2", "template, 4× steps")]
    add("tool: fixes ≥ 30 % of the flagged wrong attempts, breaks ≤ 2 % of right ones", "tool", fixes,
        lambda d: d["fixed"] >= 0.30 and d["broke"] <= 0.02, templates)
    # the same two targets with the refine sampled as the resample control samples (mlmt eval --refine sampled)
    # and gated as it is gated: the method and the control then differ by the feedback alone
    add("tool, refine sampled, tool-gated: fixes ≥ 30 % of the flagged wrong attempts, breaks ≤ 2 % of right ones",
        "tool", sampled_gated(fixes), lambda d: d["fixed"] >= 0.30 and d["broke"] <= 0.02, templates)
    add("tool, refine sampled, tool-gated: above GRPO's tool-gated resampling, CI > 0", "tool",
        sampled_gated(versus_control("resample")), lambda d: lower(d) > 0, templates)
    add("tool: ≥ single-turn GRPO + 0.05, CI > 0", "tool", versus("single-turn-grpo", seeds=True),
        lambda d: d["mean"] >= 0.05 and lower(d) > 0)
    for key, name in (("resample", "tool-gated resampling"), ("majority", f"majority of {le.CONTROL_K}")):
        add(f"tool: above GRPO's {name}, CI > 0", "tool", versus_control(key), lambda d: lower(d) > 0)
    add("tool: ≥ tool template", "tool", versus("tool-template", seeds=True), lambda d: d["mean"] >= 0)
    add("tool: writer-only over the untrained pair, CI > 0", "tool", versus("untrained"), lambda d: lower(d) > 0,
        judged=[("writer-only", "writer-only"), ("mlmt-tool-selector-writer-only", "tool selector writer-only")])
    add("tool: unseen phrasings, over the untrained pair, CI > 0", "tool", on_unseen("untrained"),
        lambda d: lower(d) > 0)
    add("tool: SCoRe ≥ untrained in every seed", "tool", every_seed, lambda d: bool((d >= 0).all()),
        judged=[("score", "SCoRe")])


def summarise() -> tuple[list[str], dict]:
    data = {}
    for section, (env, tag, _) in SECTIONS.items():
        per, refines = env_units(env, tag)
        cells = {m: pooled(per[m]) for m, _ in rows(env) if m in per}
        data[section] = {"per": per, "refines": refines, "methods": cells}
    target_lines, record = targets(data)
    lines = method_table(data) + [""] + target_lines
    for section, d in data.items():  # units that also ran the OOD evals (--ood-evals): each grid's table
        ood = le.ood_lines({m: d["per"][m] for m, _ in rows(SECTIONS[section][0]) if m in d["per"]})
        lines += [f"OOD evals of {_short(section)}:" if x.startswith("Out-of-distribution") else x for x in ood]
    out = {section: {"env": SECTIONS[section][0], "grid_tag": SECTIONS[section][1], "methods": d["methods"],
                     "code": sorted({r["git_sha"] for m, _ in rows(SECTIONS[section][0]) for r in d["per"].get(m, [])})}
           for section, d in data.items()}
    return lines, {"tables": out, "targets": record}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    lines, record = summarise()
    body = "\n".join(lines) + "\n"
    out = result_path("learning_summary", VARIANT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(body)
    out.write_text(json.dumps({
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": f"{platform.machine()} {os.cpu_count()}",
        "load_avg": os.getloadavg(), **record}, indent=1, default=float))
    print(body)


if __name__ == "__main__":
    main()
