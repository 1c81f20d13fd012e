"""A code test, judged outside the program: what goes into each of its two boxes (the
verdict on what comes back is verdict.py).

A test is one of:

- **a script** whose top-level `assert`s are the checks (`assert f(2) == 4`). It is split
  in two, statement by statement. The *program's box* runs the program, then only what
  the program must compute: the *leaves* of each assert (the smallest expressions rooted
  in the program: `f(2)`, `Solution().solve([3, 1])`, a name the program holds) and the
  test statements their inputs need; it sends the leaves' values back as plain, tagged
  JSON. The *judge box* runs the test's own code alone, every statement in order, with
  each leaf replaced by the value the program's box sent: the expected side, the
  comparison and the test's helpers run where the program never ran, so nothing it
  patches (`math.exp`, `builtins.all`, `isinstance`), no object it makes (an `__eq__`
  that is always true) and nothing it reads from the test's setup decides a pass. Here,
  in the trainer, nothing is evaluated: records are checked and forwarded.

  Names are tracked in order. *Test* names are bound by the test (assignments, imports,
  defs, loop targets), plus builtins and stdlib modules the test uses unbound (the
  boxes import those themselves). *Program* names are all others (`f`, `Solution`).
  A test data name passed into the program (read inside a leaf: the program may mutate
  it) or bound to a leaf (`r = f(3)`) is *held* by the program's box from then on: each
  later read of it is a leaf, so `a = [3, 1, 2]; sort_in_place(a); assert a == [1, 2, 3]`
  reads `a` from the box. HumanEval's `def check(candidate)` with asserts in its body,
  called once as `check(name)`, is unrolled into top-level asserts first.
- **a stdin/stdout case** `{"input": ..., "output": ...}`: the program reads the input and
  passes when its stdout equals the output (trailing whitespace of each line and trailing
  blank lines ignored) and it exits 0.

A script the two boxes cannot judge apart is refused (UnjudgeableTest) with the line, the
reason and what to write instead: see `_refuse` callers in `_Splitter`.
"""

from __future__ import annotations

import ast
import builtins
import copy
import sys
from dataclasses import dataclass
from typing import Any

_BUILTINS = frozenset(dir(builtins))
_STDLIB = frozenset(sys.stdlib_module_names)
# Test-side calls that would turn the program's data into code, names or files.
_UNSAFE = frozenset(
    ("eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "vars",
     "globals", "locals", "open", "breakpoint", "input")
)  # fmt: skip
_UNSAFE_LOADS = frozenset(("pickle", "marshal", "shelve", "dill", "cloudpickle"))
_CONTROL = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
            ast.TryStar, ast.Match)  # fmt: skip
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_VALUE, _EMIT, _VERDICT = "__looprl_value__", "__looprl_emit__", "__looprl_verdict__"


class UnjudgeableTest(ValueError):
    """A test that could only be judged inside the program's interpreter."""


@dataclass(frozen=True)
class Site:
    """One top-level assert: where it is, and how many leaves the program computes."""

    line: int
    source: str
    leaves: int


@dataclass(frozen=True)
class ScriptTest:
    program_script: str  # runs after the program, in its box: the leaves and their inputs
    judge_script: str  # runs alone in the judge box, on the program's values
    sites: list[Site]


@dataclass(frozen=True)
class StdioTest:
    input: str
    output: str


Test = ScriptTest | StdioTest


def parse_test(test: Any) -> Test:
    """The test as something judged outside the program; raises UnjudgeableTest (or
    ValueError for a malformed one) saying why not."""
    if isinstance(test, dict):
        if set(test) != {"input", "output"} or not all(isinstance(v, str) for v in test.values()):
            raise ValueError(
                f"a stdin/stdout test is {{'input': str, 'output': str}}, got {test!r:.200}"
            )
        return StdioTest(test["input"], test["output"])
    if not isinstance(test, str):
        raise ValueError(f"a test is a script or an {{input, output}} case, got {test!r:.200}")
    try:
        module = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"the test does not parse: {e}") from None
    body = _split_tuple_assignments(_unroll_check(module).body)
    return _Splitter(body, test).split()


