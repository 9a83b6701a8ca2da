"""The report's first section: the run's result, before vs after on held-out problems.

The numbers are those of ``mlmt eval --compare-to`` (``pipelines.evaluate.compare_outcomes``): read
from the later eval's ``eval.json`` (``compared_to``) when it was run with ``--compare-to``, or
computed the same way from two eval folders on the same problems (``pipelines.analyze``). Without
either, the section says why and shows the newest held-out eval alone, so no report opens with a
training-batch number in the place of a result.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd

from tosca_mlmt.analysis.captions import md_inline as _md_inline, md_table
from tosca_mlmt.analysis.tables import EVAL, Tables, focus_snapshot


@dataclass
class EvalInput:
    """An eval folder among the inputs (``mlmt eval --out``)."""

    folder: str  # as found from the arguments
    report: dict  # its eval.json
    created_at: str  # its snapshot's creation time ("" when unknown): orders before and after


@dataclass
class Headline:
    comparison: dict | None = None  # eval.json's ``compared_to`` layout: compare_outcomes + "eval"
    before: str = ""  # the eval folders compared
    after: str = ""
    stored: bool = False  # read from ``after``'s eval.json; False: computed by mlmt analyze
    note: str = ""  # why there is no comparison


def oldest_first(evals: list[EvalInput]) -> list[EvalInput]:
    """By their snapshots' creation time; ties (and unknown times) keep the argument order."""
    return sorted(evals, key=lambda e: e.created_at or "")


def _iv(d: dict, sign: str = "") -> str:
    return f"{d['mean']:{sign}.3f} [{d['lo']:{sign}.3f}, {d['hi']:{sign}.3f}]"


def _lead(c: dict) -> str:
    d, m = c["final_difference"], c["final_mcnemar"]
    return (f"Acc@final {c['before_acc_final']['mean']:.3f} → {c['after_acc_final']['mean']:.3f} on the same "
            f"{c['problems']} held-out problems: after − before {d['mean']:+.3f}, 95 % interval "
            f"[{d['lo']:+.3f}, {d['hi']:+.3f}]; McNemar p = {m['p']:.3g} ({m['a_only']} fixed, {m['b_only']} lost).")


def _rows(h: Headline) -> pd.DataFrame:
    c = h.comparison
    return pd.DataFrame({"": ["eval folder", "Acc@t1", "Acc@final"],
                         "before": [f"`{h.before}`", _iv(c["before_acc_t1"]), _iv(c["before_acc_final"])],
                         "after": [f"`{h.after}`", _iv(c["after_acc_t1"]), _iv(c["after_acc_final"])]})


def _notes(h: Headline) -> list[str]:
    c = h.comparison
    d = c["final_difference"]
    notes = ["Both evals decode greedily (one answer per problem) on the held-out test split and pair up problem "
             "by problem. Intervals (95 %): Wilson for each accuracy; paired bootstrap over problems for the "
             "difference; McNemar's exact test counts the problems whose final answer flipped."]
    if d["lo"] <= 0 <= d["hi"]:
        notes.append("The difference's interval includes 0: these problems cannot tell the change from the luck of "
                     "which problems the test set holds.")
    envs = sorted(e for e in {c.get("before_environment", "honest"), c.get("after_environment", "honest")}
                  if str(e).startswith("privileged"))  # honest:tool is honest
    if envs:
        notes.append(f"**Privileged environment** ({', '.join(f'`{e}`' for e in envs)}): a sanity check of the "
                     "learning machinery, not a result.")
    notes.append(f"From `{h.after}/eval.json` (`compared_to`, written by `mlmt eval --compare-to`)." if h.stored else
                 "Computed by `mlmt analyze` from the two evals' snapshots with `mlmt eval --compare-to`'s "
                 "statistics.")
    return notes


def _eval_alone(t: Tables) -> str | None:
    """The newest held-out eval's accuracies, when there is one: the result there is without a pair."""
    order = focus_snapshot(t.snapshots, t.accuracy["order"])
    if order is None or t.snapshots.set_index("order").at[order, "source"] != EVAL:
        return None
    acc = t.accuracy[t.accuracy["order"] == order].sort_values("attempt")
    first, last = acc.iloc[0], acc.iloc[-1]
    fmt = lambda r: f"{r['accuracy']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"  # noqa: E731
    return (f"Newest held-out eval (snapshot #{order}, `{first['snapshot']}`, {first['problems']} problems): "
            f"Acc@t1 {fmt(first)}, Acc@final {fmt(last)} (95 % bootstrap intervals over problems).")


NO_EVAL = ("No held-out eval among the inputs: the training-batch accuracies below are sampled on training problems "
           "and measure no result. Evaluate before and after training (`mlmt eval`, then `mlmt eval --run RUN "
           "--compare-to BEFORE`) and pass both eval folders.")


def _fallback(h: Headline, t: Tables) -> list[str]:
    alone = _eval_alone(t)
    return [f"No before/after comparison: {h.note}.", alone or NO_EVAL]


def headline_md(h: Headline, t: Tables) -> list[str]:
    out = ["## Result", ""]
    if h.comparison is None:
        return out + [p for line in _fallback(h, t) for p in (line, "")]
    out += [f"**{_lead(h.comparison)}**", "", md_table(_rows(h)), ""]
    return out + [" ".join(_notes(h)), ""]


def headline_html(h: Headline, t: Tables) -> str:
    head = '<section id="result"><h2>Result</h2>'
    if h.comparison is None:
        return head + "".join(f"<p>{_md_inline(p)}</p>" for p in _fallback(h, t)) + "</section>"
    rows = "".join(f"<tr><th>{html.escape(r[''])}</th><td>{_md_inline(r['before'])}</td>"
                   f"<td>{_md_inline(r['after'])}</td></tr>" for _, r in _rows(h).iterrows())
    return (f'{head}<p class="lead"><strong>{html.escape(_lead(h.comparison))}</strong></p>'
            f"<table><tr><th></th><th>before</th><th>after</th></tr>{rows}</table>"
            f'<p class="muted">{_md_inline(" ".join(_notes(h)))}</p></section>')
