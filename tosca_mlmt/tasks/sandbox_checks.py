"""The trusted half of test checking: split asserts, rebuild reported values, compare.

Each test is parsed here, in the parent. Statements other than ``assert`` run in the
sandbox as they are. An ``assert`` is split into a small tree of comparisons, ``and``/
``or``/``not`` and a few pure built-in calls (``math.isclose``, ``len``, ``sorted``...)
whose leaves are expressions. A leaf is computed in one of three places:

* literals (``ast.literal_eval``) here, so the expected value never enters the sandbox;
* expressions that use only built-ins and standard modules (``sys.getsizeof(t)``) in a
  fork of the sandboxed child taken before the candidate's code is loaded ("judge");
* everything else, i.e. whatever depends on the candidate's names, in the sandbox after
  the code is loaded, reported as a type-tagged value.

The tree is then evaluated here on rebuilt values of exact built-in types, so no code
the candidate wrote runs in a comparison: an object whose ``__eq__`` always returns True
arrives as an opaque value that equals nothing. Only expressions this module cannot split
(a call to a helper the test itself defines, say) are judged by the candidate's process
as a whole.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

# Names whose meaning differs between the candidate's namespace and a fresh one.
_NAMESPACE_DEPENDENT = {"globals", "locals", "vars", "dir", "eval", "exec", "compile", "open", "input",
                        "breakpoint", "help", "exit", "quit", "__import__", "__build_class__", "__name__"}
_BUILTIN_NAMES = frozenset(dir(builtins)) - _NAMESPACE_DEPENDENT
_STDLIB_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) - {"__main__", "antigravity", "this"}
_SAFE_CALLS = {
    "math.isclose": (math.isclose, {"rel_tol", "abs_tol"}),
    "len": (len, set()), "sorted": (sorted, {"reverse"}), "set": (set, set()), "frozenset": (frozenset, set()),
    "list": (list, set()), "tuple": (tuple, set()), "abs": (abs, set()), "bool": (bool, set()),
    "min": (min, {"default"}), "max": (max, {"default"}), "sum": (sum, {"start"}),
    "any": (any, set()), "all": (all, set()),
}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
MAX_DEPTH = 80


class Forgery(Exception):
    """The result channel carried something the honest runner never writes."""


@dataclass(frozen=True)
class Opaque:
    """A value of a type the checker does not rebuild; it equals nothing but itself."""

    type_name: str
    text: str
    truth: bool

    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __bool__(self):
        return self.truth

    def __repr__(self):
        return f"<{self.type_name} object: {self.text}>"


@dataclass(frozen=True)
class Raised:
    """Evaluating a leaf raised; the text is the traceback."""

    text: str


# --- planning --------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    where: str  # "literal" | "judge" | "child"
    index: int = -1  # judge: into the expected values; child: into the test's values
    value: Any = None  # literal only
    source: str = ""


@dataclass(frozen=True)
class Node:
    kind: str  # "compare" | "and" | "or" | "not" | "call"
    children: tuple
    ops: tuple = ()  # compare: ast op types; call: (function, keyword names)


@dataclass
class TestPlan:
    source: str
    steps: list = field(default_factory=list)  # for the child: ["exec", src] / ["eval", [src, ...]]
    checks: list = field(default_factory=list)  # (assert source, tree)
    n_values: int = 0
    error: str = ""  # set when the test cannot run (syntax error)


class Planner:
    """Splits every test; collects the judge's expressions across tests."""

    def __init__(self, code: str, setup: str):
        self.judge_items: list[dict[str, Any]] = []
        # Names the code or setup define mean their own objects in the tests (a solution
        # may well define ``sum``), so expressions using them are the sandbox's to compute.
        self.setup_bound: set[str] = set()
        for source in (code, setup):
            try:
                self.setup_bound |= _bound_names(ast.parse(source))
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                pass  # it then fails to load in the child, and no test runs

    def plan(self, source: str) -> TestPlan:
        plan = TestPlan(source)
        try:
            module = ast.parse(source)
        except (SyntaxError, ValueError) as e:
            plan.error = f"{type(e).__name__}: {e}"
            return plan
        bound = set(self.setup_bound)
        for stmt in module.body:
            if isinstance(stmt, ast.Assert):
                child_sources: list[str] = []
                tree = self._split(stmt.test, bound, plan, child_sources)
                plan.steps.append(["eval", child_sources])
                plan.checks.append((ast.get_source_segment(source, stmt) or ast.unparse(stmt), tree))
            else:
                plan.steps.append(["exec", ast.get_source_segment(source, stmt) or ast.unparse(stmt)])
                bound |= _bound_names(stmt)
        return plan

    def _split(self, node: ast.expr, bound: set[str], plan: TestPlan, child_sources: list[str],
               expected_side: bool = False):
        """The check tree of ``node``. ``expected_side``: a sibling operand depends on the
        candidate, so a leaf free of its names is an expected value, for the judge."""
        if isinstance(node, (ast.Compare, ast.Call)):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else \
                [*node.args, *(k.value for k in node.keywords)]
            needs = [self._needs_candidate(n, bound) for n in operands]
            if isinstance(node, ast.Compare):
                return Node("compare", tuple(self._split(n, bound, plan, child_sources, any(needs))
                                             for n in operands), tuple(type(op) for op in node.ops))
            mixed = any(needs) and not all(needs)
            fn = self._safe_call(node, bound)
            if fn is not None and mixed:
                return Node("call", tuple(self._split(n, bound, plan, child_sources, mixed) for n in operands),
                            (fn, tuple(k.arg for k in node.keywords)))
        if isinstance(node, ast.BoolOp):
            return Node("and" if isinstance(node.op, ast.And) else "or",
                        tuple(self._split(n, bound, plan, child_sources) for n in node.values))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Node("not", (self._split(node.operand, bound, plan, child_sources),))
        return self._leaf(node, bound, plan, child_sources, expected_side)

    @staticmethod
    def _safe_call(node: ast.Call, bound: set[str]):
        """The function of a pure built-in call the parent may evaluate, else None.

        The caller splits only a call that mixes the candidate's values with expected
        ones, as in ``math.isclose(f(x), 2.5)``; on the candidate's values alone
        (``sorted(f(x))``) there is nothing to forge, and the sandbox computes it with
        Python's exact semantics (on a generator, say, which the parent cannot rebuild).
        """
        if any(isinstance(a, ast.Starred) for a in node.args):
            return None
        name = _dotted(node.func)
        if name not in _SAFE_CALLS or name.split(".")[0] in bound:
            return None
        fn, allowed = _SAFE_CALLS[name]
        return fn if all(k.arg in allowed for k in node.keywords) else None

    @staticmethod
    def _needs_candidate(node: ast.expr, bound: set[str]) -> bool:
        try:
            ast.literal_eval(node)
            return False
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        free = _free_names(node)
        return bool(free & bound) or not free <= _BUILTIN_NAMES | _STDLIB_MODULES

    def _leaf(self, node: ast.expr, bound: set[str], plan: TestPlan, child_sources: list[str],
              expected_side: bool) -> Leaf:
        source = ast.unparse(node)
        try:
            return Leaf("literal", value=ast.literal_eval(node), source=source)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        # Elsewhere (``assert os.path.exists(p)``) the leaf is about the sandbox's state
        # after the code ran, which only the sandbox can see.
        if expected_side and not self._needs_candidate(node, bound):
            modules = sorted(_free_names(node) & _STDLIB_MODULES - _BUILTIN_NAMES)
            self.judge_items.append({"source": source, "modules": modules})
            return Leaf("judge", index=len(self.judge_items) - 1, source=source)
        child_sources.append(source)
        plan.n_values += 1
        return Leaf("child", index=plan.n_values - 1, source=source)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


