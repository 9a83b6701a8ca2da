"""`mlmt analyze`'s HTML report on hand-made metrics and snapshots (no model): the curated
figures are there, embedded, captioned and loadable; checked by rendering the page in headless
Chromium (Debian's `chromium`, installed by `make install`) when it is available."""

import base64
import json
import math
import re
import shutil
import subprocess

import pandas as pd
import pytest
from factories import patterned_episode

from tosca_mlmt.pipelines.analyze import analyze
from tosca_mlmt.store import write_snapshot

STEPS = 30
TRANSITIONS = ["right_to_right", "right_to_wrong", "wrong_to_right", "wrong_to_wrong"]
PATTERNS = [(True, True), (False, True), (True, False), (False, False)]


def _metrics() -> list[dict]:
    recs = []
    for s in range(1, STEPS + 1):
        rec = {"step": s, "lower/acc_t1": 0.3 + 0.01 * s + 0.05 * math.sin(s), "lower/acc_final": 0.4 + 0.01 * s,
               "lower/lr": 1e-5, "lower/kl": 0.001 * s, "lower/bonus/mean": 0.02 * math.cos(s)}
        for i, name in enumerate(TRANSITIONS):
            rec[f"lower/bonus/{name}/mean"] = 0.1 * (i - 1.5) + 0.01 * math.sin(s + i)
            rec[f"lower/bonus/{name}/count"] = 2.0 + i + s % 2
        recs.append(rec)
    for s in range(10, 110, 10):
        recs.append({"step": s, "upper/td_loss": 1.0 / s, "upper/q/verify": 0.2 + 0.003 * s,
                     "upper/q/hint": 0.4 - 0.001 * s, "upper/conservatism": 0.5})
    return recs


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A training run (metrics + 3 sampled batches, 2 samples per problem) and a privileged
    held-out eval (test split); ``mlmt analyze`` of both."""
    base = tmp_path_factory.mktemp("html")
    run = base / "run"
    for it in range(3):
        eps = [patterned_episode(i, PATTERNS[(i + it) % 4], ["verify"], [6 + i], f"t{it}") for i in range(8)]
        for e in eps[4:]:  # a second sample of the first four problems
            e.problem = eps[eps.index(e) - 4].problem
            e.episode_id = f"{e.problem.id}/s1"
        write_snapshot(run / "snapshots", eps, {"kind": "train-lower-batch", "iteration": it,
                                                "task": {"split": "train"}, "sampling": {"solver": {"temperature": 0.7}}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in _metrics()))
    ev = base / "eval"
    eps = [patterned_episode(i, PATTERNS[i % 4], ["hint"], [5], "e") for i in range(6)]
    eps[1].turns[1].text = "Check the <script>alert(1)</script> carry & try again."
    write_snapshot(ev / "snapshots", eps, {"kind": "collect", "task": {"split": "test"},
                                           "summary": {"environment": "privileged:writer_sees=verdict"}})
    res = analyze([str(run), str(ev)], base / "out", verify=True)
    return res, res.html.read_text()


def test_the_page_is_self_contained_and_embeds_every_curated_figure(report):
    res, page = report
    assert res.html.name == "report.html" and res.report.name == "report.md"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)|url\(|@import""", page, re.I)
    srcs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(srcs) == len(re.findall(r"<img\b", page))
    assert all(base64.b64decode(s)[:8] == b"\x89PNG\r\n\x1a\n" for s in srcs)
    for alt in ("accuracy per turn", "correction matrix", "Q per strategy", "bonus per transition"):
        assert f'alt="{alt}"' in page
    assert len(srcs) >= 4 + 2  # the curated four, plus strategies and the learning curves


def test_captions_say_what_is_plotted_with_n_and_bands(report):
    _, page = report
    assert "95 % percentile bootstrap intervals (1000 resamples of problems" in page
    assert ("Data: training batches (3 snapshots): turn 1 sampled at T = 0.7, on training problems; 8 episodes of 4 "
            "problems per point; held-out evals (1 snapshot): turn 1 temperature not recorded, on the held-out test "
            "split; 6 episodes of 6 problems per point.") in page
    # the correction grid is one snapshot's, the newest eval (#3), not the 30 episodes of all four pooled
    assert "Left: one snapshot, counts and fractions: The newest held-out eval, #3 <code>snap-" in page
    assert "(6 episodes)" in page and "pooled (n =" not in page
    # no before/after among these inputs: the result section says so first, with the eval alone
    result = page.split('<section id="result">', 1)[1].split("</section>", 1)[0]
    assert "no eval folder (one holding an eval.json) among the inputs" in result
    assert "Newest held-out eval (snapshot #3, " in result
    assert "right → right: 75" in page and "wrong → wrong: 165" in page  # bonus counts summed over 30 steps
    # constant series are named with their value instead of plotted
    assert "Constant, not plotted: <code>lr</code> = 1e-05." in page
    assert "Constant, not plotted: <code>conservatism</code> = 0.5." in page


