"""One method's learning units on two grids (e.g. the same protocol on two versions of the code): each
grid's pooled numbers, and grid A minus grid B on each, with two-level bootstrap intervals.

A grid is a folder under benchmarks/results/learning_efficacy/ (`<env>-L<level>[-<tag>]`, written by
learning/learning_efficacy.py). Units pair by seed number and, within a seed, by test problem: the problems are
the same 300 on every grid, while a seed on two codes is two independent trainings, so an interval
drawn over seeds says how much of a difference training noise could make. Units of one method on
one grid must share their config hash (or pass --config-a / --config-b to pick one).

    python -m benchmarks.learning.compare_grids --method mlmt --grids confidence-L2-fixes confidence-L2 \\
        --results mlmt-fixes

With --results LABEL, writes benchmarks/results/compare_grids/<date>_<method>_<A>-vs-<B>_<LABEL>.json (VARIANT) with the date, machine, the units' git shas and loads, and prints
a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform

import numpy as np

from tosca_mlmt.analysis.stats import mcnemar, paired_bootstrap

from benchmarks.common import RESULTS, label, result_path

UNITS = RESULTS / "learning_efficacy"
VARIANT = ("method", "grids", "label")

# per-problem outcomes of a unit [problems] -> the measure's per-problem values
MEASURES = {
    "acc_t1": lambda t1, fin: t1,
    "acc_final": lambda t1, fin: fin,
    "delta": lambda t1, fin: fin - t1,
    "right_to_wrong": lambda t1, fin: t1 * (1 - fin),
    "wrong_to_right": lambda t1, fin: (1 - t1) * fin,
}


def grid_units(grid: str, method: str, config: str | None = None) -> dict[int, dict]:
    """{seed: unit} of ``method`` in ``grid`` (one config hash)."""
    folder = UNITS / grid
    if not folder.is_dir():
        raise SystemExit(f"no grid {folder}")
    units = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{method}-seed*-*.json"))
             if not p.stem.endswith("-greedy-eval")]
    units = [u for u in units if u["method"] == method and (config is None or u["config"].startswith(config))]
    configs = sorted({u["config"] for u in units})
    if len(configs) > 1:
        raise SystemExit(f"{grid}: units of {method} under several configs {configs}; pick one with --config-a/-b")
    if not units:
        raise SystemExit(f"{grid}: no units of {method}")
    return {u["seed"]: u for u in sorted(units, key=lambda u: u["seed"])}


def outcomes(units: dict[int, dict], seeds: list[int], ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(t1, final) [seeds, problems] in the order of ``ids``."""
    t1, fin = [], []
    for s in seeds:
        u = units[s]
        pos = {pid: i for i, pid in enumerate(u["ids"])}
        t1.append([u["t1"][pos[p]] for p in ids])
        fin.append([u["final"][pos[p]] for p in ids])
    return np.array(t1, dtype=float), np.array(fin, dtype=float)


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Each grid's pooled measures over all its seeds, and A minus B over the seeds both have."""
    ids = sorted(set.intersection(*(set(u["ids"]) for u in [*a.values(), *b.values()])))
    out: dict = {"problems": len(ids), "grids": {}}
    for name, units in (("a", a), ("b", b)):
        seeds = sorted(units)
        t1, fin = outcomes(units, seeds, ids)
        out["grids"][name] = {"seeds": seeds, **{k: paired_bootstrap(f(t1, fin)) for k, f in MEASURES.items()},
                              "per_seed_acc_final": [float(x) for x in fin.mean(1)],
                              "per_seed_delta": [float(x) for x in (fin - t1).mean(1)]}
    both = sorted(set(a) & set(b))
    if both:
        ta, fa = outcomes(a, both, ids)
        tb, fb = outcomes(b, both, ids)
        out["a_minus_b"] = {"seeds": both, **{k: paired_bootstrap(f(ta, fa), f(tb, fb)) for k, f in MEASURES.items()},
                            "mcnemar_acc_final_per_seed": [mcnemar(fa[i], fb[i])["p"] for i in range(len(both))]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", required=True, help="the benchmark's method name, e.g. mlmt")
    ap.add_argument("--grids", nargs=2, required=True, metavar=("A", "B"),
                    help="two folders under benchmarks/results/learning_efficacy/")
    ap.add_argument("--config-a", default=None, help="config hash (or its start) of grid A's units, when it holds several")
    ap.add_argument("--config-b", default=None)
    ap.add_argument("--results", default=None, help="write the record, this label last in its variant (results/compare_grids/<date>_<method>_<A>-vs-<B>_<label>.json; "
                         "an old-style file name is taken as the label; default: print only)")
    args = ap.parse_args()
    a = grid_units(args.grids[0], args.method, args.config_a)
    b = grid_units(args.grids[1], args.method, args.config_b)
    res = compare(a, b)

    def line(d: dict) -> str:
        return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"

    print(f"{args.method}: A = {args.grids[0]} (seeds {res['grids']['a']['seeds']}), "
          f"B = {args.grids[1]} (seeds {res['grids']['b']['seeds']}), {res['problems']} problems")
    for k in MEASURES:
        row = f"  {k:15s} A {line(res['grids']['a'][k])}  B {line(res['grids']['b'][k])}"
        if "a_minus_b" in res:
            row += f"  A-B {line(res['a_minus_b'][k])}"
        print(row)
    if args.results:
        record = {"benchmark": "compare_grids", "date": dt.datetime.now().isoformat(timespec="seconds"),
                  "machine": {"platform": platform.platform(), "processor": platform.processor(),
                              "cores": os.cpu_count()},
                  "method": args.method, "grid_a": args.grids[0], "grid_b": args.grids[1],
                  "units": {g: {s: {"git_sha": u["git_sha"], "config": u["config"], "date": u["date"],
                                    "load_avg": u.get("load_avg")} for s, u in units.items()}
                            for g, units in ((args.grids[0], a), (args.grids[1], b))},
                  **res}
        path = result_path("compare_grids", VARIANT, method=args.method, grids=f"{args.grids[0]}-vs-{args.grids[1]}",
                           label=label(args.results, "compare"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
