"""Planted bugs, SWE-smith style: small, line-precise edits of a real library's Python source.

Each candidate is found on the AST but applied as a text edit of the exact byte span it changes, so a
mutated file differs from the original only there: the gold patch is a one-hunk diff and everything
else (comments, formatting) stays byte-identical. (``ast`` column offsets count UTF-8 bytes, so spans
are byte offsets into the encoded source.) Kinds:

- ``flip_comparison``: one comparison operator (``<`` <-> ``<=``, ``==`` <-> ``!=``, ``in`` <-> ``not in`` ...);
- ``off_by_one``: an integer literal in a function body +-1, or a ``range()`` bound +-1;
- ``drop_branch``: an ``if`` without ``else`` removed with its body, or a final ``elif`` clause removed;
- ``wrong_default``: a parameter's default literal changed (``True`` <-> ``False``, an int +1);
- ``swap_operator``: ``+`` <-> ``-`` (also ``+=`` <-> ``-=``), ``&`` <-> ``|``, ``<<`` <-> ``>>``, ``and`` <-> ``or``;
- ``wrong_return``: ``return x`` returns another local (the nearest one assigned before, else a parameter).

Only code inside functions is mutated; asserts, decorators and annotations are left alone. Candidates
come in source order; :func:`order` shuffles them from a seed, kinds interleaved.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("flip_comparison", "off_by_one", "drop_branch", "wrong_default", "swap_operator", "wrong_return")

_COMPARE = {  # op -> (how it is spelled in the gap between operands, what it becomes)
    ast.Lt: (r"(?<![<>=!])<(?![<=])", "<="),
    ast.LtE: (r"<=", "<"),
    ast.Gt: (r"(?<![<>=!-])>(?![>=])", ">="),
    ast.GtE: (r">=", ">"),
    ast.Eq: (r"==", "!="),
    ast.NotEq: (r"!=", "=="),
    ast.Is: (r"\bis\b(?!\s+not\b)", "is not"),
    ast.IsNot: (r"\bis\s+not\b", "is"),
    ast.In: (r"(?<!not )\bin\b", "not in"),
    ast.NotIn: (r"\bnot\s+in\b", "in"),
}
_BINARY = {
    ast.Add: (r"(?<![+=])\+(?!=)", "-"),
    ast.Sub: (r"(?<![-=])-(?![=>])", "+"),
    ast.BitAnd: (r"&(?!=)", "|"),
    ast.BitOr: (r"\|(?!=)", "&"),
    ast.LShift: (r"<<(?!=)", ">>"),
    ast.RShift: (r">>(?!=)", "<<"),
}
_AUGMENTED = {ast.Add: (r"\+=", "-="), ast.Sub: (r"-=", "+=")}
_BOOLEAN = {ast.And: (r"\band\b", "or"), ast.Or: (r"\bor\b", "and")}
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)


@dataclass(frozen=True)
class Mutation:
    file: str  # repository-relative path
    qualname: str  # the enclosing function, as Python spells it (``Class.method``, ``f.<locals>.g``)
    line: int  # 1-based line of the edit
    kind: str  # one of KINDS
    description: str  # one line, for people (the problem statement never shows it)
    start: int  # byte span [start, end) of the encoded source that is replaced
    end: int
    old: str
    new: str


class _Source:
    """The encoded source with line starts, for turning ``(lineno, col_offset)`` into byte offsets."""

    def __init__(self, text: str):
        self.data = text.encode("utf-8")
        self.starts = [0]
        for i, byte in enumerate(self.data):
            if byte == 0x0A:
                self.starts.append(i + 1)

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def text(self, start: int, end: int) -> str:
        return self.data[start:end].decode("utf-8")

    def line_end(self, line: int) -> int:
        """Offset just past line ``line``'s newline (or the end of the file)."""
        return self.starts[line] if line < len(self.starts) else len(self.data)


def apply(source: str, mutation: Mutation) -> str:
    """``source`` with the mutation's span replaced; refuses a source whose span no longer holds ``old``."""
    data = source.encode("utf-8")
    if data[mutation.start : mutation.end].decode("utf-8", "replace") != mutation.old:
        raise ValueError(f"{mutation.file}:{mutation.line}: the source no longer holds {mutation.old!r}")
    return (data[: mutation.start] + mutation.new.encode("utf-8") + data[mutation.end :]).decode("utf-8")


def _qual_for_def(qual: str, parent_is_function: bool, name: str) -> str:
    return f"{qual}.<locals>.{name}" if parent_is_function else (f"{qual}.{name}" if qual else name)


def _one_match(pattern: str, gap: str) -> re.Match | None:
    """The operator's spelling in the text between two operands; None when a comment is there or the
    spelling is not unique (then the edit could land in the wrong place)."""
    if "#" in gap:
        return None
    found = list(re.finditer(pattern, gap))
    return found[0] if len(found) == 1 else None


