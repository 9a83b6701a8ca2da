"""``task:`` section: which verifiable problems an episode draws, and how they are scored.

``task.name`` is a built-in task, the name of an installed ``tosca_mlmt.tasks`` entry point, or
a ``module:Class`` / ``path/to/file.py:Class`` path; ``task.reward`` optionally replaces the
task's score with a user function (docs/guides/own-task.md). Both paths are resolved when the
config validates (:func:`load_object`: the user's module is imported, once per process, and the
attribute must exist), so a typo is refused before any model loads; this is the one place config/
runs code that is not its own, and only where such a path is configured.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tosca_mlmt.config.knobs import EXISTING_DIR_OR_EMPTY, NON_EMPTY, Rule, knob, path_is
from tosca_mlmt.config.section import Section, need, show
from tosca_mlmt.errors import ConfigError

# The names tosca_mlmt.tasks.registry.TASKS files its built-in tasks under. config/ imports only
# the ground floor (and torch-free stdlib), so it lists them itself; tests/unit/config/test_config.py fails
# when the two differ.
BUILTIN_TASKS = ("arith", "gsm8k", "math500", "mbpp", "jsonl")
ENTRY_POINT_GROUP = "tosca_mlmt.tasks"
ANSWER_FORMATS = ("auto", "raw", "hash", "boxed", "regex")

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# "pkg.module:Name" or "some/file.py:Name"; the attribute may be dotted (Class.factory).
OBJECT_PATH_RE = re.compile(rf"(?:{_DOTTED}|[^:]+\.py):{_DOTTED}")
_ID_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def entry_point_names() -> tuple[str, ...]:
    """Names of the installed ``tosca_mlmt.tasks`` entry points (read from package metadata;
    nothing is imported)."""
    return tuple(sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}))


def task_names() -> tuple[str, ...]:
    """Every name ``task.name`` accepts besides a path: the built-ins, then the entry points
    (a built-in keeps its name: an entry point cannot shadow it)."""
    return BUILTIN_TASKS + tuple(n for n in entry_point_names() if n not in BUILTIN_TASKS)


def object_path_problem(value: str) -> str | None:
    """Why ``value`` cannot name an object to import (``module:attr`` or ``file.py:attr``), or None."""
    if not OBJECT_PATH_RE.fullmatch(value):
        return "must be 'module:attribute' or 'path/to/file.py:attribute'"
    file_ = value.rpartition(":")[0]
    if file_.endswith(".py") and not path_is("file", file_):
        return f"file not found: {file_}"
    return None


def _bad(field: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"invalid value {show(value)} for field '{field}': {why}")


def load_file(path: Path) -> Any:
    """The module of a ``.py`` file, executed once per process: every spec naming the file (a task
    and its reward function; the config's check at load and the registry's build later) gets the
    same module and the same globals."""
    path = path.expanduser().resolve()
    name = "tosca_mlmt_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str, field: str) -> Any:
    """The object ``module:attr`` or ``file.py:attr`` names; a ConfigError naming ``field`` when
    the module cannot be imported or lacks the attribute. The user's module is imported (once per
    process): the config resolves ``task.name`` and ``task.reward`` with it at load, the task
    registry (tasks/registry.py) builds the task from it later."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise _bad(field, spec, "must be 'module:attribute' or 'path/to/file.py:attribute'")
    try:
        module = load_file(Path(module_name)) if module_name.endswith(".py") else importlib.import_module(module_name)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 -- user code: a SystemExit or SyntaxError is a bad value too
        raise _bad(field, spec, f"cannot import {module_name}: {type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _bad(field, spec, f"{module_name} has no attribute {attr!r}") from None
    return obj


def _regex_ok(value: str) -> bool:
    try:
        return not value or re.compile(value).groups <= 1
    except re.error:
        return False


def _template_ok(value: str) -> bool:
    try:
        return not value or "{question}" in value and isinstance(value.format(question=""), str)
    except (KeyError, IndexError, ValueError, AttributeError):
        return False


# the form only: whether the file exists and holds the function, TaskConfig.check says (naming what is missing)
OBJECT_PATH_OR_EMPTY = Rule("empty, 'module:function' or 'path/to/file.py:function'",
                            lambda v: not v or bool(OBJECT_PATH_RE.fullmatch(v)))


@dataclass
class TaskConfig(Section):
    name: str = knob("arith", f"Verifiable task: a built-in ({', '.join(BUILTIN_TASKS)}), the name of an installed "
                              f"'{ENTRY_POINT_GROUP}' entry point, or 'module:Class' / 'path/to/file.py:Class' "
                              "(docs/guides/own-task.md). A path is imported when the config loads: a missing "
                              "file, module or class is refused then.", rule=NON_EMPTY)
    data_path: str = knob("", "Data root for gsm8k/math500/mbpp (default: $TOSCA_MLMT_DATA or ../shared/data).",
                          rule=EXISTING_DIR_OR_EMPTY)
    split: str = knob("train", "Which split to draw problems from. test-unseen (arith only): the test facts in "
                               "phrasings training never uses.", choices=("train", "test", "test-unseen"))
    limit: int = knob(16, "Number of problems (0 = the whole split).", min=0)
    level: int = knob(1, "arith difficulty level (docs: guides/own-task.md lists the levels).", min=1, max=6)
    skip_bad_rows: bool = knob(False, "Drop malformed data rows (counted in the manifest) instead of failing.")
    # ---- the generic `jsonl` task
    path: str = knob("", "jsonl task: a .jsonl or .parquet file, or a folder written by datasets' save_to_disk; "
                         "'{split}' in it is replaced by task.split (required for jsonl).")
    question_key: str = knob("question", "jsonl task: the row key holding the question.", rule=NON_EMPTY)
    answer_key: str = knob("answer", "jsonl task: the row key holding the gold answer (or a worked solution "
                                     "it is extracted from, see task.answer_format).", rule=NON_EMPTY)
    id_key: str = knob("", "jsonl task: a row key holding a stable problem id (empty = the row number).")
    id_prefix: str = knob("", "jsonl task: problem ids are '<prefix>-<id>' (empty = the data file's name without "
                              "its extension).",
                          rule=Rule("empty or letters, digits, '.', '_', '-'",
                                    lambda v: not v or bool(_ID_PREFIX_RE.fullmatch(v))))
    answer_format: str = knob("auto", "jsonl task: how the final answer is written. auto = after '####', "
                                      "'The answer is', in the last \\boxed{} or else the whole field; raw = the "
                                      "whole field; hash = after '####'; boxed = the last \\boxed{}; regex = the "
                                      "last match of task.answer_regex (its group if it has one). Gold answers and "
                                      "responses are read the same way.", choices=ANSWER_FORMATS)
    answer_regex: str = knob("", "jsonl task, answer_format regex: a Python regex with at most one group.",
                             rule=Rule("empty or a valid regex with at most one group", _regex_ok))
    prompt: str = knob("", "jsonl task: the solver's turn-1 message, with '{question}' in it (empty = the question "
                           "and an answer-format line that fits task.answer_format).",
                       rule=Rule("empty or a template holding '{question}' and no other field", _template_ok))
    test_fraction: float = knob(0.2, "jsonl task, when the data holds no splits (no '{split}' in task.path, not a "
                                     "DatasetDict): the share of rows, by a hash of the question, in the test split.",
                                min=0.0, max=1.0)
    # ---- any task
    reward: str = knob("", "A reward function 'module:function' or 'path/to/file.py:function', "
                           "fn(problem, response_text) -> bool | float | Verdict, that replaces the task's score "
                           "(the task still extracts the answer). With a 'context' parameter it also sees the turn, "
                           "round, previous attempt and feedback, and may log_metric() (logged as reward/<name>); "
                           "marked @batched it scores a turn's batch in one call. A call that raises or returns anything else "
                           "scores 0 and is counted (collect summary: reward_errors); it never stops a run. Imported "
                           "when the config loads: a missing file, module or function is refused then.",
                       rule=OBJECT_PATH_OR_EMPTY)

    def check(self, prefix: str) -> None:
        if self.name not in BUILTIN_TASKS:
            names = task_names()
            if self.name not in names:
                if ":" not in self.name:
                    raise ConfigError(f"invalid value {show(self.name)} for field '{prefix}name'; allowed: "
                                      f"{', '.join(names)}, or 'module:Class' / 'path/to/file.py:Class'")
                problem = object_path_problem(self.name)
                if problem:
                    raise ConfigError(f"invalid value {show(self.name)} for field '{prefix}name': {problem}")
                # resolved now, not when the run reaches make_task: a missing module, file or class is
                # refused before any model loads (entry points stay names: importing them is the plugin's cost)
                factory = load_object(self.name, f"{prefix}name")
                if not callable(factory):
                    raise _bad(f"{prefix}name", self.name,
                               f"names a {type(factory).__name__}, not a Task class or factory")
        if self.reward:
            problem = object_path_problem(self.reward)
            if problem:
                raise _bad(f"{prefix}reward", self.reward, problem)
            fn = load_object(self.reward, f"{prefix}reward")
            if not callable(fn):
                raise _bad(f"{prefix}reward", self.reward, f"names a {type(fn).__name__}, not a function")
        need(self.split != "test-unseen" or self.name not in BUILTIN_TASKS or self.name == "arith",
             f"{prefix}split", f"'test-unseen' is arith's split only; task {show(self.name)} has train and test")
        if self.name == "jsonl":
            need(bool(self.path.strip()), f"{prefix}path", "required by task.name 'jsonl' (a .jsonl or .parquet "
                                                           "file, or a datasets folder)")
            where = self.path.replace("{split}", self.split)
            need(path_is("file", where) or path_is("dir", where), f"{prefix}path", f"not found: {where}")
        # impossible row mappings: a gold answer that is its own question, ids that give the gold away
        need(self.answer_key != self.question_key, f"{prefix}answer_key",
             f"{show(self.answer_key)} is also {prefix}question_key: every gold answer would be its own question; "
             "name the row key that holds the answer")
        need(not self.id_key or self.id_key != self.answer_key, f"{prefix}id_key",
             f"{show(self.id_key)} is also {prefix}answer_key: every problem id would give its gold answer away")
        need(self.answer_format != "regex" or bool(self.answer_regex), f"{prefix}answer_regex",
             "required by task.answer_format 'regex'")
