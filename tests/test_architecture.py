"""The package's shape: one-way layers (import-linter's contracts in pyproject.toml), no import cycle
at any depth, small files, and docs/ARCHITECTURE.md's room table naming exactly what exists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_npu"
KERNELS = ROOT / "kernels"  # installed as areal_npu.kernels
MAX_LINES = 500


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run(
        [*cmd, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )


def test_import_contracts_hold(tmp_path):
    # not from the repository root: there `areal_npu` is found as a plain directory, without the
    # areal_npu.kernels that the install maps in from kernels/
    out = _lint_imports(tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module are the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    """An independent check of the acyclic contract: strongly connected modules in grimp's graph."""
    graph = grimp.build_graph("areal_npu", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _strongly_connected(edges) == []
    # the oracle itself finds a planted cycle
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _copy_package(tmp: Path) -> Path:
    shutil.copytree(PACKAGE, tmp / "areal_npu", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(KERNELS, tmp / "areal_npu" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp / "areal_npu"


def _append_import(module_file: Path, target: str) -> None:
    with module_file.open("a") as f:
        f.write(f"\n\ndef _planted():\n    import {target}  # noqa\n")


def test_contracts_catch_a_planted_upward_import(tmp_path):
    copy = _copy_package(tmp_path)
    _append_import(copy / "compat" / "__init__.py", "areal_npu.names")  # the leaf imports a layer above
    out = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert out.returncode != 0
    assert "areal_npu.compat -> areal_npu.names" in out.stdout


def test_contracts_catch_a_planted_cycle_inside_a_package(tmp_path):
    graph = grimp.build_graph("areal_npu", cache_dir=None)
    # an import between two modules of one subpackage, planted back the other way
    importer, imported = next(
        (a, b)
        for a in sorted(graph.modules)
        for b in sorted(graph.find_modules_directly_imported_by(a))
        if a.count(".") == 2 and b.rsplit(".", 1)[0] == a.rsplit(".", 1)[0] and not b.endswith("__init__")
        and (PACKAGE / Path(*b.split(".")[1:])).with_suffix(".py").exists()
    )
    copy = _copy_package(tmp_path)
    _append_import(copy / Path(*imported.split(".")[1:]).with_suffix(".py"), importer)
    out = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert out.returncode != 0
    assert "no import cycles between siblings, at any depth BROKEN" in out.stdout


def _sources() -> list[Path]:
    return sorted(p for base in (PACKAGE, KERNELS) for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_source_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by meaning (style: small modules): {long}"


# -- docs/ARCHITECTURE.md's room table ------------------------------------------------------------------

def _room_rows() -> list[tuple[list[str], set[str]]]:
    """(paths of the first cell, every backticked name in the row) for each row of the room table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first, rest = line[1:].split("|", 1)
        paths = re.findall(r"`([^`]+)`", first)
        names = set()
        for token in re.findall(r"`([^`]+)`", line):
            word = re.split(r"[:\s(]", token.strip(), maxsplit=1)[0].rstrip("/")
            names.add(word.rsplit("/", 1)[-1].removesuffix(".py"))
        rows.append((paths, names))
    return rows


def _resolve(path: str) -> Path:
    path = path.split(" ")[0]
    if path.startswith("kernels/"):
        return ROOT / path
    return ROOT / path if path.startswith("areal_npu/") else PACKAGE / path


def _children(directory: Path) -> set[str]:
    return {
        p.stem if p.is_file() else p.name
        for p in directory.iterdir()
        if p.name != "__pycache__" and p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())
    }


def test_room_table_names_only_what_exists():
    for paths, _ in _room_rows():
        for path in paths:
            assert _resolve(path).exists(), f"docs/ARCHITECTURE.md names {path}, which does not exist"


def test_room_table_names_every_module():
    rows = _room_rows()
    first_cells = {_resolve(p).resolve() for paths, _ in rows for p in paths}
    top = {PACKAGE / n if (PACKAGE / n).is_dir() else PACKAGE / f"{n}.py" for n in _children(PACKAGE)}
    top.add(KERNELS)
    missing = sorted(str(p.relative_to(ROOT)) for p in top if p.resolve() not in first_cells)
    assert missing == [], f"rooms without a row in docs/ARCHITECTURE.md: {missing}"
    # each package row names every module of its package (and of its subpackages without a row)
    for paths, names in rows:
        for path in paths:
            directory = _resolve(path)
            if not directory.is_dir():
                continue
            unnamed = sorted(
                str(sub.relative_to(ROOT)) + f"/{name}.py"
                for sub in [directory, *(d for d in directory.iterdir() if (d / "__init__.py").exists())]
                if sub == directory or sub.resolve() not in first_cells
                for name in _children(sub)
                if (sub / f"{name}.py").exists() and name not in names
            )
            assert unnamed == [], f"docs/ARCHITECTURE.md's row for {path} does not name {unnamed}"
