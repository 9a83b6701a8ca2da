"""The HTML report of ``mlmt analyze``: one self-contained file (``report.html``) with a few
curated figures, their captions and sample episodes.

Self-contained means it opens anywhere, offline, from a mail attachment or a CI artifact: the
figures are embedded as base64 PNG data URIs and the style sheet is inline; nothing is fetched.
The Markdown report next to it keeps every table; this one is for reading.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

from tosca_mlmt.analysis.captions import MISSING, data_sentence, display, md_inline
from tosca_mlmt.analysis.curves import MIN_POINTS_TO_SMOOTH, constant_metrics, single_step_metrics
from tosca_mlmt.analysis.headline import Headline, headline_html
from tosca_mlmt.analysis.report import environment_lines, focus_grid, sources_of
from tosca_mlmt.analysis.tables import ACCURACY_BOOTSTRAP, EVAL, PLURAL, TRAIN, Tables
from tosca_mlmt.samples import bonus_text

TEXT_LIMIT = 1500  # characters of one turn's text shown; the snapshot has the rest

STYLE = """
body { font: 16px/1.55 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", sans-serif;
       color: #1f2328; background: #fff; max-width: 72rem; margin: 0 auto; padding: 1.5rem 2rem 4rem; }
h1 { font-size: 1.9rem; margin-bottom: .2rem; } h2 { margin-top: 2.6rem; border-bottom: 1px solid #d0d7de; }
code { font: .88em ui-monospace, SFMono-Regular, Menlo, monospace; background: #f3f4f6; padding: 0 .25em; }
.muted { color: #57606a; } nav a { margin-right: 1rem; }
.banner { border-left: 5px solid #bf8700; background: #fff8c5; padding: .8rem 1rem; margin: 1rem 0; }
.banner.honest { border-color: #1a7f37; background: #dafbe1; }
figure { margin: 1.2rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { font-size: .92rem; color: #424a53; margin-top: .4rem; max-width: 60rem; }
table { border-collapse: collapse; font-size: .88rem; margin: .8rem 0; }
th, td { border: 1px solid #d0d7de; padding: .25rem .6rem; text-align: right; }
th { background: #f6f8fa; } td:first-child, th:first-child { text-align: left; }
.episode { border: 1px solid #d0d7de; border-radius: 6px; padding: .6rem 1rem; margin: 1rem 0; }
.turn { margin: .5rem 0 .5rem 1rem; } .turn pre { white-space: pre-wrap; margin: .2rem 0;
       background: #f6f8fa; padding: .5rem; font-size: .85rem; }
.right { color: #1a7f37; font-weight: 600; } .wrong { color: #cf222e; font-weight: 600; }
details summary { cursor: pointer; font-weight: 600; margin: 1rem 0; }
#result { border: 1px solid #d0d7de; border-radius: 6px; padding: .2rem 1.2rem .6rem; margin: 1.2rem 0; }
#result h2 { margin-top: .8rem; } #result .lead { font-size: 1.12rem; }
"""


def _inline(md: str) -> str:
    """The Markdown of the environment banner as HTML: escaped, then **bold** and `code`."""
    return md_inline(md.removeprefix("> "))


def _img(out: Path, figures: dict[str, str], key: str, alt: str) -> str:
    data = base64.b64encode((out / figures[key]).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _figure(out: Path, figures: dict[str, str], key: str, alt: str, caption: str) -> str:
    if key not in figures:
        return ""
    return f"<figure>{_img(out, figures, key, alt)}<figcaption>{caption}</figcaption></figure>"


def _table(df: pd.DataFrame) -> str:
    """Cells as report.md writes them (``captions.display``): a missing value is "–", never <NA>."""
    return display(df).to_html(index=False, border=0, na_rep=MISSING, escape=True)


def _missing(what: str) -> str:
    return f'<p class="muted"><em>Not available: {html.escape(what)}.</em></p>'


SMOOTHING = (f"Raw series faint, exponential moving average (span max(3, n/10) points) solid; series shorter "
             f"than {MIN_POINTS_TO_SMOOTH} points are drawn raw with markers.")


def _accuracy(t: Tables, out: Path, figures: dict[str, str]) -> str:
    h = '<h2 id="accuracy">Accuracy per turn over training</h2>'
    if not len(t.accuracy):
        return h + _missing("no snapshots")
    acc = t.accuracy.merge(t.snapshots[["order", "source"]], on="order")
    caption = (f"Accuracy of each solver attempt (attempt 1 = first answer, attempt k+1 = the answer after "
               f"feedback round k) per snapshot, oldest first. Bands and error bars: 95 % percentile bootstrap "
               f"intervals ({ACCURACY_BOOTSTRAP} resamples of problems, the samples of one problem kept together). "
               f"{PLURAL[TRAIN].capitalize()} and {PLURAL[EVAL]} are in separate panels: they are not one "
               f"series. {html.escape(data_sentence(t.sources, explain=True))}")
    table = acc.assign(interval=[f"[{lo:.3f}, {hi:.3f}]" for lo, hi in zip(acc["lo"], acc["hi"])])
    table = table[["order", "source", "attempt", "episodes", "problems", "accuracy", "interval"]]
    return h + _figure(out, figures, "accuracy", "accuracy per turn", caption) + _table(table.rename(
        columns={"order": "#"}))


def _correction(t: Tables, out: Path, figures: dict[str, str]) -> str:
    h = '<h2 id="correction">Correction matrix over rounds</h2>'
    if not len(t.correction):
        return h + _missing("no snapshots")
    which, _ = focus_grid(t)
    caption = (f"Turn-1 answer vs final answer. Left: one snapshot, counts and fractions: {md_inline(which)}. "
               "Right, one panel per source: per snapshot, the fractions of right → right, wrong → right "
               "(corrections), right → wrong (broken answers) and wrong → wrong, stacked to 1. No panel pools "
               "snapshots. wrong → right − right → wrong = Acc@final − Acc@t1. "
               f"{html.escape(data_sentence(t.sources))}")
    return h + _figure(out, figures, "correction", "correction matrix", caption)


def _sources(df: pd.DataFrame) -> str:
    return ", ".join(f"<code>{html.escape(r)}</code> ({html.escape(lv)})"
                     for r, lv in df[["run", "level"]].drop_duplicates().itertuples(index=False))


def _q_values(t: Tables, out: Path, figures: dict[str, str]) -> str:
    h = '<h2 id="q">Q per strategy over time</h2>'
    if not len(t.q_values):
        return h + _missing("no upper/q/* or joint/q/* metrics in the metrics.jsonl files")
    caption = (f"The writer's Q-value per feedback strategy, averaged over every logged state, at each "
               f"evaluation step of the upper level (one panel per run: {_sources(t.q_values)}); a joint run "
               f"shows every round's evaluations on its global step. {SMOOTHING}")
    return h + _figure(out, figures, "q_values", "Q per strategy", caption)


def _bonus_transitions(t: Tables, out: Path, figures: dict[str, str]) -> str:
    h = '<h2 id="bonus">Context bonus per transition</h2>'
    bt = t.bonus_transitions
    if not len(bt):
        return h + _missing("no lower/bonus/<transition>/mean metrics in the metrics.jsonl files")
    n = bt.groupby("transition")["count"].sum()
    counts = ", ".join(f"{k.replace('_to_', ' → ')}: {int(v)}" for k, v in n.items())
    caption = (f"Mean context-dependency bonus of the solver's refines, split by the correction each refine "
               f"made (turn before → this turn), per update step (a joint run: every round's updates on its "
               f"global step; {_sources(bt)}). Refines counted over all "
               f"steps: {html.escape(counts)}. A gap between wrong → right and right → wrong is what the bonus "
               f"is for. {SMOOTHING}")
    return h + _figure(out, figures, "bonus_transitions", "bonus per transition", caption)


def _verdict(ok) -> str:
    if ok is None:
        return ""
    return '<span class="right">right</span>' if ok else '<span class="wrong">wrong</span>'


def _episodes(t: Tables, samples: pd.DataFrame, texts: list[dict]) -> str:
    h = '<h2 id="episodes">Sample episodes</h2>'
    if not texts:
        return h + _missing("no snapshots")
    cell = dict(zip(samples["episode_id"], samples["cell"]))
    src = t.snapshots.set_index("snapshot")["source"]
    parts = [h, f'<p class="muted">From snapshot <code>{html.escape(texts[0]["snapshot"])}</code> '
                f'({html.escape(src[texts[0]["snapshot"]])}): the first episode of each correction cell. '
                f'Turn texts are cut at {TEXT_LIMIT} characters. A refine shows the solver\'s context bonus its '
                f'PPO update used (and the raw log-ratio term): n/a in snapshots no update saw (collect, eval).</p>']
    for ep in texts:
        parts.append(f'<div class="episode"><h3>{html.escape(cell[ep["episode_id"]])}: '
                     f'<code>{html.escape(ep["episode_id"])}</code></h3>'
                     f'<p><strong>Problem.</strong> {html.escape(ep["question"] or "")}<br>'
                     f'<strong>Reference answer.</strong> <code>{html.escape(ep["answer"] or "")}</code></p>')
        for turn in ep["turns"]:
            what = f'{turn["role"]} · {turn["kind"]} · round {turn["round"]}'
            if turn["strategy_name"]:
                what += f' · strategy <code>{html.escape(turn["strategy_name"])}</code>'
            if turn["kind"] == "refine":  # the solver's context bonus, as train-lower used it
                what += f' · bonus {html.escape(bonus_text(turn.get("bonus"), turn.get("bonus_raw")))}'
            text = turn["text"] or ""
            cut = text[:TEXT_LIMIT] + (" …" if len(text) > TEXT_LIMIT else "")
            parts.append(f'<div class="turn">{what} {_verdict(turn["correct"])}<pre>{html.escape(cut)}</pre></div>')
        parts.append("</div>")
    return "".join(parts)


def _more(t: Tables, out: Path, figures: dict[str, str]) -> str:
    parts = ['<h2 id="more">More figures</h2>']
    strat_data = html.escape(data_sentence(t.sources, only=sources_of(t, t.strategies))) \
        if len(t.strategies) else ""
    parts.append(_figure(out, figures, "strategies", "strategies",
                         "Left: share of the writer's feedback turns per strategy per snapshot. Right: the mean "
                         "improvement (r_final − r1) of the episodes that used it. One row of panels per source. "
                         + strat_data))
    parts.append(_figure(out, figures, "strategy_correctness", "strategy by correctness",
                         "Each strategy's share of the feedback after a right attempt (solid) and after a wrong "
                         "one (dashed), per snapshot, one panel per source: where the two lines of a strategy meet, "
                         "the writer chooses it regardless of whether the attempt was right."))
    parts.append(_figure(out, figures, "bonus", "bonus vs correctness",
                         "Context bonus (<code>lower/bonus/mean</code>) and its correlation with a correct answer "
                         "per step of training (the PPO batches, from metrics.jsonl), and the bonus against "
                         "Acc@final."))
    if len(t.feedback_length):
        n = t.feedback_length.groupby("source")["feedback_turns"].sum()
        counts = "; ".join(f"{PLURAL[s]}: n = {int(n[s])}" for s in (TRAIN, EVAL) if s in n)
        parts.append(_figure(out, figures, "feedback_length", "feedback length",
                             f"Feedback turns bucketed by length in tokens, one panel per source ({counts}; never "
                             "pooled): their episodes' final accuracy and mean improvement; n per bucket under each "
                             "bar."))
    curves = []
    for (run, level), g in t.curves.groupby(["run", "level"]):
        flat, single = constant_metrics(g), single_step_metrics(g)
        note = ("Constant, not plotted: " + ", ".join(f"<code>{html.escape(m)}</code> = {v:.4g}"
                                                       for m, v in flat.items()) + ". ") if flat else ""
        if single:
            note += (f"Logged at one step only, not plotted: {len(single)} metric(s) (values in the learning-curve "
                     "tables of <code>report.md</code>). ")
        caption = (f"<code>{html.escape(run)}</code>, {level}: every logged learning metric that changed "
                   f"({g['step'].nunique()} step(s)). {note}{SMOOTHING}")
        curves.append(_figure(out, figures, f"curves:{run}:{level}", f"{run} {level} learning curves", caption)
                      or f"<p>{caption}</p>")
    if curves:
        parts.append(f"<details><summary>All learning curves ({len(curves)} run/level group(s))</summary>"
                     f"{''.join(curves)}</details>")
    return "".join(parts)


def _inputs(t: Tables) -> str:
    parts = ['<h2 id="inputs">Inputs</h2>']
    parts.append(_table(t.runs) if len(t.runs) else _missing("no metrics.jsonl"))
    parts.append(_table(t.snapshots.rename(columns={"order": "#"})) if len(t.snapshots) else _missing("no snapshots"))
    return "".join(parts)


def _banner(t: Tables) -> str:
    lines = [ln for ln in environment_lines(t.snapshots) if ln]
    if not lines:
        return ""
    honest = not lines[0].startswith(">")
    return f'<div class="banner{" honest" if honest else ""}">{_inline(lines[0])}</div>'


def render_html(t: Tables, out: Path, figures: dict[str, str], sources: list[str], samples: pd.DataFrame,
                texts: list[dict], headline: Headline | None = None) -> str:
    """The whole page; ``figures`` are file names under ``out`` (plots.draw_all), embedded.
    ``headline``: the before/after result, shown first (None: no eval folder among the inputs)."""
    headline = headline or Headline(note="no eval folder (one holding an eval.json) among the inputs")
    nav = "".join(f'<a href="#{a}">{n}</a>' for a, n in (
        ("result", "Result"), ("accuracy", "Accuracy"), ("correction", "Corrections"), ("q", "Q per strategy"),
        ("bonus", "Bonus per transition"), ("episodes", "Episodes"), ("more", "More"), ("inputs", "Inputs")))
    inputs = ", ".join(f"<code>{html.escape(s)}</code>" for s in sources)
    body = [f'<h1>mlmt analyze</h1><p class="muted">From {inputs}. Every table is in <code>report.md</code> '
            "next to this file.</p>", headline_html(headline, t), _banner(t), f"<nav>{nav}</nav>",
            _accuracy(t, out, figures), _correction(t, out, figures), _q_values(t, out, figures),
            _bonus_transitions(t, out, figures), _episodes(t, samples, texts), _more(t, out, figures), _inputs(t)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>mlmt analyze report</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")
