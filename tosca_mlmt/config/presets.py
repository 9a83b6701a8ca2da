"""The shipped presets (top-level ``configs/``) found wherever the package is, and ``-c NAME``.

A wheel installs ``configs/`` as ``tosca_mlmt/configs/`` (pyproject's package-dir and
package-data); a source checkout, editable install included, keeps it next to ``tosca_mlmt/``.
The folder is located on disk rather than imported as a package, because an editable install
made before the mapping existed (or ``PYTHONPATH`` on a checkout) does not know the name
``tosca_mlmt.configs``.

Presets are the YAML files at the top of the folder and under ``cluster/`` (``cluster/8xh100-colocated``);
``deepspeed/`` holds the JSONs ``distributed.deepspeed`` names. ``accelerate/`` and the Slurm
script are inputs to external launchers, which run from a checkout, and are not installed.
"""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.errors import ConfigError

PRESET_GLOBS = ("*.yaml", "cluster/*.yaml")
# How the README and the presets themselves spell paths into the folder (`-c configs/demo.yaml`,
# `distributed.deepspeed: configs/deepspeed/zero2.json`); outside a checkout they still mean it.
_PREFIX = "configs/"


def presets_dir() -> Path | None:
    """The presets folder of this installation, or None when it has none."""
    pkg = Path(__file__).resolve().parent.parent  # tosca_mlmt/
    installed = pkg / "configs"
    if (installed / "mlmt.yaml").is_file():
        return installed
    checkout = pkg.parent / "configs"
    # pyproject.toml beside it: a source tree, not some other package's configs/ in site-packages
    if (checkout / "mlmt.yaml").is_file() and (pkg.parent / "pyproject.toml").is_file():
        return checkout
    return None


def preset_files() -> dict[str, Path]:
    """Preset name (``mlmt``, ``cluster/8xh100-colocated``) -> file, sorted by name."""
    root = presets_dir()
    if root is None:
        return {}
    files = [f for g in PRESET_GLOBS for f in root.glob(g) if f.is_file()]
    return dict(sorted((f.relative_to(root).with_suffix("").as_posix(), f) for f in files))


def describe(path: Path) -> str:
    """A preset's first comment line: what it is for."""
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    except (OSError, UnicodeDecodeError):
        pass
    return ""


def _name(text: str) -> str:
    name = text.replace("\\", "/")
    name = name.removeprefix("./").removeprefix(_PREFIX)
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return name


def find_preset(name: str) -> Path | None:
    """The preset ``name`` (``mlmt``, ``mlmt.yaml`` or ``configs/mlmt.yaml``), or None."""
    return preset_files().get(_name(name))


def _exists(path: str | Path) -> bool | None:
    """None when the OS refuses the name itself (too long, a NUL): the reader reports that."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return None


def resolve_config(path: str | Path) -> Path:
    """``-c VALUE``: a file that exists wins; otherwise the preset of that name; otherwise a
    one-line ConfigError that lists the presets."""
    p = Path(path)
    if _exists(p) is not False:
        return p  # a folder, special file or refused name gets its own message from the reader
    found = find_preset(str(path))
    if found is not None:
        return found
    names = ", ".join(preset_files()) or "none installed"
    raise ConfigError(f"config file not found: {path} (nor a preset of that name); presets: {names}")


def resolve_packaged_file(value: str) -> str:
    """A path a preset names (``configs/deepspeed/zero2.json``) that does not exist here, but is
    in the installed presets folder: that file. Anything else unchanged (validation judges it)."""
    if not isinstance(value, str) or not value or _exists(value) is not False:
        return value
    root = presets_dir()
    rel = value.replace("\\", "/").removeprefix("./")
    if root is None or not rel.startswith(_PREFIX):
        return value
    candidate = root / rel.removeprefix(_PREFIX)
    return str(candidate) if candidate.is_file() else value