def _unroll_check(module: ast.Module) -> ast.Module:
    """HumanEval's form, `def check(candidate): <asserts>` then `check(name)` once, as
    top-level asserts on `name`."""
    defs = {s.name: s for s in module.body if isinstance(s, ast.FunctionDef)}
    calls = [
        s for s in module.body
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
        and isinstance(s.value.func, ast.Name) and s.value.func.id in defs
    ]  # fmt: skip
    if len(calls) != 1 or len(calls[0].value.args) != 1 or calls[0].value.keywords:
        return module
    call = calls[0]
    check = defs[call.value.func.id]
    arguments = check.args
    if len(arguments.args) != 1 or arguments.vararg or arguments.kwarg or arguments.kwonlyargs:
        return module
    parameter, argument = arguments.args[0].arg, call.value.args[0]

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return ast.copy_location(argument, node) if node.id == parameter else node

    body = [Rename().visit(statement) for statement in check.body]
    rest = [s for s in module.body if s is not check and s is not call]
    return ast.fix_missing_locations(ast.Module(body=rest + body, type_ignores=[]))


def _split_tuple_assignments(body: list[ast.stmt]) -> list[ast.stmt]:
    """`a, b = X, Y` as `a = X` and `b = Y` where X and Y do not read a or b, so the
    program's box gets only the one it needs."""
    out = []
    for s in body:
        target = s.targets[0] if isinstance(s, ast.Assign) and len(s.targets) == 1 else None
        if (
            isinstance(target, ast.Tuple | ast.List)
            and isinstance(s.value, ast.Tuple | ast.List)
            and len(target.elts) == len(s.value.elts)
            and all(isinstance(t, ast.Name) for t in target.elts)
            and not any(isinstance(v, ast.Starred) for v in s.value.elts)
            and not {t.id for t in target.elts} & _loads(s.value)
            and len({t.id for t in target.elts}) == len(target.elts)
        ):
            for name, value in zip(target.elts, s.value.elts, strict=True):
                out.append(ast.copy_location(ast.Assign([name], value), s))
        else:
            out.append(s)
    return out


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _bound(node: ast.AST) -> set[str]:
    """Every name `node` binds anywhere inside it (its own scopes included)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and n.name:
            names.add(n.name)
    return names


def _refuse(node: ast.AST, source: str, why: str) -> UnjudgeableTest:
    text = (ast.get_source_segment(source, node) or ast.unparse(node)).split("\n")[0]
    return UnjudgeableTest(f"line {node.lineno}: `{text[:120]}` {why}")


@dataclass
class _Entry:
    """One statement of the program's box, or a candidate for it."""

    statement: ast.stmt
    program: bool  # involves the program: always in its box
    binds: set[str]  # names it binds or may change
    rebinds: set[str]  # names it binds afresh (their earlier values are not needed)
    reads: set[str]
    setup: bool = False  # a call that reads only modules (`sys.setrecursionlimit(...)`)


