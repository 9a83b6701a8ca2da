"""Does the writer's strategy change what the refine does? Per strategy, from one snapshot.

A writer can learn only what its decisions change. For each strategy this counts, among right
first attempts, the refines that broke them and, among wrong ones, the refines that fixed them,
with Wilson 95 % intervals, and tests whether the outcome depends on the strategy at all: a
permutation test of the chi-square statistic (strategies shuffled over the attempts, 10,000 draws).
A large p-value says the logged decisions carry no signal a Q-function could fit. It also counts
whether the writer's own text passes on the first attempt's correctness: each feedback is classed by
keywords as calling the attempt right ("correct", "right"), wrong ("incorrect", "wrong", "mistake",
"error") or neither, split by the attempt's real correctness; a fixed sentence (finish_reason
"fixed": episode.prefix_only, static or verdict feedback) is counted apart, as no writer text.
Where the snapshot was collected with episode.gold_prob, it also gives per strategy the mean rise of
the solver's gold-answer probability from attempt to refine, p_gold(y) - p_gold(z), on right and on
wrong attempts (the writer's reward under upper.reward=gold_prob, break penalty aside), with a 95 %
normal interval: a sentence can move that probability when it flips no greedy outcome.

    mlmt collect -c mlmt --task arith --level 2 --limit 160 --engine vllm --out /tmp/snaps \\
        --set episode.writer_sees=verdict --set episode.max_prompt_tokens=768 --set engine.vllm.max_model_len=1024
    python -m benchmarks.probes.strategy_effect --root /tmp/snaps --snapshot snap-... --label verdict-untrained-T0.7

Writes benchmarks/results/strategy_effect/<date>_<label>.json (VARIANT) (date, machine, load, the snapshot's id and
sampling) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
from collections import Counter, defaultdict

import numpy as np

from benchmarks.common import result_path  # noqa: E402

VARIANT = ("label",)


def chi2(table: np.ndarray) -> float:
    """Pearson's statistic of a [strategies, 2] count table (rows without attempts dropped)."""
    table = table[table.sum(1) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / max(table.sum(), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.nansum((table - expected) ** 2 / np.where(expected > 0, expected, np.nan)))


def permutation_p(actions: np.ndarray, outcomes: np.ndarray, n_actions: int, draws: int = 10_000,
                  seed: int = 0) -> float:
    """P(chi2 >= observed) when the strategies are shuffled over the attempts (outcome independent)."""
    if len(actions) == 0 or outcomes.min() == outcomes.max():
        return 1.0

    def stat(a):
        t = np.zeros((n_actions, 2))
        np.add.at(t, (a, outcomes.astype(int)), 1)
        return chi2(t)

    rng = np.random.default_rng(seed)
    obs = stat(actions)
    hits = sum(stat(rng.permutation(actions)) >= obs - 1e-12 for _ in range(draws))
    return (hits + 1) / (draws + 1)


NEGATIVE = re.compile(r"\b(incorrect|not correct|wrong|mistakes?|errors?)\b", re.I)
POSITIVE = re.compile(r"\b(correct|right)\b", re.I)


def text_says(text: str) -> str:
    """'wrong', 'right' or 'neither': what a feedback text calls the attempt (keywords; 'wrong' wins)."""
    if NEGATIVE.search(text):
        return "wrong"
    return "right" if POSITIVE.search(text) else "neither"


def mean_ci(xs: list[float]) -> tuple[float, float, float, int]:
    """(mean, low, high, n): a normal 95 % interval of the mean (a single value: zero width)."""
    a = np.asarray(xs, dtype=float)
    half = 1.96 * a.std(ddof=1) / np.sqrt(len(a)) if len(a) > 1 else 0.0
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half), len(a)


