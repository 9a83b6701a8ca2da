"""logging.trackers: the metrics sink mirrors its records to accelerate's wandb / tensorboard
trackers (tosca_mlmt/trackers.py). TensorBoard's event files are read back with its own
EventAccumulator; wandb's offline run with test_timeline's reader."""

import json
import time

import numpy as np
import pytest

from conftest import FP32
from factories import wandb_history
from tosca_mlmt.config import TRACKERS, load_config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.metrics import MetricsSink
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.timeline import Timeline
from tosca_mlmt.trackers import BUILDERS, markdown_table


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _scalars(ea, tag):
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def _text(ea, tag):
    from tensorboard.util import tensor_util

    (ev,) = ea.Tensors(f"{tag}/text_summary")
    return tensor_util.make_ndarray(ev.tensor_proto).item().decode()


def _cfg(**over):
    return load_config(overrides={**FP32, "logging.progress": False, **over})


def test_the_config_names_exactly_the_trackers_that_can_be_built():
    assert set(TRACKERS) == set(BUILDERS)
    assert load_config().logging.trackers == ["wandb"]


def test_tensorboard_scalars_are_the_logged_values_at_the_logged_steps(tmp_path):
    from accelerate.state import PartialState

    had_state = bool(PartialState._shared_state)
    sink = MetricsSink(tmp_path, {}, ["tensorboard"], enabled=True)
    # numpy scalars too: accelerate's tracker would drop np.int64 / np.float32 silently
    logged = {1: {"lower/loss": 0.5, "lower/n": np.int64(7)}, 2: {"lower/loss": np.float32(0.25), "lower/n": 9},
              5: {"lower/loss": -3.0, "lower/n": 11, "note": "text, not a curve"}}
    for step, rec in logged.items():
        sink.log(rec, step=step)
    sink.log_table("lower/samples", [{"problem": "2+2 | 3", "attempt": "line 1\nline 2"}], step=5)
    sink.close()
    assert had_state or not PartialState._shared_state  # no accelerate process state was set up for it
    assert [p.parent.name for p in tmp_path.glob("**/events.out.tfevents.*")] == ["tb"]
    ea = _events(tmp_path / "tb")
    assert _scalars(ea, "lower/loss") == [(1, 0.5), (2, 0.25), (5, -3.0)]
    assert _scalars(ea, "lower/n") == [(1, 7.0), (2, 9.0), (5, 11.0)]
    assert _text(ea, "note") == "text, not a curve"
    assert _text(ea, "lower/samples") == "| problem | attempt |\n|---|---|\n| 2+2 \\| 3 | line 1<br>line 2 |"
    # metrics.jsonl is written as before
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lower/loss"]) for r in rows] == [(1, 0.5), (2, 0.25), (5, -3.0)]


def test_a_resumed_run_shows_each_step_once_as_logged_last(tmp_path):
    first = MetricsSink(tmp_path, {}, ["tensorboard"], enabled=True)
    for step in (1, 2, 3):
        first.log({"loss": float(step)}, step=step)
    first.close()  # killed after step 3; the checkpoint was at step 2
    time.sleep(1.1)  # event files are read in name order, whose first field is the second they were opened
    again = MetricsSink(tmp_path, {}, ["tensorboard"], enabled=True)
    for step in (3, 4):
        again.log({"loss": 10.0 * step}, step=step)
    again.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    assert _scalars(_events(tmp_path / "tb"), "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_both_trackers_get_the_joint_timeline_and_wandb_stays_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _cfg(**{"logging.wandb": True, "logging.trackers": ["wandb", "tensorboard"]})
    assert cfg.logging.wandb_mode == "offline"
    joint = RunDir(tmp_path / "joint", "train-joint")
    timeline = Timeline(joint.sink(cfg))
    inner = RunDir(tmp_path / "joint" / "lower", "train-lower")
    sink = inner.sink(_cfg(**{"logging.wandb": False}), tee=timeline.tee("lower"))  # as train-joint's stages
    for it in (1, 2):
        sink.log({"lower/acc_t1": it / 4}, step=it)
    timeline.log({"joint/time/lower": 1.5, "joint/round": 0})
    timeline.sink.log_table("joint/samples", [{"problem": "1+1", "reward": 1.0}], step=timeline.step)
    inner.close()
    joint.close()
    assert not {"tb", "wandb"} & {p.name for p in (tmp_path / "joint" / "lower").iterdir()}  # no trackers of its own
    ea = _events(tmp_path / "joint" / "tb")
    assert _scalars(ea, "lower/acc_t1") == [(1, 0.25), (2, 0.5)]
    assert _scalars(ea, "lower/step") == [(1, 1.0), (2, 2.0)]
    assert _scalars(ea, "joint/time/lower") == [(3, 1.5)]
    assert "| 1+1 | 1.0 |" in _text(ea, "joint/samples")
    (run_file,) = (tmp_path / "joint").glob("wandb/offline-run-*/run-*.wandb")
    hist = wandb_history(run_file, expect=3)  # the table joins step 3
    assert [(s, r.get("lower/acc_t1")) for s, r in hist[:2]] == [(1, 0.25), (2, 0.5)]
    assert list((tmp_path / "joint").glob("wandb/offline-run-*/files/media/table/joint/samples_*.table.json"))


def test_logging_wandb_false_and_wandb_mode_disabled_turn_trackers_off():
    both = {"logging.trackers": ["wandb", "tensorboard"]}
    assert _cfg(**both).logging.active_trackers() == ("wandb", "tensorboard")
    assert _cfg(**both, **{"logging.wandb": False}).logging.active_trackers() == ()
    assert _cfg(**both, **{"logging.wandb_mode": "disabled"}).logging.active_trackers() == ("tensorboard",)
    assert _cfg(**{"logging.trackers": []}).logging.active_trackers() == ()


@pytest.mark.parametrize("value", [["tb"], ["wandb", "wandb"], [3], "tensorboard"])
def test_bad_tracker_lists_are_one_config_error_naming_the_field(value):
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"logging.trackers": value})
    msg = str(e.value)
    assert "'logging.trackers'" in msg and "\n" not in msg
    if isinstance(value, list):
        assert "wandb, tensorboard" in msg


