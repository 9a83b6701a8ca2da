"""The package's layering, checked on its import graph (README: architecture).

Every ``import`` in the package source counts, those inside functions included: a lazy
import is still a dependency. Modules are named as pyproject installs them (``cli/`` is
``tosca_mlmt.cli``, ``pipelines/`` is ``tosca_mlmt.pipelines``). A *room* is what sits
directly under ``tosca_mlmt``: a subpackage (``algos``, ``lower``, ...) or a top-level
module (``parallel``, ``snapshot``, ...); the rules and the cycle check are between rooms.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT_PKG = "tosca_mlmt"
# Imports nothing of ours; everything else may build on it.
GROUND = {"errors", "fsutil", "parallel", "tensors", "precision", "seeds", "__init__"}
# Orchestration: the stages and the command line sit above the library.
TOP = {"pipelines", "cli"}
# Besides train/ itself, the only rooms that drive an optimiser.
TRAIN_USERS = {"lower", "upper", "pipelines"}
# The learners train from logged records (records.py, snapshots), never by running episodes.
LEARNERS = {"lower", "upper", "train"}
# What cli/ may reach: the stages, the config, and the process set-up it runs before torch loads.
CLI_MAY_IMPORT = {"pipelines", "config", "runtime"} | GROUND


@dataclass(frozen=True)
class Edge:
    file: str  # repo-relative path of the importing file
    line: int
    target: str  # the imported module of ours, dotted

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def _package_dirs() -> dict[str, Path]:
    """Dotted package -> folder, from pyproject's package-dir (what `pip install` maps)."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: REPO / folder for pkg, folder in conf["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file for every module of ours."""
    dirs = _package_dirs()
    out: dict[str, Path] = {}
    for pkg, folder in sorted(dirs.items()):
        for f in folder.rglob("*.py"):
            # a file belongs to the most specific mapped folder that holds it
            if max((d for d in dirs.values() if f.is_relative_to(d)), key=lambda d: len(d.parts)) != folder:
                continue
            name = ".".join((pkg, *f.relative_to(folder).with_suffix("").parts))
            out[name.removesuffix(".__init__")] = f
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in; None when it is not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    rel = str(path.relative_to(REPO))
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in dict.fromkeys(targets):
            target = _resolve(t, modules) if t.split(".")[0] == ROOT_PKG else None
            if target is not None and target != mod:
                edges.append(Edge(rel, node.lineno, target))
    return edges


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    """Importing module -> its imports of our modules."""
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _violations(graph, rooms, allowed) -> list[str]:
    """Imports from a module in ``rooms`` of a room not in ``allowed`` (its own room always is)."""
    bad = []
    for mod, edges in graph.items():
        here = room(mod)
        if here in rooms:
            bad += [f"{e} ({here}/ may not import {room(e.target)}/)" for e in edges
                    if room(e.target) != here and room(e.target) not in allowed]
    return bad


def test_graph_sees_every_room(graph):
    """Guards the test itself: a mapping mistake would make every rule below pass vacuously."""
    rooms = {room(m) for m in graph}
    assert {"algos", "lower", "upper", "train", "cli", "pipelines", "parallel", "tensors", "config", "records",
            "rollout"} <= rooms
    lazy = [e for e in graph["tosca_mlmt.cli.main"] if e.target.startswith("tosca_mlmt.pipelines")]
    assert lazy, "imports inside functions (cli/main.py's commands) are not being read"


def test_ground_floor_imports_nothing_of_ours(graph):
    bad = [f"{e} (the ground floor imports nothing of ours)" for m, edges in graph.items()
           if room(m) in GROUND for e in edges if room(e.target) != room(m)]
    assert not bad, "\n".join(bad)


def test_algos_import_only_the_ground_floor(graph):
    bad = _violations(graph, {"algos"}, GROUND)
    assert not bad, "\n".join(bad)


def test_config_imports_only_the_ground_floor(graph):
    bad = _violations(graph, {"config"}, GROUND)
    assert not bad, "\n".join(bad)


def test_library_does_not_import_pipelines_or_cli(graph):
    bad = [f"{e} (only cli/ may import pipelines/, and nothing imports cli/)" for m, edges in graph.items()
           for e in edges if room(e.target) in TOP and room(e.target) != room(m)
           and not (room(m) == "cli" and room(e.target) == "pipelines")]
    assert not bad, "\n".join(bad)


def test_only_lower_upper_and_pipelines_import_train(graph):
    bad = [f"{e} (only {', '.join(sorted(TRAIN_USERS))} may import train/)" for m, edges in graph.items()
           if room(m) not in TRAIN_USERS | {"train"} for e in edges if room(e.target) == "train"]
    assert not bad, "\n".join(bad)


def test_learners_do_not_import_rollout(graph):
    bad = [f"{e} ({room(m)}/ trains from records; only the stages run rollouts)" for m, edges in graph.items()
           if room(m) in LEARNERS for e in edges if room(e.target) == "rollout"]
    assert not bad, "\n".join(bad)


def test_cli_imports_only_pipelines_and_config(graph):
    bad = _violations(graph, {"cli"}, CLI_MAY_IMPORT)
    assert not bad, "\n".join(bad)


def _cycles(rooms: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(rooms.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(rooms):
        if v not in index:
            visit(v)
    return out


def _room_graph(graph) -> dict[str, set[str]]:
    """Room -> the other rooms it imports."""
    rooms: dict[str, set[str]] = {}
    for m, edges in graph.items():
        here = room(m)
        rooms.setdefault(here, set()).update(room(e.target) for e in edges if room(e.target) != here)
    return rooms


def _loop(rooms: dict[str, set[str]], group: list[str]) -> list[str]:
    """One shortest closed path through group[0] inside ``group`` (breadth-first)."""
    start, parent, queue = group[0], {}, [group[0]]
    while queue:
        v = queue.pop(0)
        for w in sorted(rooms[v] & set(group)):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no loop through {start}")


def _describe(graph, rooms, groups) -> str:
    lines = []
    for group in groups:
        loop = _loop(rooms, group)
        lines.append(f"import cycle between rooms {', '.join(group)}, e.g. {' -> '.join(loop)}:")
        for a, b in zip(loop, loop[1:]):
            lines.append("  " + str(next(e for m, edges in sorted(graph.items()) if room(m) == a
                                         for e in edges if room(e.target) == b)))
    return "\n".join(lines)


def test_no_cycles_between_rooms(graph):
    rooms = _room_graph(graph)
    groups = _cycles(rooms)
    assert not groups, _describe(graph, rooms, groups)