class _Finder:
    def __init__(self, source: str, file: str):
        self.src, self.file = _Source(source), file
        self.found: list[Mutation] = []

    def add(self, qual: str, line: int, kind: str, description: str, start: int, end: int, new: str) -> None:
        self.found.append(Mutation(self.file, qual, line, kind, description, start, end,
                                   self.src.text(start, end), new))  # fmt: skip

    def operator(self, qual, kind, left: ast.AST, right: ast.AST, pattern: str, new: str) -> None:
        gap_start = self.src.offset(left.end_lineno, left.end_col_offset)
        gap_end = self.src.offset(right.lineno, right.col_offset)
        match = _one_match(pattern, self.src.text(gap_start, gap_end))
        if match:
            line = left.end_lineno + self.src.text(gap_start, gap_start + match.start()).count("\n")
            old = match.group(0)
            described = {"flip_comparison": "flipped comparison", "swap_operator": "swapped operator"}[kind]
            self.add(qual, line, kind, f"{described} `{old}` -> `{new}`", gap_start + match.start(),
                     gap_start + match.end(), new)  # fmt: skip

    def constant(self, qual, node: ast.Constant, kind: str, what: str) -> None:
        value = node.value
        if isinstance(value, bool):  # a flag is a wrong default, not an off-by-one
            news = [str(not value)] if kind == "wrong_default" else []
        elif isinstance(value, int) and self.src.text(*self.src.span(node)) == str(value):
            news = [str(value + 1)] + ([str(value - 1)] if value >= 1 else [])
        else:
            return
        for new in news:
            self.add(qual, node.lineno, kind, f"{what} `{value}` -> `{new}`", *self.src.span(node), new)

    def drop(self, qual, kind, first: ast.stmt, last: ast.stmt, header: str) -> None:
        """Removes whole lines ``first.lineno .. last.end_lineno`` when nothing else shares them."""
        start, end = self.src.starts[first.lineno - 1], self.src.line_end(last.end_lineno)
        head = self.src.text(start, self.src.offset(first.lineno, first.col_offset))
        tail = self.src.text(self.src.offset(last.end_lineno, last.end_col_offset), end)
        if head.strip() or tail.strip() and not tail.strip().startswith("#"):
            return
        self.add(qual, first.lineno, kind, f"dropped branch `{header}`", start, end, "")

    def returned(self, qual, func, node: ast.Return) -> None:
        params = [a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)]
        params = [p for p in params if p not in ("self", "cls")]
        stores: dict[str, int] = {}
        for sub in ast.walk(func):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and sub.lineno < node.lineno:
                stores[sub.id] = max(stores.get(sub.id, 0), sub.lineno)
        name = node.value.id
        others = sorted((line, n) for n, line in stores.items() if n != name)
        choice = others[-1][1] if others else next((p for p in params if p != name), None)
        if choice is not None:
            self.add(qual, node.lineno, "wrong_return", f"returns `{choice}` instead of `{name}`",
                     *self.src.span(node.value), choice)  # fmt: skip


def _is_text(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.JoinedStr)
        or isinstance(node, ast.Constant)
        and isinstance(node.value, str | bytes)
    )