class _Splitter:
    """Walks a script's statements in order, classing each name as the test's, the
    program's or held by the program's box, and builds both boxes' scripts."""

    def __init__(self, body: list[ast.stmt], source: str):
        self.body, self.source = body, source
        self.kind: dict[str, str] = {}  # name -> "data", "fixed" (import/def) or "held"
        self.bound_anywhere = set().union(*(_bound(s) for s in body)) if body else set()
        # Stdlib modules used as `module.attribute` and never bound: imported by the boxes.
        attribute_roots = {
            n.value.id for s in body for n in ast.walk(s)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
        }  # fmt: skip
        self.modules = (attribute_roots & _STDLIB) - self.bound_anywhere
        self.entries: list[_Entry] = []
        self.judge: list[ast.stmt] = []
        self.sites: list[Site] = []

    # ---- names ---------------------------------------------------------------------

    def program_side(self, name: str) -> bool:
        kind = self.kind.get(name)
        if kind is not None:
            return kind == "held"
        return name not in _BUILTINS and name not in self.modules

    def involves(self, node: ast.AST, local: frozenset[str] = frozenset()) -> bool:
        """Whether evaluating `node` reads a program or held name (`local`: the
        enclosing comprehensions' and lambdas' own variables)."""
        if isinstance(node, ast.Name):
            return (
                isinstance(node.ctx, ast.Load)
                and node.id not in local
                and (self.program_side(node.id))
            )
        if isinstance(node, ast.Lambda):
            inner = local | _bound(node.args)
            defaults = [*node.args.defaults, *filter(None, node.args.kw_defaults)]
            return any(self.involves(d, local) for d in defaults) or self.involves(node.body, inner)
        if isinstance(node, _COMPREHENSIONS):
            first, inner = node.generators[0].iter, local | _comprehension_names(node)
            rest = [c for c in ast.iter_child_nodes(node) if c is not node.generators[0]]
            rest += [c for c in ast.iter_child_nodes(node.generators[0]) if c is not first]
            return self.involves(first, local) or any(self.involves(c, inner) for c in rest)
        return any(self.involves(c, local) for c in ast.iter_child_nodes(node))

    def is_leaf(self, node: ast.AST, local: frozenset[str]) -> bool:
        match node:
            case ast.Name():
                return self.involves(node, local)
            case ast.Call(func=func):
                return self.involves(func, local)
            case ast.Attribute(value=value) | ast.Subscript(value=value):
                return self.involves(value, local)
        return False

    # ---- the walk ------------------------------------------------------------------

    def split(self) -> ScriptTest:
        for statement in self.body:
            self.statement(statement)
        if not self.sites:
            raise UnjudgeableTest(
                "the test has no top-level assert on what the program computes: a test is "
                "judged by its top-level asserts or is a stdin/stdout case"
            )
        used = set().union(*(_loads(s) for s in self.judge))
        judge = [_import(m) for m in sorted(self.modules & used)] + self.judge
        program = self.program_statements()
        used = set().union(*(_loads(s) for s in program)) if program else set()
        program = [_import(m) for m in sorted(self.modules & used)] + program
        return ScriptTest(_unparse(program), _unparse(judge), self.sites)

    def statement(self, statement: ast.stmt) -> None:
        if isinstance(statement, ast.Assert):
            return self.assertion(statement)
        for node in ast.walk(statement):
            if isinstance(node, ast.Assert):
                raise _refuse(
                    node,
                    self.source,
                    f"is inside a {type(statement).__name__.lower()} statement: only top-level "
                    "asserts are judged outside the program; write each check as a top-level "
                    "assert, or use stdin/stdout cases",
                )
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return self.definition(statement)
        if isinstance(statement, ast.Import | ast.ImportFrom):
            names = _bound(statement)
            self.test_only(statement, names, names, fixed=True)
            return None
        if isinstance(statement, _CONTROL):
            names = _bound(statement)
            if self.involves(statement, frozenset(names)):
                raise _refuse(
                    statement,
                    self.source,
                    "uses the program inside control flow (if/for/while/with/try), which "
                    "would run in the program's box; write each check as a top-level assert "
                    "on a call with literal arguments",
                )
            return self.test_only(statement, names | _loads(statement), names)
        if not self.involves(statement):
            return self.simple_test_statement(statement)
        return self.program_statement(statement)

    def assertion(self, statement: ast.Assert) -> None:
        if not self.involves(statement.test):
            if isinstance(statement.test, ast.Constant):  # HumanEval's `assert True, "..."`
                self.judge.append(statement)
                return
            raise _refuse(
                statement,
                self.source,
                "does not check anything the program computes (no name or call in it is the "
                "program's); assert on the program's results, e.g. `assert f(2) == 4`",
            )
        site = len(self.sites)
        leaves: list[ast.expr] = []
        expression = _Leaves(self, site, leaves).visit(copy.deepcopy(statement.test))
        for node in ast.walk(expression):
            if isinstance(node, ast.Compare) and all(
                _has_value(side) for side in [node.left, *node.comparators]
            ):
                raise _refuse(
                    statement,
                    self.source,
                    "compares values that all come from the program's box, which could make "
                    "them agree; compare the program's value with a literal (or a name the "
                    "test binds to one)",
                )
        emit = ast.Call(
            ast.Name(_EMIT, ast.Load()),
            [ast.Constant(site), *[ast.Lambda(_no_arguments(), leaf) for leaf in leaves]],
            [],
        )
        reads = set().union(*(_loads(leaf) for leaf in leaves))
        self.entries.append(_Entry(ast.Expr(emit), True, set(), set(), reads))
        verdict = ast.Call(
            ast.Name(_VERDICT, ast.Load()),
            [ast.Constant(site), ast.Lambda(_no_arguments(), expression)],
            [],
        )
        self.judge.append(ast.Expr(verdict))
        text = ast.get_source_segment(self.source, statement) or ast.unparse(statement)
        self.sites.append(Site(statement.lineno, text[:200], len(leaves)))
        self.hold(reads)

    def definition(self, statement: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        outside = [*statement.decorator_list]
        if isinstance(statement, ast.ClassDef):
            outside += [*statement.bases, *(k.value for k in statement.keywords)]
        else:
            outside += [*statement.args.defaults, *filter(None, statement.args.kw_defaults)]
        if any(self.involves(node) for node in outside):
            raise _refuse(
                statement,
                self.source,
                "uses the program in its decorators, bases or defaults; define the test's "
                "helpers from the test's own values",
            )
        inside = _bound(statement)
        for name in sorted(_loads(statement) - inside):
            held = self.kind.get(name) == "held"
            if held or (
                name not in self.bound_anywhere
                and name not in _BUILTINS
                and name not in self.modules
            ):
                what = "class" if isinstance(statement, ast.ClassDef) else "function"
                raise _refuse(
                    statement, self.source,
                    f"is the test's own {what} "
                    f"but uses `{name}`, which the program defines or computes: its body "
                    "would judge with the program's code; pass the program's result to it "
                    f"as an argument instead (`{statement.name}(f(3))`)",
                )  # fmt: skip
        self.test_only(statement, {statement.name}, {statement.name}, fixed=True)

    def simple_test_statement(self, statement: ast.stmt) -> None:
        stored = _bound(statement)
        reads = _loads(statement)
        # A call or an augmented or item assignment may change the names it reads.
        changed = reads if isinstance(statement, ast.Expr | ast.AugAssign) else set()
        for node in ast.walk(statement):
            if isinstance(node, ast.Subscript | ast.Attribute) and not isinstance(
                node.ctx, ast.Load
            ):
                changed |= _loads(node)
        fresh = stored if isinstance(statement, ast.Assign | ast.AnnAssign) else set()
        entry = self.test_only(statement, stored | changed, fresh)
        entry.setup = isinstance(statement, ast.Expr) and all(
            self.kind.get(n, "fixed") == "fixed" for n in reads
        )

    def test_only(
        self, statement: ast.stmt, binds: set[str], fresh: set[str], fixed: bool = False
    ) -> _Entry:
        """A statement of the test alone: it runs in the judge box, and in the program's
        box only where a leaf needs what it binds. The names it binds are the test's."""
        entry = _Entry(statement, False, binds, fresh, _loads(statement))
        self.entries.append(entry)
        self.judge.append(statement)
        named = isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for name in fresh if named else _bound(statement):
            self.kind[name] = "fixed" if fixed else "data"
        return entry

    def program_statement(self, statement: ast.stmt) -> None:
        """`NAME = <leaf>`, `a, b = <leaf>` or `<leaf>` alone: run in the program's box
        as written (an exception there ends it: the test fails); the names are held."""
        value = getattr(statement, "value", None)
        if isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        else:
            targets = []
        names_only = all(
            isinstance(t, ast.Name)
            or (
                isinstance(t, ast.Tuple | ast.List)
                and all(isinstance(e, ast.Name | ast.Starred) for e in t.elts)
            )
            for t in targets
        )
        shaped = (isinstance(statement, ast.Expr) or (targets and names_only)) and value
        if not shaped or not self.is_leaf(value, frozenset()):
            raise _refuse(
                statement, self.source,
                "computes with the program's values outside an assert, in the program's box; "
                "bind only a call's result (`r = f(3)`) or call it alone (`sort_in_place(a)`), "
                "and do the rest inside the assert (`assert r - 10 == 5`)",
            )  # fmt: skip
        _refuse_walrus(value, self.source)
        reads = _loads(value)
        stored = set().union(*(_bound(t) for t in targets)) if targets else set()
        self.entries.append(_Entry(statement, True, stored, stored, reads))
        self.hold(reads)
        for name in stored:
            self.kind[name] = "held"

    def hold(self, names: set[str]) -> None:
        """The test's data passed into the program: its box's copy is the one read now."""
        for name in names:
            if self.kind.get(name) == "data":
                self.kind[name] = "held"

    def program_statements(self) -> list[ast.stmt]:
        """The program box's statements: every program one, and a test one where it
        binds (or may change) a name a later kept statement reads, or sets up modules."""
        needed: set[str] = set()
        kept: list[ast.stmt] = []
        for entry in reversed(self.entries):
            if entry.program or entry.setup or entry.binds & needed:
                kept.append(entry.statement)
                needed = (needed - entry.rebinds) | entry.reads
        return kept[::-1]


class _Leaves(ast.NodeTransformer):
    """Replaces each leaf of an assert's expression by `__looprl_value__(site, i)` and
    collects the leaves; refuses what the judge box must not do with program values."""

    def __init__(self, splitter: _Splitter, site: int, leaves: list[ast.expr]):
        self.splitter, self.site, self.leaves = splitter, site, leaves
        self.local: frozenset[str] = frozenset()

    def visit(self, node: ast.AST) -> ast.AST:
        splitter = self.splitter
        if not isinstance(node, ast.expr):
            return self.generic_visit(node)  # keywords, slices' parts
        if not splitter.involves(node, self.local):
            return node
        if splitter.is_leaf(node, self.local):
            inner = _loads(node) & self.local
            if inner:
                raise _refuse(
                    node, splitter.source,
                    f"calls the program with `{sorted(inner)[0]}`, a variable of the "
                    "comprehension or lambda around it: the iteration would run in the "
                    "program's box, where it could be cut short; write one top-level assert "
                    "per input (`assert f(0) > 0`) or assert on a list the program returns",
                )  # fmt: skip
            _refuse_walrus(node, splitter.source)
            self.leaves.append(node)
            call = ast.Call(
                ast.Name(_VALUE, ast.Load()),
                [ast.Constant(self.site), ast.Constant(len(self.leaves) - 1)],
                [],
            )
            return ast.copy_location(call, node)
        if isinstance(node, ast.NamedExpr):
            raise _refuse(
                node,
                splitter.source,
                "binds a name with := inside an assert; bind it in a statement of its own",
            )
        if isinstance(node, ast.Call) and _unsafe(node.func, splitter):
            raise _refuse(
                node,
                splitter.source,
                "turns the program's data into code, names or files in the judge box; "
                "compare the program's value with the expected one instead",
            )
        if isinstance(node, (ast.Lambda, *_COMPREHENSIONS)):
            return self.scoped(node)
        return self.generic_visit(node)

    def scoped(self, node: ast.expr) -> ast.AST:
        outer = self.local
        if isinstance(node, ast.Lambda):
            node.args = self.generic_visit(node.args)
            self.local = outer | _bound(node.args)
            node.body = self.visit(node.body)
        else:
            first = node.generators[0]
            first.iter = self.visit(first.iter)
            self.local = outer | _comprehension_names(node)
            for generator in node.generators:
                if generator is not first:
                    generator.iter = self.visit(generator.iter)
                generator.ifs = [self.visit(i) for i in generator.ifs]
            for field in ("elt", "key", "value"):
                if hasattr(node, field):
                    setattr(node, field, self.visit(getattr(node, field)))
        self.local = outer
        return node


def _unsafe(func: ast.expr, splitter: _Splitter) -> bool:
    if isinstance(func, ast.Name):
        return func.id in _UNSAFE and splitter.kind.get(func.id) is None
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in _UNSAFE_LOADS
        and func.attr.startswith("load")
    )


def _refuse_walrus(node: ast.AST, source: str) -> None:
    for n in ast.walk(node):
        if isinstance(n, ast.NamedExpr):
            raise _refuse(
                n,
                source,
                "binds a name with := where the program is used; bind it in a statement of its own",
            )


def _comprehension_names(node: ast.expr) -> frozenset[str]:
    return frozenset().union(*(_bound(g.target) for g in node.generators))


def _has_value(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == _VALUE
        for n in ast.walk(node)
    )


def _import(module: str) -> ast.stmt:
    return ast.Import([ast.alias(module)])


def _no_arguments() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


def _unparse(statements: list[ast.stmt]) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module(statements, type_ignores=[])))