def main() -> None:
    from tosca_mlmt.analysis.stats import wilson
    from tosca_mlmt.store import open_snapshot

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="folder searched for the snapshot")
    ap.add_argument("--snapshot", required=True, help="snapshot id or unique prefix")
    ap.add_argument("--label", required=True, help="names the result file")
    ap.add_argument("--draws", type=int, default=10_000)
    args = ap.parse_args()
    snap = open_snapshot(args.root, args.snapshot)
    names: list[str] = []
    rows = defaultdict(lambda: {"right": 0, "broken": 0, "wrong": 0, "fixed": 0})
    says = Counter()
    acts = {"right": [], "wrong": []}
    outs = {"right": [], "wrong": []}
    rises = defaultdict(list)  # (strategy, attempt kind) -> p_gold(y) - p_gold(z), when logged
    for ep in snap.episodes():
        z, y = ep.solver_turns[0], ep.solver_turns[1] if len(ep.solver_turns) > 1 else None
        fb = next((t for t in ep.turns if t.kind == "feedback"), None)
        if y is None or fb is None:
            continue
        if fb.strategy_name not in names:
            names.append(fb.strategy_name)
        r = rows[fb.strategy_name]
        kind = "right" if z.correct else "wrong"
        # a fixed sentence (episode.prefix_only, static/verdict feedback) is no writer text to judge
        says[(kind, "fixed_sentence" if fb.finish_reason == "fixed" else text_says(fb.text))] += 1
        changed = (not y.correct) if z.correct else bool(y.correct)
        r[kind] += 1
        r["broken" if z.correct else "fixed"] += int(changed)
        acts[kind].append(names.index(fb.strategy_name))
        outs[kind].append(int(changed))
        if "gold_prob" in (z.info or {}) and "gold_prob" in (y.info or {}):
            rises[(fb.strategy_name, kind)].append(y.info["gold_prob"] - z.info["gold_prob"])
    table = {}
    for name in sorted(rows):
        r = rows[name]
        table[name] = {**r, "break_rate": r["broken"] / r["right"] if r["right"] else None,
                       "break_ci": wilson(r["broken"], r["right"]) if r["right"] else None,
                       "fix_rate": r["fixed"] / r["wrong"] if r["wrong"] else None,
                       "fix_ci": wilson(r["fixed"], r["wrong"]) if r["wrong"] else None,
                       **{f"gold_prob_rise_{k}": mean_ci(rises[(name, k)]) for k in ("right", "wrong")
                          if rises[(name, k)]}}
    tests = {f"{k}_outcome_depends_on_strategy_p": permutation_p(np.array(acts[k], dtype=int),
                                                                 np.array(outs[k]), len(names), args.draws)
             for k in ("right", "wrong")}
    m = snap.manifest
    report = {"benchmark": "strategy_effect", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_avg": os.getloadavg(),
              "snapshot": snap.id, "label": args.label, "sampling": m.get("sampling"),
              "environment": (m.get("summary") or {}).get("environment"), "episodes": sum(
                  r["right"] + r["wrong"] for r in rows.values()), "per_strategy": table, **tests,
              "permutation_draws": args.draws,
              "feedback_text_says": {f"attempt_{k}": {w: says[(k, w)] for w in ("right", "wrong", "neither",
                                                                                    "fixed_sentence")}
                                     for k in ("right", "wrong")}}
    out = result_path("strategy_effect", VARIANT, label=args.label)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"{'strategy':<22}{'right':>6}{'broken':>8}  {'break rate [95% CI]':<22}{'wrong':>6}{'fixed':>7}  fix rate [95% CI]")
    for name, r in table.items():
        b = f"{r['break_rate']:.2f} [{r['break_ci'][0]:.2f}, {r['break_ci'][1]:.2f}]" if r["right"] else "-"
        f = f"{r['fix_rate']:.2f} [{r['fix_ci'][0]:.2f}, {r['fix_ci'][1]:.2f}]" if r["wrong"] else "-"
        print(f"{name:<22}{r['right']:>6}{r['broken']:>8}  {b:<22}{r['wrong']:>6}{r['fixed']:>7}  {f}")
    print(", ".join(f"{k} {v:.3g}" for k, v in tests.items()))
    for name, r in table.items():
        for k in ("right", "wrong"):
            if f"gold_prob_rise_{k}" in r:
                m, lo, hi, n = r[f"gold_prob_rise_{k}"]
                print(f"{name}: p_gold rise on {k} attempts {m:+.3f} [{lo:+.3f}, {hi:+.3f}] (n {n})")
    for k, v in report["feedback_text_says"].items():
        print(f"feedback text on {k.split('_')[1]} attempts: " + ", ".join(f"says {w} {n}" for w, n in v.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
