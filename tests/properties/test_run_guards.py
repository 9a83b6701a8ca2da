"""Runs that survive their surroundings (issue 68, points 8-10): a full disk, a second run on the
same folder, paths the filesystem refuses and values that pass validation only to fail later
are each a one-line ``error:`` (exit 2) before the work, or a clear error naming the disk
with nothing partial left. No test loads a model: where the CLI is used, the error comes first."""

import errno
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from factories import make_episodes
from tosca_mlmt import parallel
from tosca_mlmt.cli.main import app
from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError, MlmtError
from tosca_mlmt.pipelines.support.rundir import RunDir, check_writable
from tosca_mlmt.train.checkpoint import CheckpointManager

Usage = namedtuple("Usage", "total used free")
FULL = "not enough space on the disk of"


@pytest.fixture
def no_model(monkeypatch):
    from tosca_mlmt.models import policies

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(policies.PolicyPair, "__init__", refuse)


def _disk(monkeypatch, free):
    """shutil.disk_usage reports ``free()`` bytes free (a callable: a disk that fills mid-write)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, (10 << 30) - free(), free()))


def _cli(argv):
    res = CliRunner().invoke(app, argv)
    # without the line naming the config the command ran (cli.common.command_config)
    return res, "\n".join(line for line in res.stderr.splitlines() if not line.startswith("config: "))


def _one_error_line(res, stderr, *needles):
    assert res.exit_code == 2, (res.exit_code, stderr, res.exception)
    assert stderr.startswith("error:") and "Traceback" not in stderr, stderr
    for n in needles:
        assert n in stderr, stderr


# ---------------------------------------------------------------- 8. a full disk


def _adapter(folder):
    (folder / "adapter.safetensors").write_bytes(b"x" * 4096)


def test_a_checkpoint_on_a_full_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    ckm = CheckpointManager(tmp_path, keep=3)
    ckm.save(1, _adapter, {"iteration": 1})
    _disk(monkeypatch, lambda: 1000)
    with pytest.raises(OSError, match=FULL) as e:
        ckm.save(2, _adapter, {"iteration": 2})
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "checkpoints") in str(e.value)
    assert "1000 bytes free" in str(e.value) and "needed" in str(e.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-000001"]
    assert ckm.latest().name == "step-000001"


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4054"),  # torch.save
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_a_checkpoint_write_that_fills_the_disk_is_a_clear_error_and_leaves_the_last_one(tmp_path, monkeypatch,
                                                                                        failure):
    ckm = CheckpointManager(tmp_path, keep=3)
    ckm.save(1, _adapter, {"iteration": 1})
    free = [1 << 30]
    _disk(monkeypatch, lambda: free[0])

    def fills_the_disk(folder):
        _adapter(folder)
        free[0] = 0
        raise failure

    with pytest.raises(OSError, match=FULL) as e:
        ckm.save(2, fills_the_disk, {"iteration": 2})
    assert e.value.errno == errno.ENOSPC and "step-000002" in str(e.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-000001"]  # no partial folder
    assert ckm.latest().name == "step-000001"


def test_an_unrelated_runtime_error_in_a_checkpoint_write_stays_what_it_is(tmp_path):
    def bug(folder):
        raise RuntimeError("a bug, with the disk empty")

    with pytest.raises(RuntimeError, match="a bug"):
        CheckpointManager(tmp_path).save(1, bug, {})


def test_a_stage_on_a_full_disk_is_refused_before_any_work(tmp_path, monkeypatch, no_model):
    _disk(monkeypatch, lambda: 5 << 20)
    with pytest.raises(MlmtError, match=FULL):
        check_writable(tmp_path / "run")
    res, err = _cli(["train-lower", "--no-wandb", "--out", str(tmp_path / "run")])
    _one_error_line(res, err, FULL, "needed")
    assert not (tmp_path / "run").exists()


def test_a_snapshot_write_that_fills_the_disk_is_an_error_line_naming_it(tmp_path, monkeypatch):
    """The probe: every episode generated, then the snapshot's parquet write fails (pyarrow's OSError)."""
    from tosca_mlmt.pipelines import collect as collect_mod
    from tosca_mlmt.store import write_snapshot

    def full(*a, **kw):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    def collect(cfg, console=None, **kw):
        RunDir(cfg.collect.out, "collect", console, what="collect.out")
        monkeypatch.setattr(pq, "write_table", full)  # the episodes are played; the write fails
        write_snapshot(cfg.collect.out, make_episodes(), {})

    monkeypatch.setattr(collect_mod, "collect", collect)
    root = tmp_path / "snaps"
    res, err = _cli(["collect", "--no-wandb", "--out", str(root)])
    _one_error_line(res, err, FULL, str(root), "No space left on device")
    assert os.listdir(root) == []  # the build folder went with the failure



def test_a_snapshot_is_refused_before_its_write_when_the_disk_lacks_room(tmp_path, monkeypatch):
    """train-lower writes a snapshot every iteration: the check runs before each write, not only at start."""
    from tosca_mlmt.fsutil import NoSpaceError
    from tosca_mlmt.store import write_snapshot

    root = tmp_path / "snaps"
    write_snapshot(root, make_episodes(), {})  # room: written
    before = sorted(os.listdir(root))
    _disk(monkeypatch, lambda: 5 << 20)
    with pytest.raises(NoSpaceError, match=FULL):
        write_snapshot(root, make_episodes()[:1], {})
    assert sorted(os.listdir(root)) == before  # nothing half-written, the earlier snapshot intact

# ---------------------------------------------------------------- 9. one run per folder

HOLDER = """
import sys, time
from tosca_mlmt.config import load_config
from tosca_mlmt.pipelines.support.rundir import RunDir
rd = RunDir(sys.argv[1], "train-lower")  # held while the stage (this process) runs
rd.check(load_config(), False, ())
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture
def holder(tmp_path):
    """A process that opened ``tmp_path/run`` as train-lower does and holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(tmp_path, holder):
    with pytest.raises(MlmtError, match=rf"in use by another run \(pid {holder.pid} on "):
        RunDir(tmp_path / "run", "train-lower").check(load_config(), False, ())


def test_cli_second_train_lower_on_the_same_out_is_refused_before_the_model_loads(tmp_path, holder, no_model):
    res, err = _cli(["train-lower", "--no-wandb", "--out", str(tmp_path / "run")])
    _one_error_line(res, err, "in use by another run", f"pid {holder.pid}")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_lock_left_by_a_killed_run_is_stale_and_taken_over(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = tmp_path / "run" / ".mlmt.lock"
    assert f"pid {holder.pid}" in lock.read_text()  # the killed run's file is still there
    rd = RunDir(tmp_path / "run", "train-lower")
    assert rd.check(load_config(), False, ()) is False
    assert lock.read_text().startswith(f"pid {os.getpid()} on ")
    rd.close()
    assert os.listdir(tmp_path / "run") == []  # the lock file goes with the lock


def test_the_lock_is_held_until_close_and_a_used_folder_keeps_its_files(tmp_path):
    import fcntl

    run = tmp_path / "run"
    rd = RunDir(run, "train-lower")
    rd.check(load_config(), False, ())
    rd.claim(load_config())
    fd = os.open(run / ".mlmt.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    rd.close()
    assert sorted(os.listdir(run)) == ["config.yaml"]  # the lock file goes with the lock
    with pytest.raises(MlmtError, match="already holds a train-lower run"):  # and the refusal lets go too
        RunDir(run, "train-lower").check(load_config(), False, ())
    assert sorted(os.listdir(run)) == ["config.yaml"]


def test_only_rank_0_locks_and_every_rank_learns_its_outcome(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel, "is_main", lambda: False)
    monkeypatch.setattr(parallel, "broadcast", lambda obj: f"{tmp_path} is in use by another run (pid 1 on h)")
    with pytest.raises(MlmtError, match="in use by another run"):
        RunDir(tmp_path, "train-lower").check(load_config(), False, ())
    assert os.listdir(tmp_path) == []  # rank 1 made no lock file of its own


# ---------------------------------------------------------------- 10. values and paths refused up front


def test_a_lora_target_modules_regex_that_does_not_compile_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules.*not a regular expression"):
        load_config(overrides={"model.lora.target_modules": "("})
    assert load_config(overrides={"model.lora.target_modules": r".*\.(q|v)_proj"})  # a pattern that compiles


def test_a_per_update_writer_warm_up_as_long_as_the_update_is_refused_at_load():
    over = {"joint.writer_warmup": "update", "joint.upper_steps": 20}
    with pytest.raises(ConfigError, match=r"upper\.warmup_steps.*20 steps per update"):
        load_config(overrides={**over, "upper.warmup_steps": 20})
    load_config(overrides={**over, "upper.warmup_steps": 19})
    for fine in ({"upper.text_loss": "none"}, {"joint.freeze_writer": True}, {"joint.writer_warmup": "run"}):
        load_config(overrides={**over, "upper.warmup_steps": 50, **fine})


def test_an_out_name_too_long_for_the_filesystem_is_an_error_line(tmp_path, no_model):
    long = tmp_path / ("a" * 300)
    for p in (long, long / "sub"):
        with pytest.raises(MlmtError, match="longer than"):
            check_writable(p)
    res, err = _cli(["train-lower", "--no-wandb", "--out", str(long)])
    _one_error_line(res, err, "longer than")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["collect", "--task", "arith", "--limit", "1"], ["train-lower"], ["train-joint"],
                                  ["eval", "--limit", "1"]])
def test_an_empty_out_is_an_error_line_not_the_current_folder(tmp_path, monkeypatch, no_model, argv):
    monkeypatch.chdir(tmp_path)
    res, err = _cli([*argv, "--no-wandb", "--out", ""])
    _one_error_line(res, err, "--out is empty")
    assert os.listdir(tmp_path) == []
    with pytest.raises(MlmtError, match="is empty"):
        check_writable("")
