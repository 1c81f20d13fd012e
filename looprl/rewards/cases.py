"""A code test, judged outside the program: what goes into the box, and the verdict on
what comes back.

A test is one of:

- **a script** whose top-level `assert`s are the checks (`assert f(2) == 4`). The
  script's other statements run in the box after the program (setup: imports,
  variables). Of each assert, the box evaluates only the parts that need the program (the
  *leaves*: `f(2)`, `Solution().solve([3, 1])`, a name the setup bound) and sends their
  values back as plain data; the comparison, the expected values, and the few builtins a
  test applies to a result (`len`, `sorted`, `abs`, `math.isclose`, ...) are evaluated
  here. The expected side never enters the box, so no object the program makes (an
  `__eq__` that is always true), nothing it patches (`builtins.compile`, `json`), and
  nothing it reads from its frames decides a pass. HumanEval's `def check(candidate)`
  with asserts in its body, called once as `check(name)`, is unrolled into top-level
  asserts.
- **a stdin/stdout case** `{"input": ..., "output": ...}`: the program reads the input and
  passes when its stdout equals the output (trailing whitespace of each line and trailing
  blank lines ignored) and it exits 0.

A test this cannot judge outside the program is refused with the reason (an assert
inside a loop, a function or a branch; a comparison of two values the program computes),
since the program could decide it.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from dataclasses import dataclass
from typing import Any

# Builtins a test may apply to a program's values, evaluated here on plain data.
_FUNCTIONS = {
    f.__name__: f
    for f in (
        abs,
        all,
        any,
        bool,
        dict,
        float,
        frozenset,
        int,
        len,
        list,
        max,
        min,
        round,
        set,
        sorted,
        str,
        sum,
        tuple,
    )  # fmt: skip
}
_MATH = {
    name: getattr(math, name)
    for name in (
        "ceil",
        "e",
        "fabs",
        "floor",
        "inf",
        "isclose",
        "isinf",
        "isnan",
        "nan",
        "pi",
        "sqrt",
        "tau",
    )  # fmt: skip
}
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_,
    ast.IsNot: operator.is_not, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}  # fmt: skip
_LEAF = "__looprl_leaf_"
_MAX_ITEMS = 1_000_000  # the largest sequence an expression here may build


class UnjudgeableTest(ValueError):
    """A test that could only be judged inside the program's interpreter."""


@dataclass(frozen=True)
class Site:
    """One top-level assert: its expression with the leaves replaced by placeholders."""

    line: int
    source: str
    expression: ast.expr
    leaves: int


@dataclass(frozen=True)
class ScriptTest:
    script: str  # what runs in the box after the program
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
    return _split_script(_unroll_check(module), test)


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


def _split_script(module: ast.Module, source: str) -> ScriptTest:
    known: dict[str, ast.expr] = {}  # names the script bound to values judged here
    statements: list[ast.stmt] = []
    sites: list[Site] = []
    for statement in module.body:
        if isinstance(statement, ast.Assert):
            leaves: list[ast.expr] = []
            expression = _Split(known, leaves).visit(copy.deepcopy(statement.test))
            _refuse_program_against_program(expression, statement)
            calls = [ast.Lambda(args=_no_arguments(), body=leaf) for leaf in leaves]
            emit = ast.Call(
                func=ast.Name("__looprl_emit__", ast.Load()),
                args=[ast.Constant(len(sites)), *calls],
                keywords=[],
            )
            statements.append(ast.Expr(emit))
            text = ast.get_source_segment(source, statement) or ast.unparse(statement)
            sites.append(Site(statement.lineno, text[:200], expression, len(leaves)))
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Assert):
                raise UnjudgeableTest(
                    f"line {node.lineno}: an assert inside a {type(statement).__name__.lower()} "
                    "statement runs in the program's interpreter, where the program could decide "
                    "it; write each check as a top-level assert, or use stdin/stdout cases"
                )
        _track_names(statement, known)
        statements.append(statement)
    if not sites:
        raise UnjudgeableTest(
            "the test has no top-level assert: a test is judged by its top-level asserts "
            "(evaluated outside the program) or is a stdin/stdout case"
        )
    script = ast.unparse(ast.fix_missing_locations(ast.Module(statements, type_ignores=[])))
    return ScriptTest(script, sites)


def _no_arguments() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


