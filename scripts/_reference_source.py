"""Help text of config fields from their source, for ``scripts/gen_reference.py``: the comments in
the body of the dataclass that declares a field -- the full-line ``#`` block directly above it, then
its trailing ``# comment``, joined (``ast`` + ``tokenize`` over ``inspect.getsource``; pragmas like
``# noqa`` dropped) -- else an entry ``name: text`` (or ``a, b: text``) in that class's docstring.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize
from functools import cache

_PRAGMA = re.compile(r"^(noqa|fmt:|type:|pragma|pylint:|ruff:)")


def _comment_text(token: str) -> str:
    text = token.lstrip("#").strip()
    return "" if _PRAGMA.match(text) else text


@cache
def _class_source(cls: type) -> tuple[ast.ClassDef, list[str], dict[int, tuple[str, bool]]]:
    """The class's AST, its source lines and its comments: line -> (text, whole line)."""
    src = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(src)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    lines = src.splitlines()
    comments: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (_comment_text(tok.string), not lines[row - 1][:col].strip())
    return node, lines, comments


def _docstring_entries(doc: str, names: set[str]) -> dict[str, str]:
    """``name: text`` / ``a, b: text`` entries of a docstring, continuation lines indented deeper."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    i = 0
    entry = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:\s+(\S.*)$")
    while i < len(lines):
        m = entry.match(lines[i])
        keys = [k.strip() for k in m.group(2).split(",")] if m else []
        if not m or not set(keys) <= names:
            i += 1
            continue
        indent, parts = len(m.group(1)), [m.group(3).strip()]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
            parts.append(lines[i].strip())
            i += 1
        for key in keys:
            out[key] = " ".join(parts)
    return out


@cache
def source_help(cls: type) -> dict[str, str]:
    """Help of the fields *declared* in ``cls`` (not inherited), from comments or the docstring."""
    node, lines, comments = _class_source(cls)
    own: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 1
        while row >= 1 and row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        trailing = [
            comments[r][0] for r in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            if r in comments and not comments[r][1]
        ]  # fmt: skip
        own[stmt.target.id] = " ".join(t for t in above + trailing if t)
    from_doc = _docstring_entries(ast.get_docstring(node) or "", set(own))
    return {name: text or from_doc.get(name, "") for name, text in own.items()}


def class_summary(cls: type) -> str:
    """First paragraph of the class's own docstring (not the signature dataclasses puts there)."""
    node, _, _ = _class_source(cls)
    doc = ast.get_docstring(node) or ""
    return " ".join(doc.split("\n\n")[0].split())


def declaring_class(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))
