"""The results page, generated from the stored result JSON under benchmarks/results/: nothing on it is
typed by hand, and tests/properties/test_docs.py fails when a JSON changes and the page is not regenerated.

Which run counts as current: a benchmark's results live in `benchmarks/results/<benchmark>/` named
`<date>_<variant>.json`; superseded runs sit in `archive/` below it and are listed, not summarised."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PAGE_DIR = "docs/results"  # where the page lives: links to the JSON are relative to it


def link(path: Path, text: str | None = None) -> str:
    rel = Path("../..") / path.relative_to(REPO)
    return f"[{text or path.name}]({rel.as_posix()})"


def current(bench: str) -> list[Path]:
    """A benchmark's current result JSON, oldest first (names start with the date)."""
    folder = RESULTS / bench
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def machine(d: dict) -> str:
    m = d.get("machine")
    if isinstance(m, dict):
        flags = m.get("cpu_flags") or []
        bf16 = "native bf16" if any("bf16" in f for f in flags) else ("no native bf16" if flags else "")
        text = ", ".join(x for x in (m.get("cpu_model", "?"), f"{m.get('cores', '?')} cores", bf16) if x)
    else:
        text = f"{m or '?'}" + (f", {d['cores']} cores" if "cores" in d else "")
    return text.replace("|", "/")


def load(d: dict) -> str:
    m = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    before, after = m.get("load_before"), m.get("load_after")
    if not (before and after) and isinstance(d.get("load_avg"), dict):  # hierarchy_cost's place for it
        before, after = d["load_avg"].get("before"), d["load_avg"].get("after")
    if before and after:
        return f"{before[0]:.1f} → {after[0]:.1f}"
    return "not recorded"


def date(d: dict, path: Path) -> str:
    return str(d.get("date") or path.name[:10])[:10]


def iv(x: dict, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(x['mean'])} [{f.format(x['lo'])}, {f.format(x['hi'])}]"


def demo_runs(config: str = "configs/demo.yaml") -> list[Path]:
    """The stored demo_seeds runs of one configuration as shipped (no --set), oldest first: `make demo` is
    configs/demo.yaml, whatever that file held on the run's date (its commit is in the JSON)."""
    out = []
    for p in current("demo_seeds"):
        d = _load(p)
        cmd = d.get("command", "")
        if "pooled" in d and f"make demo's commands, {config}, --seed S" in cmd:
            out.append(p)
    return out


def demo_section() -> list[str]:
    runs = demo_runs()
    out = ["## The demo (`make demo`)", "",
           "`make demo`'s three commands run per seed by `benchmarks/learning/demo_seeds.py` (the untrained pair and",
           "the trained one, greedy, on the same held-out `arith` level-2 problems). Pooled over seeds, 95 % bootstrap",
           "intervals that resample seeds and problems.", ""]
    if not runs:
        return out + ["No stored run.", ""]
    p = runs[-1]
    d = _load(p)
    pooled = d["pooled"]
    n = pooled["after_final"]
    out += ["| | before | after | after − before |", "|---|---|---|---|",
            f"| Acc@t1 | {iv(pooled['before_t1'])} | {iv(pooled['after_t1'])} | {iv(pooled['t1_difference'], True)} |",
            f"| Acc@final | {iv(pooled['before_final'])} | {iv(pooled['after_final'])} | "
            f"{iv(pooled['final_difference'], True)} |", "",
            f"{n['seeds']} seeds × {n['problems']} problems; {date(d, p)}, code `{str(d.get('commit', '?'))[:7]}`, "
            f"{machine(d)}, load {load(d)};", f"{link(p)}.", ""]
    # the same seeds with the learned writer (configs/demo-selector.yaml), paired with this run's folders
    alt = [q for q in demo_runs("configs/demo-selector.yaml") if (_load(q).get("against") or {}).get("after_final_difference")
           and q.name[:10] >= p.name[:10]]
    if alt:
        a = _load(alt[-1])
        out += ["The demo with a learned writer, `configs/demo-selector.yaml`, trained on the same seeds: Acc@final after "
                f"{iv(a['pooled']['after_final'])};",
                f"minus this demo's after training {iv(a['against']['after_final_difference'], True)}, Acc@t1 "
                f"{iv(a['against']['after_t1_difference'], True)} (paired over seeds × problems);",
                f"{link(alt[-1])}.", ""]
    return out


