"""DeepSpeed JSON handling: "auto" fields come from the trainer's knobs, never silently disagree."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.train.distributed import deepspeed_config_path, fill_deepspeed_config

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3-offload"])
def test_shipped_configs_get_their_batch_fields_from_the_trainer(name):
    conf = json.loads((REPO / "configs" / "deepspeed" / f"{name}.json").read_text())
    out = fill_deepspeed_config(conf, micro_size=4, local_micros=2, max_grad_norm=0.5, bf16=True, source=name)
    # one process here: train = micro x accumulation x world
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"],
            out["gradient_clipping"]) == (4, 2, 8, 0.5)
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert conf["train_batch_size"] == "auto"  # the shipped file itself is left alone


def test_an_explicit_value_that_disagrees_is_refused():
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' is 4 but the trainer's config implies 2"):
        fill_deepspeed_config({"gradient_accumulation_steps": 4}, 4, 2, 1.0, False, "x.json")
    ok = fill_deepspeed_config({"gradient_accumulation_steps": 2}, 4, 2, 1.0, False, "x.json")
    assert ok["gradient_accumulation_steps"] == 2


def test_accelerate_launch_deepspeed_config_is_picked_up(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert deepspeed_config_path("") == ""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/deepspeed/zero2.json")
    assert deepspeed_config_path("") == "configs/deepspeed/zero2.json"
    assert deepspeed_config_path("mine.json") == "mine.json"  # the mlmt config wins


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    # torch's FileBaton waits forever on <ext>/lock; a killed JIT build leaves it behind
    from tosca_mlmt.train.distributed import STALE_BUILD_LOCK_S, clear_stale_build_locks

    old, live = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (old, live):
        lock.parent.mkdir()
        lock.touch()
    aged = old.stat().st_mtime - STALE_BUILD_LOCK_S - 1
    os.utime(old, (aged, aged))
    with pytest.warns(UserWarning, match="stale torch-extension build lock"):
        removed = clear_stale_build_locks(tmp_path)
    assert removed == [old] and not old.exists() and live.exists()


def test_each_environment_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    # one shared folder made a second virtual environment rebuild the op over the first's (a build's
    # command lines name the environment's include paths), and the first rebuild it back on its next run
    import sys

    import torch

    from tosca_mlmt.train import distributed

    monkeypatch.setenv("TOSCA_MLMT_CACHE", str(tmp_path))
    folders = {}
    for prefix, version in (("/venvs/a", "2.13.0+cpu"), ("/venvs/b", "2.13.0+cpu"), ("/venvs/a", "2.14.0")):
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(sys, "prefix", prefix)
        monkeypatch.setattr(torch, "__version__", version)
        distributed._deepspeed_build_dir()
        folders[prefix, version] = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert len(set(folders.values())) == 3
    assert all(f.parent == tmp_path / "torch_extensions" for f in folders.values())
    monkeypatch.setattr(sys, "prefix", "/venvs/a")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert distributed.environment_key() == folders["/venvs/a", "2.13.0+cpu"].name  # stable within one
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))  # the user's choice wins
    distributed._deepspeed_build_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_the_op_mlmt_setup_builds_is_the_one_a_deepspeed_start_loads(monkeypatch):
    """`mlmt setup` (make install) builds DeepSpeed's CPU comm op so that the first distributed run does
    not: a fresh process starting DeepSpeed must load that build as it is, not rebuild it (ninja
    relinks when the build's command lines differ, e.g. another extensions folder or flags)."""
    import subprocess
    import sys

    from tosca_mlmt.train.distributed import prebuild_deepspeed_ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # the default, as a run sees it; restored after
    folder = prebuild_deepspeed_ops()
    if folder is None:
        pytest.skip("DeepSpeed's CPU comm op does not apply to this machine")
    (so,) = Path(folder).glob("*.so")
    built = so.stat().st_mtime_ns
    start = ("from tosca_mlmt.train.distributed import _deepspeed_build_dir; _deepspeed_build_dir(); "
             "from deepspeed.comm.torch import build_shm_op; print(build_shm_op().__file__)")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=900, env=env,
                         check=True).stdout.strip().splitlines()[-1]
    assert Path(out) == so and so.stat().st_mtime_ns == built
