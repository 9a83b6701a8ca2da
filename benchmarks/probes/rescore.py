"""Score stored episodes again with the verifier this code has: how far does a verifier change move
numbers already measured?

Each snapshot's solver turns are re-verified from their stored text (the task and its settings from
the snapshot's own config, the text read as the runner reads it: after any reasoning tags), and set
against the verdicts stored when they were collected. Per snapshot: Acc@t1 and Acc@final stored and
again, and every turn whose verdict moved, with its text. Snapshots are grouped by label
(``LABEL=FOLDER``, a label repeated once per seed); per label, the pooled accuracies and the
rescored-minus-stored difference with a paired-bootstrap 95 % interval over snapshots x problems
(greedy evals: one episode per problem). No model is loaded; seconds per snapshot.

    python -m benchmarks.probes.rescore before=/tmp/demo/seed0/eval-before/snapshots/snap-... \\
        after=/tmp/demo/seed0/eval/snapshots/snap-... --results demo

A FOLDER may also be a learning unit (benchmarks/results/learning_efficacy/<grid>/<unit>.json) that kept
its eval answers' ends (``answers``, learning_efficacy.answer_tails): its arith test problems are
generated again from their ids, so a unit whose eval snapshot is gone can still be scored again.

Writes benchmarks/results/rescore/<date>_<label>.json (VARIANT: the --results label) with date, machine, the verifier versions (stored and now) and
the per-snapshot and per-label numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common import label as result_label, result_path  # noqa: E402

VARIANT = ("label",)


def rescore(folder: Path) -> dict:
    """One snapshot: per episode (stored, again) for turn 1 and the final turn, and the moved turns."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.rollout.engines.stop import final_text
    from tosca_mlmt.store import load_snapshot
    from tosca_mlmt.tasks import make_task

    snap = load_snapshot(folder.parent, folder.name)
    conf = snap.manifest["config"]
    cfg = load_config(overrides={"task": conf["task"], "episode.reasoning_tags":
                                 conf.get("episode", {}).get("reasoning_tags", [])})
    task = make_task(cfg.task)
    tags = cfg.episode.reasoning_tags
    rows, moved = [], []
    for ep in snap.episodes():
        turns = ep.solver_turns
        pair = []
        for t in (turns[0], turns[-1]):
            v = task.verify(ep.problem, final_text(t.text, tags))
            pair.append((bool(t.correct), bool(v.correct)))
            if bool(v.correct) != bool(t.correct) and not (t is turns[-1] and len(turns) == 1):
                moved.append({"episode": ep.episode_id, "turn": t.kind, "gold": ep.problem.answer,
                              "stored": [t.extracted, bool(t.correct)], "now": [v.extracted, bool(v.correct)],
                              "text_end": t.text[-80:]})
        rows.append(pair)
    return _result(snap.id, folder, rows, moved, snap.manifest["task"].get("verifier_version"), task.verifier_version)


def _result(name: str, folder: Path, rows: list, moved: list[dict], stored: str | None, now: str) -> dict:
    """What rescore and rescore_unit give for one snapshot or unit: rows [episodes] of ((stored, now) for
    turn 1, the same for the final turn)."""
    a = np.array(rows, dtype=float)  # [episodes, (t1, final), (stored, now)]
    return {"snapshot": name, "folder": str(folder), "episodes": len(rows),
            "verifier_stored": stored, "verifier_now": now,
            "acc_t1": {"stored": a[:, 0, 0].mean(), "now": a[:, 0, 1].mean()},
            "acc_final": {"stored": a[:, 1, 0].mean(), "now": a[:, 1, 1].mean()},
            "turns_moved": len(moved), "moved": moved, "_outcomes": a}