def _ratios(d: dict) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if k.startswith("ratio") and isinstance(v, dict):
            out.update({f"{kk}" if k == "ratios" else f"{k}: {kk}": vv for kk, vv in v.items()
                        if isinstance(vv, (int, float))})
        elif k.startswith("ratio") and isinstance(v, (int, float)):
            out[k] = v
    return out


# benchmark -> (the question, what its ratios mean)
SPEED = {
    "train_lower_throughput": ("A PPO iteration against TRL's `GRPOTrainer` on the same work",
                               "our generated tokens/s ÷ TRL's, per rollout engine: above 1, ours is faster."),
    "collect_throughput": ("Three-turn collect against raw vLLM generation",
                           "`a/b`: a's tokens/s ÷ b's; 1 is as fast as raw vLLM on the same prompts."),
    "weight_sync": ("Weight sync routes into vLLM",
                    "`file/x`: seconds of the file route ÷ seconds of route x; above 1, x is faster."),
}


def speed_section() -> list[str]:
    out = ["## Speed", "",
           "Each ratio is measured side by side in one run of its script, on the machine and at the load shown",
           "(the 1-minute load average before → after the run).", ""]
    for bench, (question, meaning) in SPEED.items():
        runs = [p for p in current(bench) if _ratios(_load(p))]
        if not runs:
            continue
        p = runs[-1]
        d = _load(p)
        out += [f"### {question}", "", meaning, "", "| ratio | value |", "|---|---|"]
        out += [f"| `{k}` | {v:.2f} |" for k, v in _ratios(d).items()]
        target = d.get("target")
        if isinstance(target, dict):
            out += ["", "Target: " + ", ".join(f"`{k}` ≥ {v}" for k, v in target.items()) + "."]
        out += ["", f"{date(d, p)}, {machine(d)}, load {load(d)};", f"{link(p)}.", ""]
    return out


# issue 69's targets: a unit's training time at most this many times single-turn GRPO's, same seed and sizes
HIERARCHY_TARGETS = {"mlmt": 3.0, "mlmt-sentences-only": 2.0}


def hierarchy_section() -> list[str]:
    """The newest full-size hierarchy_cost run: where each method's training seconds go."""
    runs = [p for p in current("hierarchy_cost") if "smoke" not in p.name]
    if not runs:
        return []
    p = runs[-1]
    d = _load(p)
    ratio = d.get("ratio_to_single_turn_grpo", {})
    out = ["## The hierarchy's cost", "",
           "`benchmarks/speed/hierarchy_cost.py`: the learning benchmark's units trained one after another in one run",
           "(no eval), each method's seconds by round step, and its training time ÷ single-turn GRPO's at the same",
           "seed. Targets: " + ", ".join(f"`{k}` ≤ {v:g}×" for k, v in HIERARCHY_TARGETS.items()) + ".", "",
           "| method | seed | train s | collect s | upper s | lower s | syncs s | peak RSS GiB | ÷ GRPO |",
           "|---|---|---|---|---|---|---|---|---|"]
    for u in d.get("units", []):
        st = u.get("stage_seconds", {})
        r = ratio.get(u["method"], {}).get(str(u["seed"]))
        cut = "" if u.get("finished", True) else " (cut short: not a unit)"
        out.append(f"| {u['method']}{cut} | {u['seed']} | {u['train_seconds']:.0f} | {st.get('collect', 0):.0f} | "
                   f"{st.get('upper', 0):.0f} | {st.get('lower', 0):.0f} | {u.get('sync_seconds', 0):.0f} | "
                   f"{u.get('peak_rss_gib') or '–'} | {'1' if u['method'] == 'single-turn-grpo' else r or '–'} |")
    sizes = ", ".join(f"{k} {v}" for k, v in (d.get("sizes") or {}).items())
    return out + overhead_table(d.get("overhead") or {}) + [
        "", f"{date(d, p)}, {machine(d)}, load {load(d)};", f"sizes: {sizes};", f"{link(p)}.", ""]


