"""The agent's change as a diff, and which of its files grading keeps (:mod:`areal_npu.agent.grading`).

:func:`agent_diff` runs git on the host with a private git directory and a fixed configuration, so
nothing the agent can plant in its tree (``.gitattributes``, ``.gitignore``, its own ``.git``,
hooks, filters) changes what the diff says. :func:`filter_diff` drops every file section that could
change how the tests run; the rules are :func:`is_protected`'s, and why each exists is in
:mod:`areal_npu.agent.grading`'s docstring.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from areal_npu.agent.fs import remove_tree

# -- the agent's diff ------------------------------------------------------------------------------------

_GIT_CONFIG = {
    "core.bare": "false", "core.autocrlf": "false", "core.safecrlf": "false", "core.eol": "lf",
    "core.symlinks": "true", "core.fileMode": "true", "core.ignoreCase": "false",
    "core.excludesFile": "/dev/null", "core.attributesFile": "/dev/null", "core.hooksPath": "/dev/null",
    "core.fsmonitor": "false", "core.untrackedCache": "false", "core.splitIndex": "false",
    "core.sparseCheckout": "false", "index.sparse": "false", "diff.noprefix": "false",
    "diff.mnemonicPrefix": "false", "diff.renames": "false", "diff.relative": "false", "color.ui": "false",
    "apply.whitespace": "nowarn", "safe.directory": "*", "advice.addEmbeddedRepo": "false", "gc.auto": "0",
    "maintenance.auto": "false",
}  # fmt: skip
# info/attributes outranks every .gitattributes in a tree: each attribute that changes what git reads
# or writes is reset to "unspecified" (git's defaults), whatever a tree's file (or macro) says.
_ATTRIBUTES = "* !text !eol !crlf !filter !ident !diff !merge !working-tree-encoding\n"


class PrivateGit:
    """A bare git directory of our own in a temporary folder; every setting comes from here."""

    def __init__(self):
        git = shutil.which("git")
        if git is None:
            raise RuntimeError("grading needs git on PATH")
        self.tmp = Path(tempfile.mkdtemp(prefix="areal-git-"))
        self.binary, self.dir = git, self.tmp / "git"
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.tmp), "LC_ALL": "C",
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1",
                    "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}  # fmt: skip
        try:
            self._run([self.binary, "init", "-q", "--bare", "--template=", str(self.dir)], self.tmp)
            (self.dir / "info").mkdir(exist_ok=True)
            (self.dir / "info" / "attributes").write_text(_ATTRIBUTES)
            (self.dir / "info" / "exclude").write_text("")
        except BaseException:
            self.close()
            raise

    def _run(self, argv, cwd, index=None, stdin=None, check=True, what="init") -> subprocess.CompletedProcess:
        env = dict(self.env, GIT_INDEX_FILE=str(self.dir / index)) if index else self.env
        res = subprocess.run(argv, cwd=cwd, env=env, input=stdin, capture_output=True, timeout=900)
        if check and res.returncode != 0:
            why = res.stderr.decode("utf-8", "replace").strip()[-2000:]
            raise RuntimeError(f"git {what} failed: {why}")
        return res

    def __call__(self, *args: str, work_tree: Path | None = None, index=None, stdin=None, check=True):
        work_tree = Path(os.path.abspath(work_tree)) if work_tree is not None else None
        config = [a for k, v in _GIT_CONFIG.items() for a in ("-c", f"{k}={v}")]
        argv = [self.binary, *config, f"--git-dir={self.dir}", f"--work-tree={work_tree or self.tmp}", *args]
        return self._run(argv, work_tree or self.tmp, index, stdin, check, what=args[0])

    def tree(self, work_tree: Path, index: str) -> str:
        """The tree object of everything under ``work_tree`` (ignore files overridden; a fresh index,
        so no stat data from another tree is trusted)."""
        self("add", "--all", "--force", "--", ".", work_tree=work_tree, index=index)
        return self("write-tree", work_tree=work_tree, index=index).stdout.decode().strip()

    def apply(self, repo: Path, patch: str) -> str:
        """Apply ``patch`` to the files under ``repo`` (all or nothing); the error text, "" when it applied."""
        if not patch.strip():
            return ""
        res = self("apply", "--whitespace=nowarn", "-", work_tree=repo, stdin=patch.encode("utf-8", "surrogateescape"),
                   check=False)  # fmt: skip
        return (
            "" if res.returncode == 0 else res.stderr.decode("utf-8", "replace").strip() or "git apply failed"
        )

    def close(self) -> None:
        remove_tree(self.tmp)

    def __enter__(self) -> PrivateGit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def agent_diff(base: Path, episode: Path) -> str:
    """The change from ``base`` to ``episode`` as a git-format unified diff (``a/`` ``b/`` prefixes, full
    blob ids, binary patches, no rename detection: a move is a deletion and an addition, so each side is
    judged on its own). Non-UTF-8 bytes survive as surrogate escapes: write it back with
    ``.encode("utf-8", "surrogateescape")``."""
    for path in (base, episode):
        if not Path(path).is_dir():
            raise ValueError(f"{path} is not a directory")
    with PrivateGit() as git:
        old, new = git.tree(Path(base), "base.index"), git.tree(Path(episode), "episode.index")
        out = git("diff", "--binary", "--full-index", "--no-renames", "--no-ext-diff", "--no-textconv", "--no-color",
                  "--ignore-submodules=none", "--src-prefix=a/", "--dst-prefix=b/", old, new).stdout  # fmt: skip
    return out.decode("utf-8", "surrogateescape")


# -- reading and filtering diffs ----------------------------------------------------------------------------

_SECTION = re.compile(r"^diff --git ", re.M)
_GITLINK = re.compile(
    r"^(?:(?:new file|deleted file|old|new) mode 160000|index [0-9a-f]+\.\.[0-9a-f]+ 160000)$"
)
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


@dataclass(frozen=True)
class FileChange:
    """One file's section of a git diff: the paths it touches (old and new; /dev/null left out)."""

    paths: tuple[str, ...]
    gitlink: bool  # a nested repository's commit (mode 160000): nothing a fresh copy can apply
    text: str


