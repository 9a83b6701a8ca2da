"""Presets ship with the package and are selectable by name (`-c mlmt`), outside the repository too."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_mlmt
from tosca_mlmt.config import load_config
from tosca_mlmt.config.presets import find_preset, preset_files, resolve_packaged_file
from tosca_mlmt.errors import ConfigError


def test_every_preset_file_is_listed_by_name():
    names = set(preset_files())
    on_disk = {p.stem for p in (REPO / "configs").glob("*.yaml")} | {"cluster/8xh100-colocated"}
    assert names == on_disk
    assert find_preset("mlmt") == find_preset("mlmt.yaml") == find_preset("configs/mlmt.yaml")


def test_config_by_name_resolves_from_a_folder_outside_the_repository(tmp_path):
    p = run_mlmt("config", "-c", "demo", cwd=tmp_path, check=True)
    cfg = yaml.safe_load(p.stdout)
    assert cfg["engine"]["name"] == "vllm" and cfg["task"]["level"] == 2  # demo over its include: mlmt.yaml
    # the cluster preset names configs/deepspeed/zero2.json: from here, the shipped copy
    p = run_mlmt("config", "-c", "cluster/8xh100-colocated", cwd=tmp_path, check=True)
    ds = Path(yaml.safe_load(p.stdout)["distributed"]["deepspeed"])
    assert ds.is_absolute() and ds.is_file() and ds.name == "zero2.json"


def test_an_unknown_name_is_one_error_line_listing_the_presets(tmp_path):
    p = run_mlmt("config", "-c", "mlmtt", cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "config file not found: mlmtt" in lines[0]
    assert "presets: archer, cluster/8xh100-colocated, demo" in lines[0]


def test_list_presets_shows_each_with_its_first_comment_line(tmp_path):
    p = run_mlmt("config", "--list-presets", cwd=tmp_path, check=True)
    rows = dict(line.split(None, 1) for line in p.stdout.splitlines())
    assert set(rows) == set(preset_files())
    assert rows["upper"] == "mlmt train-upper: offline strategic Q-learning + AWR for the feedback writer."


def test_an_existing_path_wins_over_the_preset_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "mlmt").write_text("seed: 7\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("mlmt").seed == 7
    assert load_config("mlmt.yaml").task.name == "arith"  # no such file here: the preset


def test_own_file_may_include_a_preset_by_name(tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text("include: upper\nupper:\n  steps: 3\n")
    cfg = load_config(own)
    assert cfg.upper.steps == 3 and cfg.upper.batch_size == 16 and cfg.engine.name == "vllm"  # upper <- demo
    with pytest.raises(ConfigError, match="config file not found"):
        own.write_text("include: no-such-preset\n")
        load_config(own)


def test_packaged_file_fallback_only_for_paths_into_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_packaged_file("configs/deepspeed/zero1.json")).is_file()
    assert resolve_packaged_file("elsewhere/zero1.json") == "elsewhere/zero1.json"  # validation names it
    assert resolve_packaged_file("configs/deepspeed/nope.json") == "configs/deepspeed/nope.json"
    assert resolve_packaged_file("") == ""


def _source_copy(dst: Path) -> Path:
    """What an sdist would hold: the build must not leave build/ or *.egg-info in the checkout."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dst / name)
    for name in ("cli", "pipelines", "configs"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    # tosca_mlmt/cli and tosca_mlmt/pipelines may be local symlinks in a worktree: pyproject maps them
    shutil.copytree(REPO / "tosca_mlmt", dst / "tosca_mlmt",
                    ignore=lambda d, names: [n for n in names if n == "__pycache__" or os.path.islink(os.path.join(d, n))])
    return dst


def test_wheel_ships_the_presets_and_finds_them_installed(tmp_path):
    src = _source_copy(tmp_path / "src")
    whl = tmp_path / "whl"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(whl),
                    str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(whl.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in (REPO / "configs").glob("*.yaml"):
        assert f"tosca_mlmt/configs/{p.name}" in names
    assert {"tosca_mlmt/configs/cluster/8xh100-colocated.yaml", "tosca_mlmt/configs/deepspeed/zero2.json"} <= names
    assert not any("configs/accelerate/" in n for n in names)  # inputs to launchers, run from a checkout
    # Installed (unpacked on the path ahead of this checkout), from a folder with no configs/ in reach:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import tosca_mlmt.config.presets as p; from tosca_mlmt.config import load_config; "
            "print(p.presets_dir()); print(load_config('cluster/8xh100-colocated').distributed.deepspeed)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(site)), timeout=120).stdout.split()
    assert out[0] == str(site / "tosca_mlmt" / "configs")
    assert out[1] == str(site / "tosca_mlmt" / "configs" / "deepspeed" / "zero2.json")


def test_selector_preset_sends_every_strategy_as_its_sentence_alone():
    """mlmt-selector is mlmt with the writer reduced to choosing a sentence: a strategy added to the
    defaults without joining prefix_only would silently bring the writer's own text back."""
    sel, full = load_config(REPO / "configs" / "mlmt-selector.yaml"), load_config(REPO / "configs" / "mlmt.yaml")
    assert sorted(sel.episode.prefix_only) == sorted(s["name"] for s in sel.episode.strategies)
    assert all("prefix" in s for s in sel.episode.strategies)
    assert full.episode.prefix_only == ["confirm"]
    assert sel.lower == full.lower and sel.upper == full.upper and sel.joint == full.joint
    # and nothing else differs: the benchmark's mlmt-sentences-only units are this configuration
    assert dataclasses.replace(sel, episode=dataclasses.replace(sel.episode, prefix_only=full.episode.prefix_only)) == full


def test_demo_selector_and_demo_text_differ_in_the_writers_text_alone():
    """configs/demo-selector.yaml (`make demo` until 2026-12-07) trains the writer as a pure selector;
    configs/demo-text.yaml is the measured alternative (the demo before 2026-11-26) and differs from it
    in nothing but which strategies are sent as their sentence alone, so their stored numbers compare one choice."""
    demo, text = load_config(REPO / "configs" / "demo-selector.yaml"), load_config(REPO / "configs" / "demo-text.yaml")
    sel, full = load_config(REPO / "configs" / "mlmt-selector.yaml"), load_config(REPO / "configs" / "mlmt.yaml")
    assert demo.episode.prefix_only == sel.episode.prefix_only and text.episode.prefix_only == full.episode.prefix_only
    assert demo.engine.name == "vllm" and demo.task.level == 2
    assert dataclasses.replace(demo, episode=dataclasses.replace(demo.episode, prefix_only=text.episode.prefix_only)) == text


def test_no_preset_is_the_combination_the_loader_warns_about():
    """The KL as a reward under grpo's std division collapsed SCoRe (configs/score.yaml until it moved the KL
    into the loss): no shipped preset may load with that warning (or any other ConfigWarning)."""
    import warnings

    for name in preset_files():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_config(name)