def overhead_table(overhead: dict) -> list[str]:
    """hierarchy_cost's ``overhead``: each ratio as the sum of its steps' shares of GRPO's training time."""
    if not overhead:
        return []
    out = ["", "Where each ratio comes from: each round step's seconds ÷ GRPO's training time at that seed (they sum",
           "to the ratio; rest = model loads and engine start), and the solver's own steps as multiples of GRPO's.", "",
           "| method | seed | collect | upper | lower | rest | solver steps × GRPO's |", "|---|---|---|---|---|---|---|"]
    for method, seeds in overhead.items():
        for seed, o in seeds.items():
            sh = o["of_baseline_time"]
            steps = ", ".join(f"{k} {v:g}×" for k, v in o["solver_steps_x_baseline"].items())
            out.append(f"| {method} | {seed} | {sh.get('collect', 0):g} | {sh.get('upper', 0):g} | "
                       f"{sh.get('lower', 0):g} | {sh.get('rest', 0):g} | {steps} |")
    return out


def learning_section() -> list[str]:
    summary = importlib.import_module("benchmarks.learning.learning_summary")
    lines, _ = summary.summarise()
    return ["## Learning efficacy", "",
            "The learning benchmark (`benchmarks/learning/learning_efficacy.py`): each method trains from the same",
            "base on `arith` level 2 and is evaluated greedily on the same held-out problems; seeds × problems per",
            "row, 95 % bootstrap intervals over seeds and problems, and beside them over seeds and *facts*: the",
            "300 test problems ask about 35 distinct facts in many phrasings, and a fact's phrasings mostly share",
            "their outcome, so resampling whole facts gives the honest (wider) interval; a target that asks for",
            "CI > 0 is judged by the interval over facts. Targets are judged by their pre-registered rule.",
            "Its units are under `benchmarks/results/learning_efficacy/`; the dated entries of the",
            "[record](log/index.md) say what each run changed and why.", "", *lines, ""]


def index_section() -> list[str]:
    out = ["## Every stored result", "",
           "The newest run of each benchmark variant; superseded runs are in each folder's `archive/`.", ""]
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        files = sorted(folder.glob("*.json"))
        if not files:
            continue
        out += [f"### `{folder.name}`", "", "| result | date | machine |", "|---|---|---|"]
        for p in files:
            try:
                d = _load(p)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(d, dict):
                continue
            out.append(f"| {link(p)} | {date(d, p)} | {machine(d)} |")
        out.append("")
    return out


def results_page() -> str:
    head = ["# Results", "",
            "What the toolkit has shown, generated by `python docs/gen/build.py` from the JSON each benchmark wrote",
            "(do not edit by hand). Every number links to its JSON; the [record](log/index.md) keeps the dated",
            "account of each measurement, and `benchmarks/README.md` says which script answers which question.", ""]
    return "\n".join(head + demo_section() + learning_section() + speed_section() + hierarchy_section()
                     + index_section()) + "\n"


def demo_readme_block() -> str:
    """Three lines for the README: the newest demo run's pooled result."""
    runs = demo_runs()
    if not runs:
        return "No stored demo run yet.\n"
    p = runs[-1]
    d = _load(p)
    pooled = d["pooled"]
    n = pooled["after_final"]
    rel = Path(*p.relative_to(REPO).parts)
    return (f"- Acc@t1 after − before: **{iv(pooled['t1_difference'], True)}**; Acc@final after − before: "
            f"**{iv(pooled['final_difference'], True)}**\n"
            f"- {n['seeds']} seeds × {n['problems']} held-out problems, 95 % intervals; {date(d, p)}, {machine(d)}\n"
            f"- JSON: [{p.name}]({rel.as_posix()})\n")