def _free_names(node: ast.AST) -> set[str]:
    loaded, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return loaded - bound


def _bound_names(tree: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Import):
            # ``import math`` binds the very module a test's ``math.pi`` means.
            names.update((a.asname or a.name).split(".")[0] for a in n.names
                         if a.asname not in (None, a.name) or a.name.split(".")[0] not in _STDLIB_MODULES)
        elif isinstance(n, ast.ImportFrom):
            names.update(a.asname or a.name for a in n.names)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            names.update(n.names)
    return names


# --- values ------------------------------------------------------------------------------


def decode(node: Any, depth: int = 0) -> Any:
    """Rebuild a value the child encoded; anything the honest encoder never writes is a forgery."""
    if depth > MAX_DEPTH or not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise Forgery("malformed value")
    tag, args = node[0], node[1:]
    try:
        if tag == "none" and not args:
            return None
        if tag == "bool" and len(args) == 1 and isinstance(args[0], bool):
            return args[0]
        if tag == "raised" and len(args) == 1 and isinstance(args[0], str) and depth == 0:
            return Raised(args[0])
        if all(isinstance(a, str) for a in args):
            if tag == "int" and len(args) == 1:
                return int(args[0], 16)
            if tag == "float" and len(args) == 1:
                return float.fromhex(args[0])
            if tag == "complex" and len(args) == 2:
                return complex(float.fromhex(args[0]), float.fromhex(args[1]))
            if tag == "str" and len(args) == 1:
                return args[0]
            if tag == "bytes" and len(args) == 1:
                return bytes.fromhex(args[0])
            if tag == "decimal" and len(args) == 1:
                return Decimal(args[0])
            if tag == "fraction" and len(args) == 2:
                return Fraction(int(args[0], 16), int(args[1], 16))
        if tag == "object" and len(args) == 3 and isinstance(args[0], str) and isinstance(args[1], str) \
                and isinstance(args[2], bool):
            return Opaque(args[0], args[1], args[2])
        if len(args) == 1 and isinstance(args[0], list):
            if tag == "dict":
                return {decode(_pair(p)[0], depth + 1): decode(_pair(p)[1], depth + 1) for p in args[0]}
            items = [decode(x, depth + 1) for x in args[0]]
            container = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}.get(tag)
            if container is not None:
                return container(items)
    except (ValueError, TypeError, ArithmeticError) as e:  # bad hex, unhashable set element, ...
        raise Forgery(f"malformed {tag} value") from e
    raise Forgery(f"malformed {tag} value")


