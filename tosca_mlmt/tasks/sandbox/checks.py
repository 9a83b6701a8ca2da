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
as a whole, and one whose comparisons would run there (``all(f(x) == y for x, y in data)``
over data the planner cannot unroll) is refused: the test fails with that reason, and the
MBPP loader refuses such a row. Rebuilt values and the parent's arithmetic on them are
bounded in ``values.py``.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import sys
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from tosca_mlmt.tasks.sandbox.values import (arith, bounded_sum, CheckFailed, decode, Forgery, no_flood, Raised,
                                           safe_repr)

# Names whose meaning differs between the candidate's namespace and a fresh one.
_NAMESPACE_DEPENDENT = {"globals", "locals", "vars", "dir", "eval", "exec", "compile", "open", "input",
                        "breakpoint", "help", "exit", "quit", "__import__", "__build_class__", "__name__"}
_BUILTIN_NAMES = frozenset(dir(builtins)) - _NAMESPACE_DEPENDENT
_STDLIB_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) - {"__main__", "antigravity", "this"}
_TRUSTED = _BUILTIN_NAMES | _STDLIB_MODULES
_SAFE_CALLS = {
    "math.isclose": (math.isclose, {"rel_tol", "abs_tol"}),
    "len": (len, set()), "sorted": (sorted, {"reverse"}), "set": (lambda x: set(no_flood(x)), set()),
    "frozenset": (lambda x: frozenset(no_flood(x)), set()), "list": (list, set()), "tuple": (tuple, set()),
    "abs": (abs, set()), "bool": (bool, set()), "min": (min, {"default"}), "max": (max, {"default"}),
    "sum": (bounded_sum, {"start"}), "any": (any, set()), "all": (all, set()),
}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNROLL_LIMIT = 1000  # items of a literal iterable an all()/any() over a comprehension is unrolled for
# Structure that decides an assert's truth; computed by the candidate's process it could be forged.
_DECIDING = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp,
             ast.DictComp)


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
    """Splits every test; collects the judge's expressions across tests.

    An operand is on the candidate's side when it uses a name the code defines, other than
    a built-in or standard module it rebinds, or a name the test itself binds. Every other
    operand of such a comparison or call is an expected value: a literal, or the judge's to
    compute in its fresh fork. So code that rebinds ``set`` or defines a class ``math``
    cannot pull ``set((4, 5))`` or ``math.isclose`` into its own process. Only where no
    operand qualifies (a solution named ``sum`` under ``assert sum(5, 2) == 3``) does a
    rebound built-in count as the candidate's.
    """

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
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            plan.error = f"{type(e).__name__}: {e}"
            return plan
        bound, own = set(self.setup_bound), self.setup_bound - _TRUSTED
        for stmt in module.body:
            self.scope = (bound, own)
            if isinstance(stmt, ast.Assert):
                child_sources: list[str] = []
                tree = self._split(stmt.test, plan, child_sources)
                plan.steps.append(["eval", child_sources])
                plan.checks.append((ast.get_source_segment(source, stmt) or ast.unparse(stmt), tree))
            else:
                plan.steps.append(["exec", ast.get_source_segment(source, stmt) or ast.unparse(stmt)])
                bound |= _bound_names(stmt)
                own |= _bound_names(stmt)
        return plan

    def _sides(self, operands: list, fallback: bool = True) -> list[bool]:
        """Which operands are the candidate's (class doc); the rest are expected values."""
        strong = [self._mine(n) for n in operands]
        return strong if any(strong) or not fallback else [self._needs_candidate(n) for n in operands]

    def _split(self, node: ast.expr, plan: TestPlan, child_sources: list[str], expected_side: bool = False):
        """The check tree of ``node``. ``expected_side``: a sibling operand is the candidate's,
        so this one, if not a literal, is an expected value, for the judge."""
        def split_all(operands, sides):
            return tuple(self._split(n, plan, child_sources, any(sides) and not s) for n, s in zip(operands, sides))

        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            return Node("compare", split_all(operands, self._sides(operands)), tuple(type(op) for op in node.ops))
        if not expected_side and self._structured(node):
            if isinstance(node, ast.BinOp):
                operands = [node.left, node.right]
                return Node("binop", split_all(operands, self._sides(operands, False)), (_ARITH[type(node.op)],))
            unrolled = self._unroll(node)
            if unrolled is not None:  # all(f(x) == y for x, y in <literal>): one check per item
                kind, items = unrolled
                inner = Node(kind, tuple(self._split(e, plan, child_sources) for e in items)) if items else \
                    Leaf("literal", value=kind == "and")
                return Node("call", (inner,), (bool, ()))
            operands = [*node.args, *(k.value for k in node.keywords)]
            return Node("call", split_all(operands, self._sides(operands, False)),
                        (self._safe_call(node), tuple(k.arg for k in node.keywords)))
        if isinstance(node, ast.BoolOp):
            return Node("and" if isinstance(node.op, ast.And) else "or",
                        tuple(self._split(n, plan, child_sources) for n in node.values))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Node("not", (self._split(node.operand, plan, child_sources),))
        return self._leaf(node, plan, child_sources, expected_side)

    def _structured(self, node: ast.expr) -> bool:
        """Whether the parent computes ``node`` from its parts: arithmetic or a pure built-in
        call on the candidate's values that also takes expected ones (``abs(f(x) - 2.5)``,
        ``math.isclose(f(x), 2.5)``), or all()/any() of an unrollable comprehension.

        On the candidate's values alone (``sorted(f(x))``) there is nothing to forge, and the
        sandbox computes it with Python's exact semantics (on a generator, say)."""
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call) and self._unroll(node) is not None:
            return True
        elif isinstance(node, ast.Call) and self._safe_call(node) is not None:
            operands = [*node.args, *(k.value for k in node.keywords)]
        else:
            return False
        sides = self._sides(operands, False)
        return any(sides) and (not all(sides) or any(self._structured(n) for n in operands))

    def _safe_call(self, node: ast.Call):
        """The function of a pure built-in call the parent may evaluate, else None."""
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        name = _dotted(node.func)
        if name not in _SAFE_CALLS or name.split(".")[0] in self.scope[1]:
            return None
        fn, allowed = _SAFE_CALLS[name]
        return fn if all(k.arg in allowed for k in node.keywords) else None

    def _unroll(self, node: ast.Call):
        """("and"|"or", checks) for ``all``/``any`` of one comprehension over a literal or a
        range of literals, each check the element with the item's values put in; else None."""
        name = _dotted(node.func)
        if name not in ("all", "any") or name in self.scope[1] or len(node.args) != 1 or node.keywords:
            return None
        comp = node.args[0]
        if not isinstance(comp, (ast.GeneratorExp, ast.ListComp)) or len(comp.generators) != 1:
            return None
        gen = comp.generators[0]
        if gen.ifs or gen.is_async or not self._mine(comp.elt):
            return None
        try:
            if isinstance(gen.iter, ast.Call) and _dotted(gen.iter.func) == "range" and "range" not in self.scope[0] \
                    and not gen.iter.keywords:
                bounds = [ast.literal_eval(a) for a in gen.iter.args]
                if not all(type(b) is int for b in bounds) or len(range(*bounds)) > _UNROLL_LIMIT:
                    return None
                items = list(range(*bounds))
            else:
                items = ast.literal_eval(gen.iter)
                items = list(items) if isinstance(items, (list, tuple, set, frozenset, str)) else None
            if items is None or len(items) > _UNROLL_LIMIT:
                return None
            return ("and" if name == "all" else "or"), [_substitute(comp.elt, gen.target, v) for v in items]
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None

    def _mine(self, node: ast.expr) -> bool:
        """Whether ``node`` uses a name of the candidate's own (not a rebound built-in)."""
        free = _free_names(node)
        return bool(free & self.scope[1]) or not free <= _TRUSTED

    def _needs_candidate(self, node: ast.expr) -> bool:
        try:
            ast.literal_eval(node)
            return False
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        free = _free_names(node)
        return bool(free & self.scope[0]) or not free <= _TRUSTED

    def _leaf(self, node: ast.expr, plan: TestPlan, child_sources: list[str], expected_side: bool) -> Leaf:
        source = ast.unparse(node)
        try:
            return Leaf("literal", value=ast.literal_eval(node), source=source)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        # Elsewhere (``assert os.path.exists(p)``) the leaf is about the sandbox's state
        # after the code ran, which only the sandbox can see.
        if expected_side:
            modules = sorted(_free_names(node) & _STDLIB_MODULES - _BUILTIN_NAMES)
            self.judge_items.append({"source": source, "modules": modules})
            return Leaf("judge", index=len(self.judge_items) - 1, source=source)
        if self._mine(node) and self._decides_inside(node) and not plan.error:
            # all(f(x) == y for x, y in data) would compare inside the candidate's process.
            plan.error = f"this check cannot be judged outside the code's process: {source[:300]}"
        child_sources.append(source)
        plan.n_values += 1
        return Leaf("child", index=plan.n_values - 1, source=source)

    def _decides_inside(self, node: ast.AST) -> bool:
        """Whether comparisons or branches of the test, not of the candidate's inputs, sit in ``node``."""
        if isinstance(node, _DECIDING):
            return True
        if isinstance(node, ast.Call) and self._mine(node.func):
            return self._decides_inside(node.func)  # its arguments are the candidate's inputs
        return any(self._decides_inside(n) for n in ast.iter_child_nodes(node))