def _track_names(statement: ast.stmt, known: dict[str, ast.expr]) -> None:
    """After `statement`: `NAME = <value judged here>` makes NAME known; any other
    binding of a name forgets it."""
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        leaves: list[ast.expr] = []
        value = _Split(known, leaves).visit(copy.deepcopy(statement.value))
        name = statement.targets[0].id
        if leaves:  # the program computes it: judged in the box from here on
            known.pop(name, None)
        else:
            known[name] = value
        return
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            known.pop(node.id, None)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            known.pop(node.name, None)
        elif isinstance(node, ast.alias):
            known.pop((node.asname or node.name).split(".")[0], None)


class _Split(ast.NodeTransformer):
    """Keeps what is judged here (literals, operators, comparisons, the allowed builtins,
    names bound to such values) and turns every other subexpression into a leaf: a
    placeholder here, a value the box computes."""

    def __init__(self, known: dict[str, ast.expr], leaves: list[ast.expr]):
        self.known, self.leaves = known, leaves

    def leaf(self, node: ast.expr) -> ast.Name:
        self.leaves.append(node)
        return ast.Name(f"{_LEAF}{len(self.leaves) - 1}", ast.Load())

    def generic_visit(self, node: ast.AST) -> ast.AST:
        # Operators and contexts stay; any expression kind not kept below is a leaf.
        return self.leaf(node) if isinstance(node, ast.expr) else node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return node

    def _children(self, node: ast.AST) -> ast.AST:
        return super().generic_visit(node)

    visit_Tuple = visit_List = visit_Set = visit_Dict = _children
    visit_BinOp = visit_BoolOp = visit_Compare = visit_IfExp = _children

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return self._children(node) if type(node.op) in _UNARY else self.leaf(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.known:
            return copy.deepcopy(self.known[node.id])
        return node if node.id in _FUNCTIONS else self.leaf(node)  # sorted(x, key=len)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        return node if _is_math(node) else self.leaf(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        func = node.func
        allowed = (isinstance(func, ast.Name) and func.id in _FUNCTIONS) or _is_math(func)
        if not allowed or any(isinstance(a, ast.Starred) for a in node.args):
            return self.leaf(node)
        if any(k.arg is None for k in node.keywords):
            return self.leaf(node)
        node.args = [self.visit(a) for a in node.args]
        for keyword in node.keywords:
            keyword.value = self.visit(keyword.value)
        return node


def _is_math(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and node.attr in _MATH
    )


def _has_leaf(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id.startswith(_LEAF) for n in ast.walk(node))


def _refuse_program_against_program(expression: ast.expr, statement: ast.Assert) -> None:
    for node in ast.walk(expression):
        if isinstance(node, ast.Compare) and all(
            _has_leaf(side) for side in [node.left, *node.comparators]
        ):
            raise UnjudgeableTest(
                f"line {statement.lineno}: `{ast.unparse(statement)[:120]}` compares values "
                "that all come from the program's interpreter, which could make them agree; "
                "compare the program's value with a literal (or a name the test binds to one)"
            )


# ---- the verdict ---------------------------------------------------------------------


def judge_script(test: ScriptTest, records: list[dict]) -> tuple[bool, str]:
    """(passed, why not) from the box's records: every assert reported once, with values
    that make it true here, and the script ran to its end."""
    values: dict[int, list[dict]] = {}
    done = False
    for record in records:
        if record == {"done": True} and not done:
            done = True
            continue
        site = record.get("site")
        if (
            done
            or set(record) != {"site", "values"}
            or type(site) is not int
            or not 0 <= site < len(test.sites)
            or site in values
            or not isinstance(record["values"], list)
            or len(record["values"]) != test.sites[site].leaves
        ):
            return False, f"a results record out of place: {str(record)[:120]}"
        values[site] = record["values"]
    for index, site in enumerate(test.sites):
        if index not in values:
            return False, f"line {site.line}: `{site.source}` was never reached"
        try:
            leaves = [_leaf_value(v) for v in values[index]]
            if not _Evaluate(leaves).run(site.expression):
                return False, f"line {site.line}: `{site.source}` is false"
        except _LeafError as e:
            return False, f"line {site.line}: `{site.source}` raised {e}"
        except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, RecursionError) as e:
            return False, f"line {site.line}: `{site.source}`: {type(e).__name__}: {e}"[:300]
    if not done:
        return False, "the test did not run to its end"
    return True, ""