def test_markdown_cells_keep_their_text():
    assert markdown_table(["a"], [[None], ["x\\y"], ["p\r\nq"]]) == "| a |\n|---|\n|  |\n| x\\\\y |\n| p<br>q |"


def _run_ids(folder) -> set[str]:
    """The run ids of the offline wandb runs under ``folder``: offline-run-<time>-<id>, with a
    ``-1`` suffix when two runs of the same id start within one second."""
    return {p.name.split("-")[3] for p in folder.glob("wandb/offline-run-*")}


def test_a_second_sink_on_the_same_folder_continues_its_wandb_run(tmp_path, monkeypatch):
    from tosca_mlmt.trackers import WANDB_RUN_ID

    monkeypatch.setenv("WANDB_MODE", "offline")
    for step in (1, 2):  # a run, then its --resume
        sink = MetricsSink(tmp_path / "run", {}, ["wandb"], enabled=True)
        sink.log({"loss": float(step)}, step=step)
        sink.close()
    stored = (tmp_path / "run" / WANDB_RUN_ID).read_text().strip()
    assert len(list((tmp_path / "run").glob("wandb/offline-run-*"))) == 2 and _run_ids(tmp_path / "run") == {stored}
    files = sorted((tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb"))
    assert [s for f in files for s, _ in wandb_history(f, expect=1)] == [1, 2]
    other = MetricsSink(tmp_path / "other", {}, ["wandb"], enabled=True)  # another folder, another run
    other.close()
    assert _run_ids(tmp_path / "other") == {(tmp_path / "other" / WANDB_RUN_ID).read_text().strip()} != {stored}


def test_a_damaged_run_id_file_is_an_error_naming_it(tmp_path):
    from tosca_mlmt.errors import MlmtError
    from tosca_mlmt.trackers import WANDB_RUN_ID, wandb_run_id

    (tmp_path / WANDB_RUN_ID).write_text("../not an id")
    with pytest.raises(MlmtError, match=f"{WANDB_RUN_ID}: not a wandb run id"):
        wandb_run_id(tmp_path)


@pytest.mark.slow
def test_a_killed_and_resumed_train_lower_logs_to_one_wandb_run(debug_cfg, debug_policies, tmp_path, monkeypatch):
    from dataclasses import replace

    from tosca_mlmt.pipelines.train_lower import train_lower

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = replace(debug_cfg, solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=6),
                  task=replace(debug_cfg.task, level=1),
                  logging=replace(debug_cfg.logging, wandb=True, trackers=["wandb"]),
                  lower=replace(debug_cfg.lower, iterations=2, problems_per_iteration=1, save_every=1,
                                minibatch_size=2, keep_snapshots=False))
    model = debug_policies.model("solver")
    init = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    try:
        train_lower(cfg, tmp_path / "run", policies=debug_policies, stop_after=1)  # killed after iteration 1
        train_lower(cfg, tmp_path / "run", policies=debug_policies, resume=True)
    finally:
        for n, p in model.named_parameters():
            if n in init:
                p.data.copy_(init[n])
    runs = sorted((tmp_path / "run").glob("wandb/offline-run-*"))
    assert len(runs) == 2 and len(_run_ids(tmp_path / "run")) == 1
    steps = [s for r in runs for s, _ in wandb_history(next(r.glob("run-*.wandb")), expect=1)]
    assert steps == [1, 2]  # the resumed process logs iteration 2 into the same run
