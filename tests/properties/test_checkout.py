"""A checkout imported from a path serves cli/, pipelines/ and configs/ from its own folders, even under
a virtual environment whose editable install names another checkout's (tosca_mlmt/__init__.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib

from conftest import REPO

PROBE = ("import json, tosca_mlmt, tosca_mlmt.cli.common as c, tosca_mlmt.pipelines as p, "
         "tosca_mlmt.pipelines.collect as pc, tosca_mlmt.configs as g; "
         "print(json.dumps([tosca_mlmt.__file__, c.__file__, p.__file__, pc.__file__, list(g.__path__), p.WHERE]))")


def test_a_second_checkout_on_pythonpath_runs_its_own_stages_and_cli(tmp_path):
    other = tmp_path / "worktree"
    for folder in ("tosca_mlmt", "cli", "pipelines", "configs"):
        shutil.copytree(REPO / folder, other / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", other / "pyproject.toml")
    # an edit that exists only in the second checkout: a run from it must see it
    init = other / "pipelines" / "__init__.py"
    init.write_text(init.read_text() + "\nWHERE = 'worktree'\n")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(other)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(str(f).startswith(str(other)) for f in files[:4]), files
    assert files[4] == [str(other / "configs")] and files[5] == "worktree"


def test_an_installed_layout_without_pyproject_is_left_to_setuptools(tmp_path):
    """No pyproject.toml beside the package (a wheel's site-packages): nothing is installed, so the
    names resolve as setuptools laid them out (here: the editable install's, this repository's)."""
    other = tmp_path / "site"
    shutil.copytree(REPO / "tosca_mlmt", other / "tosca_mlmt", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("cli", "pipelines", "configs"):
        (other / folder).mkdir()
    env = dict(os.environ, PYTHONPATH=str(other))
    code = ("import sys, tosca_mlmt, tosca_mlmt.pipelines as p; from tosca_mlmt import _CheckoutFinder as CheckoutFinder; "
            "print(any(isinstance(f, CheckoutFinder) for f in sys.meta_path), p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found, where = out.stdout.split()
    assert found == "False" and not where.startswith(str(other))


def test_the_finders_folders_are_pyprojects_package_dirs():
    """The finder names the same subpackage -> folder pairs as pyproject.toml's package-dir, so a folder
    mapped there is served from the checkout too (and each folder is the name's last part, which is what
    PathFinder looks up)."""
    import tosca_mlmt

    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert tosca_mlmt._FOLDERS == {k: v for k, v in dirs.items() if k != "tosca_mlmt"}
    assert all(name.rpartition(".")[2] == folder for name, folder in tosca_mlmt._FOLDERS.items())