def _unquote(text: str) -> tuple[str, str]:
    """A C-quoted path as git writes it (``"a/t\\303\\251st"``) -> (path, what follows the quote)."""
    out, i = bytearray(), 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return out.decode("utf-8", "surrogateescape"), text[i + 1 :]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in "01234567":
                out.append(int(text[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            if nxt not in _ESCAPES:
                break
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        out += ch.encode("utf-8", "surrogateescape")
        i += 1
    raise ValueError(f"a bad quoted path in a diff header: {text!r}")


def _strip_prefix(name: str, prefix: str) -> str:
    if not name.startswith(prefix):
        raise ValueError(
            f"diff path {name!r} lacks the {prefix!r} prefix (a git diff with a/ b/ prefixes is needed)"
        )
    return name[len(prefix) :]


def _header_names(rest: str) -> tuple[str, str]:
    """The two names of a ``diff --git`` line (git's own rule: equal names split in the middle)."""
    if rest.startswith('"'):
        a, tail = _unquote(rest)
        tail = tail.lstrip(" ")
        b = _unquote(tail)[0] if tail.startswith('"') else tail
    elif rest.endswith('"') and ' "' in rest:
        cut = rest.index(' "')
        a, b = rest[:cut], _unquote(rest[cut + 1 :])[0]
    else:
        half = (len(rest) - 1) // 2
        a, b = rest[:half], rest[half + 1 :]
        if len(rest) % 2 == 0 or a[2:] != b[2:]:  # different names: 'rename from/to' lines say which
            cut = rest.find(" b/")
            a, b = (rest[:cut], rest[cut + 1 :]) if cut >= 0 else (rest, rest)
    return _strip_prefix(a, "a/"), _strip_prefix(b, "b/")


def _patch_name(text: str, prefix: str) -> str | None:
    if text.startswith('"'):
        name = _unquote(text)[0]
    else:
        name = text.split("\t", 1)[0]
    return None if name == "/dev/null" else _strip_prefix(name, prefix)


def _parse_section(text: str) -> FileChange:
    lines = text.split("\n")
    old, new = _header_names(lines[0][len("diff --git ") :])
    gitlink = False
    for line in lines[1:]:
        if line.startswith(("@@", "GIT binary patch", "Binary files ")):
            break
        for key, is_old in (
            ("rename from ", True),
            ("copy from ", True),
            ("rename to ", False),
            ("copy to ", False),
        ):
            if line.startswith(key):
                value = line[len(key) :]
                value = _unquote(value)[0] if value.startswith('"') else value
                old, new = (value, new) if is_old else (old, value)
        if line.startswith("--- "):
            old = _patch_name(line[4:], "a/")
        elif line.startswith("+++ "):
            new = _patch_name(line[4:], "b/")
        gitlink = gitlink or bool(_GITLINK.match(line))
    return FileChange(tuple(dict.fromkeys(p for p in (old, new) if p is not None)), gitlink, text)


def split_diff(diff: str) -> list[FileChange]:
    """The per-file sections of a git-format diff. Text before the first ``diff --git`` line (a mail
    header) is ignored unless it holds a file change, which only a non-git diff would."""
    starts = [m.start() for m in _SECTION.finditer(diff)]
    preamble = diff[: starts[0]] if starts else diff
    if re.search(r"^(?:\+\+\+|---) \S", preamble, re.M) or (not starts and preamble.strip()):
        raise ValueError("not a git-format diff: a file change without a 'diff --git' header")
    return [_parse_section(diff[s:e]) for s, e in zip(starts, [*starts[1:], len(diff)])]


def patch_paths(patch: str) -> list[str]:
    """Every path a git-format patch touches, in order."""
    return list(dict.fromkeys(p for change in split_diff(patch) for p in change.paths))


_PROTECTED_DIRS = frozenset({"tests", "test", "__pycache__", ".pytest_cache", "site-packages", "dist-packages",
                             ".venv", "venv", ".tox", ".nox"})  # fmt: skip
_PROTECTED_NAMES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", ".pytest.ini",
                              "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml"})  # fmt: skip
_PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo", ".egg-link")
_METADATA_SUFFIXES = (".dist-info", ".egg-info")  # entry points: how pytest finds plugins
_RUNNER_MODULES = frozenset(
    {"pytest", "_pytest", "pluggy", "unittest"}
)  # `python -m X` finds these in cwd first


def is_protected(path: str, extra: Iterable[str] = ()) -> bool:
    """Whether a change to ``path`` (repository-relative) is kept out of grading: the default rules
    (module docstring) or one of ``extra`` (a file, or a directory and everything under it)."""
    for item in extra:
        item = item.strip("/")
        if item and (path == item or path.startswith(item + "/")):
            return True
    parts = PurePosixPath(path).parts
    if not parts:
        return False
    name = parts[-1]
    if any(part in _PROTECTED_DIRS or part.endswith(_METADATA_SUFFIXES) for part in parts):
        return True
    if name in _PROTECTED_NAMES or name.endswith(_PROTECTED_SUFFIXES):
        return True
    if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
        return True
    return parts[0].removesuffix(".py") in _RUNNER_MODULES


def filter_diff(diff: str, protected: Iterable[str] = ()) -> tuple[str, list[str]]:
    """``(kept diff, dropped paths)``: every file section that touches a protected path (either side of
    a rename or copy) or records a nested repository is dropped whole."""
    extra = tuple(protected)
    kept, dropped = [], []
    for change in split_diff(diff):
        if change.gitlink or any(is_protected(p, extra) for p in change.paths):
            dropped.extend(change.paths)
        else:
            kept.append(change.text)
    return "".join(kept), sorted(set(dropped))