def rescore_unit(path: Path) -> dict:
    """One learning unit (a JSON with ``answers``), as rescore gives a snapshot: its problems are arith
    test problems at the unit's level, generated again from their ids."""
    from tosca_mlmt.tasks.arith import ArithTask

    u = json.loads(path.read_text())
    if "answers" not in u:
        raise SystemExit(f"{path}: the unit kept no eval answers (units run on code before 2e58c66 did not)")
    task = ArithTask(u["key"]["level"])
    problems = {p.id: p for p in task.load("test", len(u["ids"])).problems}
    rows, moved = [], []
    for i, pid in enumerate(u["ids"]):
        pair = []
        for name in ("t1", "final"):
            stored, text = bool(u[name][i]), u["answers"][name][i]
            v = task.verify(problems[pid], text)
            pair.append((stored, bool(v.correct)))
            if bool(v.correct) != stored:
                moved.append({"episode": pid, "turn": name, "gold": problems[pid].answer, "stored": [None, stored],
                              "now": [v.extracted, bool(v.correct)], "text_end": text[-80:]})
        rows.append(pair)
    return _result(path.stem, path, rows, moved, f"code {u['git_sha'][:7]}", task.verifier_version)


def pooled(units: list[dict]) -> dict:
    """Accuracies over all the label's snapshots, and now - stored with a bootstrap interval. Evals
    of the same problems (one episode each, every snapshot the same size): snapshots, then problems
    within them are resampled (analysis.stats.paired_bootstrap's scheme). Otherwise (training
    batches) the episodes are pooled and resampled alone."""
    from tosca_mlmt.analysis.stats import paired_bootstrap

    out = {"snapshots": len(units), "episodes": sum(u["episodes"] for u in units),
           "turns_moved": sum(u["turns_moved"] for u in units)}
    same = len({u["episodes"] for u in units}) == 1
    out["bootstrap"] = "snapshots x problems" if same else "episodes"
    for k, name in ((0, "acc_t1"), (1, "acc_final")):
        if same:  # [snapshots, problems]
            now = np.stack([u["_outcomes"][:, k, 1] for u in units])
            stored = np.stack([u["_outcomes"][:, k, 0] for u in units])
        else:  # [1, episodes]
            now = np.concatenate([u["_outcomes"][:, k, 1] for u in units])[None]
            stored = np.concatenate([u["_outcomes"][:, k, 0] for u in units])[None]
        diff = paired_bootstrap(now, stored)
        out[name] = {"stored": float(stored.mean()), "now": float(now.mean()),
                     "now_minus_stored": diff}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("snapshots", nargs="+", metavar="LABEL=FOLDER", help="a snapshot folder under a label")
    ap.add_argument("--results", default=None, help="a label: results/rescore/<date>_<label>.json (an old-style file "
                                                  "name, e.g. rescore-demo.json, is taken as its label)")
    args = ap.parse_args()
    by_label: dict[str, list[dict]] = defaultdict(list)
    for spec in args.snapshots:
        label, sep, folder = spec.partition("=")
        if not sep or not label or not folder:
            raise SystemExit(f"{spec}: expected LABEL=FOLDER")
        u = rescore_unit(Path(folder)) if folder.endswith(".json") else rescore(Path(folder))
        by_label[label].append(u)
        print(f"{label:<12} {u['snapshot']}: Acc@t1 {u['acc_t1']['stored']:.3f} -> {u['acc_t1']['now']:.3f}, "
              f"Acc@final {u['acc_final']['stored']:.3f} -> {u['acc_final']['now']:.3f} "
              f"({u['turns_moved']} turns moved; {u['verifier_stored']} -> {u['verifier_now']})", flush=True)
    res = {"benchmark": "rescore", "date": dt.datetime.now().isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "args": vars(args),
           "labels": {k: pooled(us) for k, us in by_label.items()},
           "snapshots": {k: [{x: v for x, v in u.items() if not x.startswith("_")} for u in us]
                         for k, us in by_label.items()}}
    for k, p in res["labels"].items():
        for name in ("acc_t1", "acc_final"):
            d = p[name]["now_minus_stored"]
            print(f"{k:<12} {name}: {p[name]['stored']:.3f} -> {p[name]['now']:.3f}, now - stored "
                  f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] ({p['snapshots']} snapshots, "
                  f"{p['episodes']} episodes, {p['turns_moved']} turns moved; bootstrap over {p['bootstrap']})")
    path = result_path("rescore", VARIANT, label=result_label(args.results, "rescore"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=float) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
