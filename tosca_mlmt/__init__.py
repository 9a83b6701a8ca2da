"""tosca-mlmt: hierarchical RL (feedback writer + solver) for reasoning with textual feedback.

A source checkout's own top-level folders serve the subpackages setuptools maps from them.
pyproject.toml installs ``cli/``, ``pipelines/`` and ``configs/`` as ``tosca_mlmt.cli``,
``tosca_mlmt.pipelines`` and ``tosca_mlmt.configs`` (package-dir). An editable install resolves those
three names through a finder holding the folders of the checkout it was installed from, and
PYTHONPATH moves only ``tosca_mlmt`` itself. So a command run from a second checkout (a git worktree)
under the first one's virtual environment mixed the worktree's library with the first checkout's CLI
and stages, and recorded the worktree's git sha for code it had not run: a learning unit started in a
worktree so that edits could not reach it imported its training loop from the checkout being edited.
A checkout imported from a path now serves the three names from its own folders; an installed wheel
(no pyproject.toml beside the package) is left to setuptools' layout.
"""

import importlib.machinery as _machinery
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

_FOLDERS = {"tosca_mlmt.cli": "cli", "tosca_mlmt.pipelines": "pipelines", "tosca_mlmt.configs": "configs"}


class _CheckoutFinder:
    """Finds the three mapped subpackages in ``root``'s folders; their submodules then follow the found
    package's ``__path__`` as usual. A meta path finder needs only find_spec: subclassing
    importlib.abc.MetaPathFinder would add ~8 ms to every ``import tosca_mlmt`` for nothing."""

    def __init__(self, root: _Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _FOLDERS:
            return None
        # PathFinder looks the last part ("pipelines") up in root: a regular package, or the namespace
        # package configs/ (no __init__.py)
        return _machinery.PathFinder.find_spec(fullname, [str(self.root)])


def _install_checkout_finder() -> None:
    root = _Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or not all((root / f).is_dir() for f in _FOLDERS.values()):
        return
    if not any(isinstance(f, _CheckoutFinder) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutFinder(root))


_install_checkout_finder()
