"""Fault injection: each stage is started through the CLI, killed with SIGKILL at a random
point of its work (a seeded delay after its first progress line or first output file, so
mid-generation, mid-update and mid-write all happen, not only step boundaries), then run again
with ``--resume`` (``collect`` simply reruns). In determinism mode the result must equal an
uninterrupted run bit for bit: final adapter and head tensors, snapshot ids, metrics steps
(nothing repeated, nothing lost), and no partial snapshot may ever be visible.

One uninterrupted reference run per stage (module fixtures); kill delays are drawn from
``FAULT_SEED`` (environment, default 20240611) and scaled by the reference run's own timing,
so they land inside the work on slow and fast machines alike.
"""

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FP32, MLMT, set_args
from tosca_mlmt.store import verify_snapshot

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("FAULT_SEED", "20240611"))
TIMEOUT = 900  # per subprocess: start-up alone can take minutes on a loaded 2-core box
# The random-weight debug base: resume mechanics do not depend on what the model knows, and it
# runs ~4x faster. Its answers are never right, so GRPO's advantages would all be 0 and nothing
# would train: GAE's value baseline gives every token a non-zero advantage (assert_trained).
COMMON = {**FP32, "model.solver": "tiny-random", "lower.advantage": "gae", "deterministic": True,
          "logging.progress": False, "solver_sampling.max_new_tokens": 12, "writer_sampling.max_new_tokens": 8,
          "episode.max_feedback_tokens": 8, "task.level": 1}


def sets(over: dict) -> list[str]:
    return set_args({**COMMON, **over})


def delay(stage: str, span: float) -> float:
    """A seeded point inside the next ``span`` seconds of work (away from both ends)."""
    return random.Random(f"{SEED}-{stage}").uniform(0.1, 0.6) * span


