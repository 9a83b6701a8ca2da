"""Hub-style model ids (``org/name`` or ``org/name@revision``) found in the local HF cache.

Nothing is ever downloaded: the id must already sit in huggingface_hub's cache layout,
``<cache>/models--org--name/snapshots/<commit>/`` with ``refs/<branch>`` naming the commit
of a branch. We read that layout ourselves instead of calling ``snapshot_download``:
huggingface_hub freezes its cache location when it is imported, and we want the error to
name every folder we looked in.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tosca_mlmt.errors import ModelError

# org/name as the hub allows them, optionally @revision (a branch, tag or commit hash)
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def split_id(name: str) -> tuple[str, str | None] | None:
    """(repo, revision or None) for a hub-style id; None for anything else."""
    m = _ID.fullmatch(name)
    return (m["repo"], m["rev"]) if m else None


def cache_dirs() -> list[Path]:
    """The hub caches to search, most specific first, read from the environment at call time
    (HF_HUB_CACHE, the older HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, then the default)."""
    env = os.environ
    out = [Path(env[k]) for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") if env.get(k)]
    if env.get("HF_HOME"):
        out.append(Path(env["HF_HOME"]) / "hub")
    xdg = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    out.append(xdg / "huggingface" / "hub")
    return list(dict.fromkeys(p.expanduser() for p in out))


def _repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _commit(repo_dir: Path, rev: str) -> str | None:
    """The snapshot folder name for ``rev``: a branch/tag via refs/, else a (prefix of a) commit."""
    ref = repo_dir / "refs" / rev
    if ref.is_file():
        return ref.read_text().strip()
    if (repo_dir / "snapshots" / rev).is_dir():
        return rev
    if len(rev) >= 7 and re.fullmatch(r"[0-9a-f]+", rev):  # a short hash, as `git log` prints it
        hits = [p.name for p in (repo_dir / "snapshots").glob(rev + "*") if p.is_dir()]
        if len(hits) == 1:
            return hits[0]
    return None


def _complete(snap: Path) -> bool:
    return (snap / "config.json").is_file() and (any(snap.glob("*.safetensors")) or any(snap.glob("*.bin")))


def resolve_hub_id(name: str) -> Path:
    """The local snapshot folder of ``org/name[@revision]`` (revision defaults to main).
    Raises ModelError naming the id and every folder searched when it is not cached whole."""
    parts = split_id(name)
    if parts is None:
        raise ModelError(f"'{name}' is not a hub id (org/name or org/name@revision)")
    repo, rev = parts
    looked = []
    for cache in cache_dirs():
        repo_dir = cache / _repo_folder(repo)
        looked.append(str(repo_dir))
        commit = _commit(repo_dir, rev or "main") if repo_dir.is_dir() else None
        if commit and _complete(repo_dir / "snapshots" / commit):
            return repo_dir / "snapshots" / commit
    at = "" if rev is None else f" at revision '{rev}'"
    raise ModelError(f"model '{name}': no local folder of that name and not in the local Hugging Face cache{at} "
                     f"(looked in {', '.join(looked)}; a snapshot needs config.json and weights); nothing is "
                     "downloaded at run time: fetch it on a "
                     f"machine with network (`huggingface-cli download {repo}`) and point HF_HUB_CACHE or HF_HOME "
                     "at that cache")


def hub_id_of(folder: Path) -> tuple[str, str] | None:
    """(repo, commit) when ``folder`` is a snapshot inside a hub cache, else None."""
    parts = Path(os.path.abspath(folder)).parts  # not resolve(): snapshot files are symlinks into blobs/
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3].removeprefix("models--").split("--", 1)
        if len(org_name) == 2:
            return "/".join(org_name), parts[-1]
    return None