def _substitute(elt: ast.expr, target: ast.expr, value: Any) -> ast.expr:
    """``elt`` with the comprehension's target names replaced by ``value``'s parts, as literals."""
    names: dict[str, Any] = {}
    if isinstance(target, ast.Name):
        names[target.id] = value
    elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
            and isinstance(value, (tuple, list)) and len(value) == len(target.elts):
        names.update((t.id, v) for t, v in zip(target.elts, value))
    else:
        raise ValueError("an unpacking this planner does not unroll")
    literals = {}
    for name, v in names.items():
        literal = ast.parse(repr(v), mode="eval").body
        if ast.literal_eval(literal) != v:  # nan, inf: no literal says them
            raise ValueError("a value without a literal")
        literals[name] = literal

    class Put(ast.NodeTransformer):
        def visit_Name(self, n):
            return deepcopy(literals[n.id]) if n.id in literals and isinstance(n.ctx, ast.Load) else n

    return ast.fix_missing_locations(Put().visit(deepcopy(elt)))


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


# --- judging -----------------------------------------------------------------------------


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
    args = [_evaluate(child, values, expected) for child in node.children]
    if node.kind == "binop":
        return arith(node.ops[0], *args)
    fn, keywords = node.ops
    n_positional = len(args) - len(keywords)
    return fn(*args[:n_positional], **dict(zip(keywords, args[n_positional:])))


def _leaves(node):
    if isinstance(node, Leaf):
        yield node
    else:
        for child in node.children:
            yield from _leaves(child)