def candidates(source: str, file: str) -> list[Mutation]:
    """Every mutation of ``source`` (path ``file``) in source order. Each one compiles and changes the
    AST; an unparsable source raises ValueError naming ``file``."""
    try:
        tree = ast.parse(source, filename=file)
    except SyntaxError as exc:
        raise ValueError(f"{file}: not parsable Python ({exc.msg}, line {exc.lineno})") from exc
    finder = _Finder(source, file)
    in_format = {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
    for node, qual, func in _qualified(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params, defaults = [*node.args.posonlyargs, *node.args.args], node.args.defaults
            pairs = [*zip(params[len(params) - len(defaults) :], defaults, strict=True),
                     *zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)]  # fmt: skip
            for arg, default in pairs:
                if isinstance(default, ast.Constant):
                    finder.constant(qual, default, "wrong_default", f"default of `{arg.arg}`:")
            continue
        if func is None or id(node) in in_format:
            continue
        if isinstance(node, ast.Compare):
            for left, op, right in zip(
                [node.left, *node.comparators[:-1]], node.ops, node.comparators, strict=True
            ):
                pattern, new = _COMPARE[type(op)]
                finder.operator(qual, "flip_comparison", left, right, pattern, new)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            if not (isinstance(node.op, ast.Add) and (_is_text(node.left) or _is_text(node.right))):
                finder.operator(qual, "swap_operator", node.left, node.right, *_BINARY[type(node.op)])
        elif isinstance(node, ast.AugAssign) and type(node.op) in _AUGMENTED and not _is_text(node.value):
            finder.operator(qual, "swap_operator", node.target, node.value, *_AUGMENTED[type(node.op)])
        elif isinstance(node, ast.BoolOp):
            for left, right in zip(node.values, node.values[1:], strict=False):
                finder.operator(qual, "swap_operator", left, right, *_BOOLEAN[type(node.op)])
        elif isinstance(node, ast.Constant):
            finder.constant(qual, node, "off_by_one", "off by one:")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            bound = node.args[1] if len(node.args) > 1 else node.args[0] if node.args else None
            if bound is not None and not isinstance(bound, ast.Constant):
                text = finder.src.text(*finder.src.span(bound))
                text = text if isinstance(bound, _ATOMS) else f"({text})"
                for sign in ("+", "-"):
                    finder.add(qual, bound.lineno, "off_by_one", f"range bound `{text}` -> `{text} {sign} 1`",
                               *finder.src.span(bound), f"{text} {sign} 1")  # fmt: skip
        elif isinstance(node, ast.If):
            _branches(finder, qual, node)
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
            finder.returned(qual, func, node)
    return [m for m in finder.found if _changes_code(source, m)]


def _branches(finder: _Finder, qual: str, node: ast.If) -> None:
    header = finder.src.text(
        finder.src.offset(node.lineno, node.col_offset), finder.src.line_end(node.lineno)
    )
    header = header.strip().split("\n")[0]
    if (
        node.orelse
        and len(node.orelse) == 1
        and isinstance(node.orelse[0], ast.If)
        and not node.orelse[0].orelse
    ):
        elif_node = node.orelse[0]
        elif_line = finder.src.text(
            finder.src.starts[elif_node.lineno - 1], finder.src.line_end(elif_node.lineno)
        )
        if elif_line.lstrip().startswith("elif"):
            first = ast.If(lineno=elif_node.lineno, col_offset=elif_line.index("elif"), end_lineno=elif_node.lineno,
                           end_col_offset=0, test=elif_node.test, body=[], orelse=[])  # fmt: skip
            finder.drop(qual, "drop_branch", first, elif_node.body[-1], elif_line.strip())
    if not node.orelse and getattr(node, "_siblings", 2) > 1:
        finder.drop(qual, "drop_branch", node, node.body[-1], header)


def _qualified(tree: ast.Module) -> Iterator[tuple[ast.AST, str, ast.AST | None]]:
    """(node, qualname, enclosing def) for every node, Python's ``__qualname__`` rules; marks each
    ``if`` with how many statements share its block (a lone ``if`` is never dropped: the block would be
    empty)."""

    def visit(node, qual, func, in_function):
        for _field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST) or isinstance(child, ast.expr_context):
                    continue
                if isinstance(child, ast.If) and isinstance(value, list):
                    child._siblings = len(value)
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = _qual_for_def(qual, in_function, child.name)
                    yield child, name, func
                    for stmt in child.body:
                        if isinstance(stmt, ast.If):
                            stmt._siblings = len(child.body)
                        yield from visit_node(stmt, name, child, True)
                elif isinstance(child, ast.ClassDef):
                    name = _qual_for_def(qual, in_function, child.name)
                    for stmt in child.body:
                        yield from visit_node(stmt, name, None, False)
                else:
                    yield from visit_node(child, qual, func, in_function)

    def visit_node(node, qual, func, in_function):
        if isinstance(node, ast.Assert):  # a check, not behaviour
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            holder = ast.Module(body=[node], type_ignores=[])
            yield from visit(holder, qual, func, in_function)
            return
        yield node, qual, func
        yield from visit(node, qual, func, in_function)

    yield from visit(tree, "", None, False)


def _changes_code(source: str, mutation: Mutation) -> bool:
    try:
        mutated = apply(source, mutation)
        return ast.dump(ast.parse(mutated)) != ast.dump(ast.parse(source))
    except (SyntaxError, ValueError):
        return False


def order(found: list[Mutation], seed: int) -> list[Mutation]:
    """A seeded shuffle with kinds interleaved (one of each kind in turn), so the first tries already
    cover every kind a library offers; the same ``(found, seed)`` always gives the same order."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Mutation]] = {}
    for m in sorted(found, key=lambda m: (m.file, m.start, m.kind, m.new)):
        by_kind.setdefault(m.kind, []).append(m)
    for group in by_kind.values():
        rng.shuffle(group)
    kinds = [k for k in KINDS if k in by_kind]
    rng.shuffle(kinds)
    out: list[Mutation] = []
    while any(by_kind[k] for k in kinds):
        out += [by_kind[k].pop(0) for k in kinds if by_kind[k]]
    return out