def mlmt(args: list, log: Path, ready=None) -> float:
    """Run to completion; returns the seconds from when ``ready()`` first held (or from the
    start) to the end: the span in which the killed twin of this run gets its kill."""
    with open(log, "w") as err:
        proc = subprocess.Popen([*MLMT, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err)
        t0 = None if ready else time.monotonic()
        while proc.poll() is None:
            if t0 is None and ready():
                t0 = time.monotonic()
            time.sleep(0.05)
    assert proc.returncode == 0, f"mlmt {' '.join(map(str, args))} failed:\n{log.read_text()[-3000:]}"
    return time.monotonic() - (t0 or time.monotonic())


def kill_at(args: list, out: Path, log: Path, ready, wait: float, tries: int = 4) -> None:
    """Start ``mlmt args``, wait until ``ready()``, then ``wait`` seconds more, then SIGKILL. A run
    that ends before its kill ran faster than the reference it was scaled by (e.g. the other test
    worker went idle meanwhile): its ``out`` is removed and it starts again with half the delay,
    so the kill still lands inside the work whatever the machine's load does."""
    for _ in range(tries):
        with open(log, "w") as err:
            proc = subprocess.Popen([*MLMT, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err)
            try:
                deadline = time.monotonic() + TIMEOUT
                while not ready():
                    assert proc.poll() is None, f"ended before the kill point:\n{log.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "kill point never reached"
                    time.sleep(0.05)
                time.sleep(wait)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(TIMEOUT)
                    assert proc.returncode == -9
                    return
            finally:
                if proc.poll() is None:
                    proc.kill()
        assert proc.returncode == 0, f"mlmt failed:\n{log.read_text()[-3000:]}"
        shutil.rmtree(out)
        wait /= 2
    raise AssertionError(f"the run ended before the kill {tries} times (seed {SEED}, last delay {wait * 2:.2f}s); "
                         f"the delay should be inside the work:\n{log.read_text()[-2000:]}")


def stderr_has(log: Path, text: str):
    return lambda: log.exists() and text in log.read_text()


def assert_nothing_partial_visible(*roots: Path) -> None:
    """Each snapshot root holds only complete, verified snapshots; a build in progress may
    exist only as a hidden ``.tmp-*`` folder."""
    for root in roots:
        for d in root.iterdir() if root.is_dir() else []:
            if d.name.startswith("."):
                assert d.name.startswith(".tmp-"), d
            elif d.name != "_logs":
                assert d.name.startswith("snap-") and verify_snapshot(d) == [], d


def snapshot_ids(folder: Path) -> list[str]:
    return sorted(p.parent.name for p in folder.rglob("snap-*/manifest.json")
                  if not any(part.startswith(".") for part in p.relative_to(folder).parts))


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        for k, v in load_file(f).items():
            out[f"{f.relative_to(folder)}:{k}"] = v
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta and ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs (seed {SEED})"


def assert_trained(folder: Path) -> None:
    """LoRA's B matrices start at zero: equal tensors prove nothing unless training moved them."""
    b = [v for k, v in tensors(folder).items() if "lora_B" in k]
    assert b and any(bool(v.abs().sum() > 0) for v in b), f"{folder}: no LoRA B moved"


def metric_steps(path: Path) -> list:
    """(step, kind of record) per line: equal lists = nothing logged twice, nothing lost. The kind
    is "timings" or "metrics", not the timing keys themselves: a run killed after its last
    checkpoint resumes with nothing left to train, and its closing timings name only the phases
    that process ran (no update, no checkpoint), which is what it did, not a lost record."""
    return [(r.get("step"), any("/time/" in k for k in r))
            for r in map(json.loads, path.read_text().splitlines())]


def assert_same_metrics(ref: Path, run: Path) -> None:
    files = [m for m in sorted(ref.rglob("metrics.jsonl")) if "_logs" not in m.parts]  # collect logs: per process
    assert files
    for m in files:
        assert metric_steps(run / m.relative_to(ref)) == metric_steps(m), m


# ---------------------------------------------------------------- collect (+ the snapshot train-upper learns from)

COLLECT = ["collect", "--task", "arith", "--limit", "2", "--n-samples", "2", "--engine", "hf", "--greedy",
           "--no-wandb"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    d = tmp_path_factory.mktemp("collect")
    span = mlmt([*COLLECT, "--out", d / "ref", *sets({})], d / "ref.log", stderr_has(d / "ref.log", "problems x"))
    (sid,) = snapshot_ids(d / "ref")
    return d, sid, span


def test_collect_killed_anywhere_leaves_nothing_partial_and_a_rerun_gives_the_same_snapshot(collected):
    d, sid, span = collected
    out, log = d / "cut", d / "cut.log"
    kill_at([*COLLECT, "--out", out, *sets({})], out, log, stderr_has(log, "problems x"), delay("collect", span))
    assert_nothing_partial_visible(out)
    assert snapshot_ids(out) in ([], [sid])
    mlmt([*COLLECT, "--out", out, *sets({})], d / "rerun.log")
    assert snapshot_ids(out) == [sid]
    assert not list(out.glob(".tmp-*"))  # the killed writer's build folder is gone too


# ---------------------------------------------------------------- train-lower

LOWER = {"lower.iterations": 4, "lower.problems_per_iteration": 1, "lower.minibatch_size": 2, "lower.save_every": 1,
         "lower.lr": 1e-2}


def test_train_lower_killed_mid_iteration_resumes_to_the_same_weights_and_snapshots(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "cut"
    args = lambda out: ["train-lower", "--out", out, "--no-wandb", *sets(LOWER)]  # noqa: E731
    # from iteration 1's metrics line on: in a checkpoint write, iteration 2's generate/update/snapshot...
    logged = lambda out: lambda: (out / "metrics.jsonl").exists()  # noqa: E731
    span = mlmt(args(ref), tmp_path / "ref.log", logged(ref))
    kill_at(args(run), run, tmp_path / "cut.log", logged(run), delay("lower", span))
    assert_nothing_partial_visible(run / "snapshots")
    mlmt([*args(run), "--resume"], tmp_path / "resume.log")
    assert_trained(ref / "solver")
    assert_same_tensors(ref / "solver", run / "solver")
    assert snapshot_ids(run) == snapshot_ids(ref) and len(snapshot_ids(run)) == LOWER["lower.iterations"]
    assert_same_metrics(ref, run)
    assert_nothing_partial_visible(run / "snapshots")


# ---------------------------------------------------------------- train-upper

UPPER = {"upper.steps": 6, "upper.batch_size": 2, "upper.warmup_steps": 1, "upper.save_every": 2,
         "upper.log_every": 1, "upper.eval_every": 4}


def upper_args(collected, run) -> list:
    d, sid, _ = collected
    return ["train-upper", "--snapshot", sid, "--root", d / "ref", "--out", run, "--no-wandb", *sets(UPPER)]


def test_train_upper_killed_mid_step_resumes_to_the_same_writer(collected, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "cut"
    logged = lambda out: lambda: (out / "metrics.jsonl").exists()  # noqa: E731
    span = mlmt(upper_args(collected, ref), tmp_path / "ref.log", logged(ref))
    kill_at(upper_args(collected, run), run, tmp_path / "cut.log", logged(run), delay("upper", span))
    mlmt([*upper_args(collected, run), "--resume"], tmp_path / "resume.log")
    assert_trained(ref / "writer")
    assert_same_tensors(ref / "writer", run / "writer")
    assert_same_metrics(ref, run)


# ---------------------------------------------------------------- train-joint

JOINT = {"joint.rounds": 2, "joint.collect_problems": 1, "joint.lower_iterations": 2, "joint.upper_steps": 2,
         "upper.batch_size": 2, "upper.warmup_steps": 1, "upper.eval_every": 2, "upper.log_every": 1,
         "upper.save_every": 1, "lower.problems_per_iteration": 1, "lower.minibatch_size": 2, "lower.save_every": 1}


def test_train_joint_killed_mid_round_resumes_to_the_same_policies_and_snapshots(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "cut"
    args = lambda out: ["train-joint", "--out", out, "--no-wandb", *sets(JOINT)]  # noqa: E731
    # from round 0's snapshot on: anywhere in its upper/lower steps or in round 1
    collected = lambda out: lambda: bool(snapshot_ids(out))  # noqa: E731
    span = mlmt(args(ref), tmp_path / "ref.log", collected(ref))
    kill_at(args(run), run, tmp_path / "cut.log", collected(run), delay("joint", span))
    roots = lambda: [p for p in run.rglob("snapshots") if p.is_dir()]  # noqa: E731
    assert_nothing_partial_visible(*roots())
    mlmt([*args(run), "--resume"], tmp_path / "resume.log")
    for role in ("solver", "writer"):
        assert_trained(ref / role)
        assert_same_tensors(ref / role, run / role)
    key = lambda m: [(r["snapshot"], r["lower_snapshots"], r["upper_snapshots"], r["done"]) for r in m["rounds"]]  # noqa: E731
    manifest = lambda out: json.loads((out / "manifest.json").read_text())  # noqa: E731
    assert key(manifest(run)) == key(manifest(ref))
    assert snapshot_ids(run) == snapshot_ids(ref)
    assert_same_metrics(ref, run)
    # the one timeline (lower/*, upper/*, joint/* on a global step) survives the kill whole: a record
    # per step, none twice, none lost (a resumed stage replays what it kept from before its checkpoint)
    steps = [s for s, _ in metric_steps(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 2 * 3
    assert_nothing_partial_visible(*roots())