def judge_stdio(test: StdioTest, stdout: str, returncode: int | None) -> tuple[bool, str]:
    if _lines(stdout) != _lines(test.output):
        return False, "the output differs from the expected output"
    if returncode != 0:
        return False, f"the program exited with status {returncode}"
    return True, ""


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class _LeafError(Exception):
    """A leaf the box could not compute (an exception in the program)."""


def _leaf_value(entry: Any) -> Any:
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ValueError("a malformed value")
    if "error" in entry:
        return _Failed(str(entry["error"])[:300])
    if "value" not in entry:
        raise ValueError("a malformed value")
    return decode(entry["value"])


@dataclass(frozen=True)
class _Failed:
    error: str


def decode(data: Any) -> Any:
    """The plain value the box's tagged JSON stands for."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        (tag, items), = data.items()  # fmt: skip
        if tag == "$bytes" and type(items) is str:
            return bytes.fromhex(items)
        if type(items) is list:
            if tag == "$tuple":
                return tuple(decode(v) for v in items)
            if tag == "$set":
                return {decode(v) for v in items}
            if tag == "$frozenset":
                return frozenset(decode(v) for v in items)
            if tag == "$dict" and all(type(p) is list and len(p) == 2 for p in items):
                return {decode(k): decode(v) for k, v in items}
    raise ValueError(f"not a value the box encodes: {str(data)[:100]}")


class _Evaluate:
    """Evaluates a split assert on plain data: only the node kinds `_Split` keeps."""

    def __init__(self, leaves: list[Any]):
        self.leaves = leaves

    def run(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id.startswith(_LEAF):
            value = self.leaves[int(node.id.removeprefix(_LEAF))]
            if isinstance(value, _Failed):
                raise _LeafError(value.error)
            return value
        return self.run_node(node)

    def run_node(self, node: ast.expr) -> Any:
        match node:
            case ast.Constant(value=value):
                return value
            case ast.Tuple(elts=items):
                return tuple(self.run(i) for i in items)
            case ast.List(elts=items):
                return [self.run(i) for i in items]
            case ast.Set(elts=items):
                return {self.run(i) for i in items}
            case ast.Dict(keys=keys, values=values) if None not in keys:
                return {self.run(k): self.run(v) for k, v in zip(keys, values, strict=True)}
            case ast.UnaryOp(op=op, operand=operand):
                return _UNARY[type(op)](self.run(operand))
            case ast.BinOp(left=left, op=op, right=right):
                return _binary(type(op), self.run(left), self.run(right))
            case ast.BoolOp(op=ast.And(), values=values):
                result = True
                for v in values:
                    result = self.run(v)
                    if not result:
                        return result
                return result
            case ast.BoolOp(op=ast.Or(), values=values):
                result = False
                for v in values:
                    result = self.run(v)
                    if result:
                        return result
                return result
            case ast.Compare(left=left, ops=ops, comparators=comparators):
                current = self.run(left)
                for op, comparator in zip(ops, comparators, strict=True):
                    following = self.run(comparator)
                    if not _COMPARE[type(op)](current, following):
                        return False
                    current = following
                return True
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return self.run(body) if self.run(test) else self.run(orelse)
            case ast.Attribute():
                return _MATH[node.attr]
            case ast.Name(id=name):
                return _FUNCTIONS[name]
            case ast.Call(func=func, args=args, keywords=keywords):
                function = (
                    _MATH[func.attr] if isinstance(func, ast.Attribute) else _FUNCTIONS[func.id]
                )
                kwargs = {k.arg: self.run(k.value) for k in keywords}
                return function(*[self.run(a) for a in args], **kwargs)
        raise ValueError(f"cannot evaluate {ast.unparse(node)[:80]} here")


def _binary(op: type, left: Any, right: Any) -> Any:
    """`left op right`, refusing results too large to build here."""
    if op is ast.Pow and isinstance(right, int | float) and abs(right) > 1000:
        raise ValueError(f"an exponent of {right} is too large to evaluate here")
    if op is ast.Pow and isinstance(left, int) and abs(left) > 2**64:
        raise ValueError("a base that large is not raised to a power here")
    if op is ast.Mult:
        for sequence, count in ((left, right), (right, left)):
            sized = isinstance(sequence, str | list | tuple | bytes) and isinstance(count, int)
            if sized and len(sequence) * count > _MAX_ITEMS:
                raise ValueError("a repeated sequence too long to build here")
    return _BINARY[op](left, right)
