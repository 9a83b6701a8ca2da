"""`mlmt eval` labels what the writer saw in eval.json, the snapshot's manifest and the metrics log alike:
honest:tool for the step checker's report, privileged:grading_tests for mbpp's grading-test errors."""

import json

import pytest

from conftest import TINY, run_mlmt

pytestmark = pytest.mark.slow


def _labels(out):
    from tosca_mlmt.store import load_snapshot

    rep = json.loads((out / "eval.json").read_text())
    snap = load_snapshot(out / "snapshots", rep["snapshot_id"])
    logged = [json.loads(line) for f in (out / "snapshots" / "_logs").glob("*/metrics.jsonl")
              for line in f.read_text().splitlines()]
    return rep, snap, {r["eval/environment"] for r in logged if "eval/environment" in r}


def test_a_writer_that_read_the_step_checker_is_labelled_honest_tool(tmp_path):
    # The solver stays the embedded model: its level-5 attempts write equations with slips, so the
    # checker flags them and the signal check below sees a 1 (the debug base writes no equations:
    # never flagged, every signal 0). The writer's text is not checked: it runs on the debug base.
    run_mlmt("eval", "--out", tmp_path, "--task", "arith", "--limit", "3", "--no-wandb", "--set", "task.level=5",
             "--set", "episode.writer_sees=tool", "--set", "model.writer=tiny-random", *TINY, check=True)
    rep, snap, logged = _labels(tmp_path)
    assert rep["environment"] == snap.manifest["summary"]["environment"] == "honest:tool" and logged == {"honest:tool"}
    flagged = []
    for ep in snap.episodes():
        fb = ep.turns[1]
        assert fb.info["writer_sees"] == "tool" and fb.info["writer_signal"] == int(fb.info["tool_report"]["flagged"])
        flagged.append(fb.info["tool_report"]["flagged"])
    assert any(flagged), "no attempt flagged: the signal check saw only 0s"


def test_an_mbpp_writer_that_read_grading_test_errors_is_labelled_privileged(tmp_path):
    # The solver stays the embedded model: its code fails in the sandbox, so the context is a grading-test
    # error (the debug base writes no code: only the verifier's "no code block" line). The writer's text
    # is not checked: it runs on the debug base.
    run_mlmt("eval", "--out", tmp_path, "--task", "mbpp", "--limit", "2", "--no-wandb",
             "--set", "model.writer=tiny-random", *TINY, check=True)
    rep, snap, logged = _labels(tmp_path)
    assert any(ep.turns[0].info.get("feedback_context") for ep in snap.episodes())  # what the writer read
    assert rep["environment"] == snap.manifest["summary"]["environment"] == "privileged:grading_tests"
    assert logged == {"privileged:grading_tests"}