def test_privileged_banner_and_sample_episodes_are_escaped(report):
    _, page = report
    banner = re.search(r'<div class="banner">(.*?)</div>', page).group(1)
    assert "<strong>Privileged environment</strong>" in banner and "<strong>mixed</strong>" in banner
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # the newest held-out eval, one episode per correction cell, corrections first
    cells = re.findall(r'<div class="episode"><h3>(.*?): ', page)
    assert cells == ["wrong → right", "right → wrong", "wrong → wrong", "right → right"]


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


# After every image settled, writes how many decoded to a non-zero width into the DOM, which
# --dump-dom prints: a broken data URI or a blocked fetch leaves naturalWidth at 0.
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.insertAdjacentHTML("beforeend", `<p id="probe">loaded ${ok} of ${imgs.length}</p>`);
});
</script>"""


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (make install adds Debian's `chromium` "
                                                 "where apt-get is available)")
def test_every_figure_loads_in_headless_chromium(report, tmp_path):
    res, page = report
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    cmd = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=20000", "--dump-dom", probe.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    n = len(re.findall(r"<img\b", page))
    assert f'<p id="probe">loaded {n} of {n}</p>' in out.stdout, out.stdout[-1000:] + out.stderr[-2000:]


def test_q_and_bonus_families_follow_a_joint_run_across_rounds_not_its_restarting_stages():
    from tosca_mlmt.analysis.tables import bonus_per_transition, metric_family

    rows = [("j", "joint", "q/verify", 0, 0.1), ("j", "joint", "q/verify", 1, 0.2),
            ("j/rounds/r0/upper", "upper", "q/verify", 5, 0.3),  # round 0's own steps: covered by joint/
            ("solo", "upper", "q/hint", 5, 0.4), ("solo", "upper", "td_loss", 5, 1.0),
            ("j", "joint", "bonus/wrong_to_right/mean", 1, 0.5), ("j", "joint", "bonus/wrong_to_right/count", 1, 3.0),
            ("j", "joint", "bonus/right_to_wrong/count", 1, 0.0),  # none of that kind: its mean was NaN, dropped
            ("j", "joint", "bonus/mean", 1, 0.2)]
    curves = pd.DataFrame(rows, columns=["run", "level", "metric", "step", "value"])
    q = metric_family(curves, "q/")
    assert list(zip(q["run"], q["name"], q["step"])) == [("j", "verify", 0), ("j", "verify", 1), ("solo", "hint", 5)]
    bt = bonus_per_transition(curves)
    assert bt["transition"].tolist() == ["right_to_wrong", "wrong_to_right"]
    assert bt["count"].tolist() == [0.0, 3.0] and math.isnan(bt["mean"][0]) and bt["mean"][1] == 0.5


# Written into a built docs page: whether Material's stylesheet applied (its header is sticky only then) and
# how many of the page's images decoded, so a page that renders without its assets fails.
SITE_PROBE = """<script>
window.addEventListener("load", () => {
  const header = document.querySelector(".md-header");
  const pos = header ? getComputedStyle(header).position : "none";
  document.body.insertAdjacentHTML("beforeend", `<p id="probe">header ${pos}</p>`);
});
</script>"""


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (make install adds Debian's `chromium` "
                                                 "where apt-get is available)")
@pytest.mark.parametrize("page,text", [("index.html", "Where to go"), ("reference/config/index.html", "engine.allocator")])
def test_the_docs_site_renders_in_headless_chromium(tmp_path, page, text):
    from pathlib import Path
    import sys

    repo = Path(__file__).resolve().parents[3]
    site = tmp_path / "site"
    build = subprocess.run([str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "-f",
                            str(repo / "mkdocs.yml"), "--site-dir", str(site)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    html = site / page
    html.write_text(html.read_text().replace("</body>", SITE_PROBE + "</body>"))
    cmd = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=20000", "--dump-dom", html.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert '<p id="probe">header sticky</p>' in out.stdout, out.stdout[-1000:]
    assert text in re.sub(r"<[^>]+>", "", out.stdout)
