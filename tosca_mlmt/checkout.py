"""A source checkout's own top-level folders serve the subpackages setuptools maps from them.

pyproject.toml installs ``cli/``, ``pipelines/`` and ``configs/`` as ``tosca_mlmt.cli``,
``tosca_mlmt.pipelines`` and ``tosca_mlmt.configs`` (package-dir). An editable install resolves those
three names through a finder that holds the folders of the checkout it was installed from, and
PYTHONPATH moves only ``tosca_mlmt`` itself. So a command run from a second checkout (a git worktree)
under the first one's virtual environment mixed the worktree's library with the first checkout's CLI
and stages, and recorded the worktree's git sha for code it had not run: a learning unit started in a
worktree so that edits could not reach it imported its training loop from the checkout being edited.
A checkout imported from a path now serves the three names from its own folders; an installed wheel
(no pyproject.toml beside the package) is left to setuptools' layout.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

FOLDERS = {"tosca_mlmt.cli": "cli", "tosca_mlmt.pipelines": "pipelines", "tosca_mlmt.configs": "configs"}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the three mapped subpackages in ``root``'s folders; their own submodules then follow the
    found package's ``__path__`` as usual."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in FOLDERS:
            return None
        # PathFinder looks the last name part ("pipelines") up in root: a regular package, or the
        # namespace package configs/ (it has no __init__.py)
        return importlib.machinery.PathFinder.find_spec(fullname, [str(self.root)])


def install(package_dir: Path) -> None:
    """Put a CheckoutFinder for the checkout holding ``package_dir`` first on sys.meta_path, once."""
    root = package_dir.resolve().parent
    if not (root / "pyproject.toml").is_file() or not all((root / f).is_dir() for f in FOLDERS.values()):
        return
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(root))