def _pair(p: Any) -> list:
    if not isinstance(p, list) or len(p) != 2:
        raise Forgery("malformed dict value")
    return p


def safe_repr(value: Any, limit: int = 200) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long for str()
        text = f"<int with {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


# --- judging -----------------------------------------------------------------------------


class CheckFailed(Exception):
    pass


def run_checks(plan: TestPlan, values: list[Any], expected: list[Any]) -> str:
    """"" when every assert of the test holds, else why the first one does not."""
    for source, tree in plan.checks:
        try:
            holds = bool(_evaluate(tree, values, expected))
            why = "" if holds else "AssertionError" + _got(tree, values)
        except CheckFailed as e:
            why = str(e)
        except Exception as e:  # a comparison of mismatched types, say
            why = f"{type(e).__name__}: {e}"
        if why:
            # A test of one statement is quoted whole by the caller already.
            return why if len(plan.steps) == 1 else f"in {source}:\n{why}"
    return ""


def _got(tree, values: list[Any]) -> str:
    got = "; ".join(f"{leaf.source} -> {safe_repr(values[leaf.index])}"
                    for leaf in _leaves(tree) if leaf.where == "child")
    return f" (got {got})" if got else ""


def _evaluate(node, values: list[Any], expected: list[Any]) -> Any:
    if isinstance(node, Leaf):
        if node.where == "literal":
            return node.value
        value = values[node.index] if node.where == "child" else expected[node.index]
        if isinstance(value, Raised):
            where = "computing the expected value " if node.where == "judge" else ""
            raise CheckFailed(f"{where}{node.source} raised:\n{value.text}")
        return value
    if node.kind == "compare":
        left = _evaluate(node.children[0], values, expected)
        for op, child in zip(node.ops, node.children[1:]):
            right = _evaluate(child, values, expected)
            if not _COMPARE[op](left, right):
                return False
            left = right
        return True
    if node.kind in ("and", "or"):
        result = None
        for child in node.children:
            result = _evaluate(child, values, expected)
            if bool(result) == (node.kind == "or"):
                return result
        return result
    if node.kind == "not":
        return not _evaluate(node.children[0], values, expected)
    fn, keywords = node.ops
    args = [_evaluate(child, values, expected) for child in node.children]
    n_positional = len(args) - len(keywords)
    return fn(*args[:n_positional], **dict(zip(keywords, args[n_positional:])))


def _leaves(node):
    if isinstance(node, Leaf):
        yield node
    else:
        for child in node.children:
            yield from _leaves(child)
