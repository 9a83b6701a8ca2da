"""The package's layering, checked on its import graph (README: architecture).

Every ``import`` in the package source counts, those inside functions included: a lazy
import is still a dependency. Modules are named as pyproject installs them (``cli/`` is
``tosca_mlmt.cli``, ``pipelines/`` is ``tosca_mlmt.pipelines``). A *room* is what sits
directly under ``tosca_mlmt``: a subpackage (``algos``, ``lower``, ...) or a top-level
module (``parallel``, ``records``, ...); the rules and the cycle check are between rooms.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT_PKG = "tosca_mlmt"
# Imports nothing of ours; everything else may build on it.
GROUND = {"errors", "fsutil", "parallel", "tensors", "precision", "seeds", "__init__"}
# Orchestration: the stages and the command line sit above the library.
TOP = {"pipelines", "cli"}
# Besides train/ itself, the only rooms that drive an optimiser.
TRAIN_USERS = {"lower", "upper", "pipelines"}
# The learners train from logged records (records.py, store/ snapshots), never by running episodes.
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
            "rollout", "store"} <= rooms
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


def _module_cycles_within_rooms(graph) -> tuple[dict[str, set[str]], list[list[str]]]:
    """Module -> the modules of its own room it imports, and the strongly connected groups in that."""
    within = {m: {e.target for e in edges if room(e.target) == room(m)} for m, edges in graph.items()}
    return within, _cycles(within)


def test_no_cycles_between_modules_within_a_room(graph):
    """Inside a room too, a module's helpers live below it: two modules that import each other (lazily
    or not) are one module in two files, and neither can be read or tested without the other."""
    within, groups = _module_cycles_within_rooms(graph)
    lines = []
    for group in groups:
        loop = _loop(within, group)
        lines.append(f"import cycle between modules {', '.join(group)}, e.g. {' -> '.join(loop)}:")
        lines += [f"  {next(e for e in graph[a] if e.target == b)}" for a, b in zip(loop, loop[1:])]
    assert not groups, "\n".join(lines)


def test_no_test_module_imports_another():
    """Tests share helpers through tests/factories.py and tests/conftest.py only: a test module that
    imports another (``from test_snapshot import make_episodes``) breaks when that one moves or
    is renamed, and runs its collection-time code besides. Lazy imports count too."""
    tests = REPO / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] in names or (parts[0] == "tests" and any(p in names for p in parts[1:])):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {target}")
    assert not found, "move what they share into tests/factories.py (or a conftest.py fixture):\n" + "\n".join(found)


# The house: families of modules live in folders, files and stage functions stay readable.
ROOMS_WITH_FOLDERS = ("tosca_mlmt.tasks.sandbox", "tosca_mlmt.rollout.engines.vllm", "tosca_mlmt.store",
                      "tosca_mlmt.pipelines.support")
MAX_FILE_LINES = 400
MAX_STAGE_FUNCTION_LINES = 40


def test_families_live_in_folders():
    """Three or more library modules named by one prefix (``sandbox_*.py``, ``vllm_*.py``,
    ``snapshot_*.py``) are a family that wants a folder: the reader sees one room, not a prefix."""
    modules = _modules()
    assert all(m in modules and modules[m].name == "__init__.py" for m in ROOMS_WITH_FOLDERS), \
        "the folders the layout promises (docs/design/architecture.md) are missing"
    families: dict[tuple[Path, str], list[str]] = {}
    for path in modules.values():
        stem = path.stem.strip("_")
        if "_" in stem and path.is_relative_to(REPO / ROOT_PKG):
            families.setdefault((path.parent, stem.split("_")[0]), []).append(path.name)
    bad = [f"{folder.relative_to(REPO)}/{prefix}_*: {', '.join(sorted(names))}"
           for (folder, prefix), names in sorted(families.items()) if len(names) >= 3]
    assert not bad, "module families named by a prefix; give each a folder:\n" + "\n".join(bad)


def test_no_library_file_over_400_lines():
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in sorted(_modules().values())
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines; split them along a seam:\n" + "\n".join(long)


def test_stage_functions_are_short():
    """A stage is orchestration of named steps (pipelines/support/stage.py): a function that runs
    past a screen is doing a step's work inline."""
    long = []
    for mod, path in sorted(_modules().items()):
        if room(mod) != "pipelines":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_STAGE_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"stage functions over {MAX_STAGE_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_unit_tests_mirror_the_source():
    """tests/unit/<a>/<b>/ holds the tests of tosca_mlmt/<a>/<b>/ (tests/README.md): a folder
    there with no package behind it is a test a reader will not find."""
    unit = REPO / "tests" / "unit"
    orphans = [str(d.relative_to(REPO)) for d in sorted(unit.rglob("*")) if d.is_dir() and d.name != "__pycache__"
               and not (REPO / ROOT_PKG / d.relative_to(unit) / "__init__.py").exists()]
    assert not orphans, "test folders with no package of that name under tosca_mlmt/:\n" + "\n".join(orphans)
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), "test file names must be unique (pytest's default import mode)"
